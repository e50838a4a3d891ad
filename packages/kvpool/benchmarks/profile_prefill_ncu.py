# requires: cuda; run under Nsight Compute, e.g.
#   ncu --kernel-name regex:prefill --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
#       --section MemoryWorkloadAnalysis --section WarpStateStats python profile_prefill_ncu.py
"""One paged_prefill launch (8 x 4096 new tokens, GQA 32/8, d128, bf16, the default config) for a
profile: whether the kernel is bound by shared memory, tensor cores or latency. Prints only the
shapes: the profile is ncu's."""

from __future__ import annotations

import torch

HQ, H, D, BS = 32, 8, 128, 16


def main() -> None:
    import kvpool
    from kvpool import cuda_prefill

    lens = [4096] * 8
    pool = kvpool.KVPool(1, H, D, sum(L // BS for L in lens) + 8, block_size=BS, dtype=torch.bfloat16,
                         device="cuda", prefix_caching=False, watermark=0.0)
    for b, L in enumerate(lens):
        pool.add_sequence(b, [0])
        pool.append(b, L)
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    cul = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
    cu = torch.tensor(cul, dtype=torch.int32, device="cuda")
    q = torch.randn(cul[-1], HQ, D, device="cuda", dtype=torch.bfloat16)
    print(f"prefill: 8 x 4096 new tokens, GQA {HQ}/{H}, d{D}, config {cuda_prefill.default_config()}", flush=True)
    cuda_prefill.paged_prefill_cuda(q, pool, 0, bt, sl, cu, cul, sl.tolist(), None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
