# requires: cuda; run under Nsight Compute, e.g.
#   ncu --kernel-name regex:paged_decode --section SpeedOfLight --section MemoryWorkloadAnalysis \
#       --section LaunchStats --section Occupancy --section WarpStateStats python profile_decode_ncu.py
"""The sparse decode of issue 15's step (b8, 128K tokens per sequence, GQA 32/8, d128, bf16, 64
selected blocks of 16 tokens per (sequence, kv head), blocks interleaved as bench_select_cuda.py
lays them out) for a profile: what its ~20 us are (latency chain, waves, the split combine).
One launch per split count 1 / 4, then one dense decode. Prints only the shapes."""

from __future__ import annotations

import torch

B, HQ, H, D, BS, CTX, TOP = 8, 32, 8, 128, 16, 128 * 1024, 64


def main() -> None:
    import kvpool
    from bench_decode import build_pool
    from kvpool import cuda_decode

    pool = build_pool(B, CTX, chunk_blocks=64)
    ids = list(range(B))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    nb = CTX // BS
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.rand(B, H, nb, device="cuda", generator=g).topk(TOP, -1).indices.sort(-1).values.to(torch.int32)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    print(f"sparse decode: b{B} x {CTX} tokens, GQA {HQ}/{H}, d{D}, {TOP} blocks per (seq, head)", flush=True)
    for ns in (1, 4):
        cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, idx, num_splits=ns)
    kvpool.paged_decode(q, pool, 0, bt, sl)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
