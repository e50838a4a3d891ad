# requires: cuda
"""get_dispatch_layout on one GPU: our layout kernel vs the same layout in torch ops, same run.

    source scripts/device_env.sh
    python3 packages/deepep/benchmarks/bench_layout.py

The kernel also computes the send positions dispatch needs (torch's side does not). GPU time
(tilehal.bench hides host launch gaps), host time per call printed beside it; torch's figure
includes its own host synchronizations (the id check and the boolean indexing wait for the GPU).
"""

from __future__ import annotations


def main() -> None:
    import tilehal
    import torch
    from deepep.engines.nvlink.context import compile_kernels
    from deepep.engines.nvlink.memory import HostMapped
    from deepep.engines.nvlink.normal import LayoutScratch, launch_layout
    from deepep.layout import compute_layout

    err = HostMapped(4)
    scratch = LayoutScratch()
    module = compile_kernels()
    print(f"{'tokens':>7} {'ranks':>5} {'experts':>7} {'ours us':>8} {'host us':>8} {'torch us':>9} {'speedup':>8}")
    for tokens, ranks, experts in ((4096, 2, 256), (4096, 8, 256), (16384, 8, 256), (65536, 8, 256)):
        idx = torch.rand(tokens, experts, device="cuda").topk(8, dim=1).indices
        in_rank = torch.empty(tokens, ranks, dtype=torch.bool, device="cuda")
        per_rank = torch.empty(ranks, dtype=torch.int32, device="cuda")
        per_expert = torch.empty(experts, dtype=torch.int32, device="cuda")

        def ours(idx=idx, in_rank=in_rank, per_rank=per_rank, per_expert=per_expert, ranks=ranks, tokens=tokens,
                 experts=experts):
            return launch_layout(module, err.device, scratch, ranks, tokens, experts // ranks, topk_idx=idx,
                                 in_rank=in_rank, per_expert_in=None, per_rank=per_rank, per_expert=per_expert)

        def peer(idx=idx, experts=experts, ranks=ranks):
            return compute_layout(idx, experts, ranks, ranks)

        a = tilehal.bench(ours, warmup=5, iters=50)
        b = tilehal.bench(peer, warmup=5, iters=50)
        print(f"{tokens:>7} {ranks:>5} {experts:>7} {a.median_us:>8.1f} {a.host_s * 1e6:>8.1f} {b.median_us:>9.1f} "
              f"{b.median_s / a.median_s:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
