# requires: cuda
"""Low-latency kernels with 2 ranks emulated on ONE GPU (deepep.engines.nvlink.emulation), against the same
data movement in torch ops on that GPU, same run.

    source scripts/device_env.sh
    python3 packages/deepep/benchmarks/bench_ll_emulated.py

DeepEP's low-latency case: 128 tokens per rank, hidden 7168, top-8 of 256 experts, fp8 dispatch
and bf16 combine. Each emulated rank runs on its own stream with 60 SMs; the time is from the
first start event to the last rank's end (CUDA events, median of 50; a spin kernel ahead of
each stream hides the host's launch gaps, for both columns). "Remote" writes land in
the same GPU's memory, so this is the kernels' own cost without the NVLink transfer: a lower
bound for the two-GPU figure (add the link time of the bytes a rank sends, printed alongside).
The torch column does the local part of the same work (fp8 cast, fan-out to expert-major rows,
weighted sum back) with index ops, no communication.
"""

from __future__ import annotations

import statistics


def main() -> None:
    import torch
    from deepep.engines.nvlink.emulation import EmulatedRegions, emulated_context
    from deepep.engines.nvlink.low_latency import NvlinkLowLatency, region_sizes
    from deepep.fp8 import per_token_cast_to_fp8

    R, T, H, k, E, M = 2, 128, 7168, 8, 256, 128
    epr = E // R
    torch.manual_seed(0)
    regions = EmulatedRegions(R)
    ranks = [emulated_context(regions, r, sms=60) for r in range(R)]
    lls = [NvlinkLowLatency(o) for o in ranks]
    streams = [torch.cuda.Stream() for _ in range(R)]
    xs = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(R)]
    idx = [torch.rand(T, E, device="cuda").topk(k, dim=1).indices for _ in range(R)]
    ws = [torch.rand(T, k, device="cuda") for _ in range(R)]
    ys = [torch.randn(epr, R * M, H, device="cuda").to(torch.bfloat16) for _ in range(R)]
    torch.cuda.synchronize()
    handles = [None] * R

    def dispatch():
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                handles[r] = lls[r].dispatch(xs[r], idx[r], M, E, True, False)[2]

    hooks = [None] * R

    def dispatch_send():
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                hooks[r] = lls[r].dispatch(xs[r], idx[r], M, E, True, True)[4]

    def dispatch_receive():
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                hooks[r]()

    def combine():
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                lls[r].combine(ys[r], idx[r], ws[r], handles[r], False, None)

    def timed(fn, iters: int = 50, before=None) -> float:
        for _ in range(5):
            if before:
                before()
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(iters):
            if before:  # untimed: e.g. the send phase ahead of a timed receive phase
                before()
                torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(R)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(R)]
            for r in range(R):  # a spin ahead of each stream covers the host's launches of both ranks
                with torch.cuda.stream(streams[r]):
                    torch.cuda._sleep(int(300e-6 * 2e9))
                starts[r].record(streams[r])
            fn()
            for r in range(R):
                ends[r].record(streams[r])
            torch.cuda.synchronize()
            out.append(max(starts[0].elapsed_time(e) for e in ends) * 1e3)  # both on one GPU: comparable
        for o in ranks:
            o.check()
        return statistics.median(out)

    # The torch column: one rank's share of the same local work (cast, fan-out, weighted sum).
    flat = idx[0].reshape(-1)
    token = torch.arange(T, device="cuda").repeat_interleave(k)
    slot = torch.arange(T * k, device="cuda") % (R * M)
    recv = torch.empty(E, R * M, H, dtype=torch.uint8, device="cuda")
    y_all = torch.randn(E, R * M, H, device="cuda").to(torch.bfloat16)

    def torch_dispatch():
        x8, _ = per_token_cast_to_fp8(xs[0])
        recv[flat, slot] = x8.view(torch.uint8).index_select(0, token)

    def torch_combine():
        out = torch.zeros(T, H, device="cuda")
        out.index_add_(0, token, y_all[flat, slot].float() * ws[0].reshape(-1, 1))
        return out.to(torch.bfloat16)

    def torch_timed(fn, iters: int = 50) -> float:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(300e-6 * 2e9))
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) * 1e3)
        return statistics.median(out)

    owner = (idx[0] // epr)
    remote_tokens = int((owner != 0).any(dim=1).sum())
    d_row = region_sizes(R, M, H, E, k, True)["ll_dispatch"][2]
    bytes_d, bytes_c = remote_tokens * d_row, remote_tokens * 2 * H
    send_us = timed(dispatch_send, before=lambda: hooks[0] and dispatch_receive())
    dispatch_receive()  # the last timed send's receive: every send is followed by its receive
    receive_us = timed(dispatch_receive, before=dispatch_send)
    print(f"dispatch phases (return_recv_hook): send {send_us:.1f} us, receive {receive_us:.1f} us")
    rows = [("dispatch fp8", timed(dispatch), torch_timed(torch_dispatch), bytes_d),
            ("combine bf16", timed(combine), torch_timed(torch_combine), bytes_c)]
    print(f"{'case':<14} {'ours (2 emulated ranks) us':>27} {'torch local ops us':>19} {'bytes to the peer':>18}")
    for name, ours, peer, nbytes in rows:
        print(f"{name:<14} {ours:>27.1f} {peer:>19.1f} {nbytes / 1e6:>15.2f} MB")


if __name__ == "__main__":
    main()
