# requires: multi_gpu
"""Dispatch/combine benchmark on the GPUs of one host: ours (NVLink kernels, NCCL transport) vs plain NCCL.

    source scripts/device_env.sh
    python3 packages/deepep/benchmarks/bench_dispatch.py --gpus 2 --record

DeepEP's default case: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, bf16 and fp8
(1x128 scales). Our timed calls include the layout (get_dispatch_layout) and every permutation;
the peer, a plain NCCL `all_to_all_single`, gets the already-permuted payload with precomputed
split sizes. Low-latency mode at 128 tokens per rank (fp8 dispatch, bf16 combine) against NCCL
all-to-all of the same tokens. Prints a table; writes deepep_dispatch_<N>xGPU.json and .png.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

HERE = os.path.abspath(__file__)


def bench_rank(rank: int, world: int, tokens: int, hidden: int, topk: int, experts: int, ll_tokens: int,
               iters: int) -> dict:
    """Runs on every rank (NCCL group, GPU = rank). Returns {case: {us, GBps, ...}}."""
    import tilehal
    import torch
    import torch.distributed as dist
    from deepep import Buffer, per_token_cast_to_fp8

    try:
        from tqdm import tqdm
    except ImportError:  # the GPU machine may lack it; the bar is only cosmetic
        def tqdm(it, **_):
            return it

    torch.manual_seed(1234 + rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    scores = torch.randn(tokens, experts, device=dev).abs() + 1
    topk_idx = scores.topk(topk, dim=1).indices
    topk_w = torch.rand(tokens, topk, device=dev)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    x_fp8 = per_token_cast_to_fp8(x)
    fp8_row = hidden + 4 * (hidden // 128)
    out: dict = {}

    def timed(name: str, fn, recv_bytes: int, remote_bytes: int | None = None) -> None:
        try:
            r = tilehal.bench(fn, warmup=5, iters=iters)
            out[name] = {"us": r.median_us, "p20_us": r.p20_s * 1e6, "p80_us": r.p80_s * 1e6,
                         "GBps": recv_bytes / r.median_s / 1e9}
            if remote_bytes is not None:
                out[name]["remote_GBps"] = remote_bytes / r.median_s / 1e9
        except Exception as e:  # one broken case must not hide the others
            out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        dist.barrier()

    buffers = {}
    for name in ("nvlink", "torch"):
        try:
            buffers[name] = Buffer(None, transport=name, timeout_s=15, num_max_tokens_per_rank=tokens,
                                   hidden=hidden)
        except Exception as e:
            out[f"{name}/setup"] = {"error": f"{type(e).__name__}: {e}"[:400]}

    # The same routing for every contender: rows sent, split sizes, received rows.
    ref = buffers.get("torch") or next(iter(buffers.values()))
    per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(topk_idx, experts)
    send_counts = per_rank.tolist()
    counts = torch.tensor(send_counts, device=dev)
    recv_counts_t = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts_t, counts)
    recv_counts = recv_counts_t.tolist()
    n_send, n_recv = sum(send_counts), sum(recv_counts)
    n_remote = n_recv - recv_counts[rank]
    out["rows"] = {"sent": n_send, "received": n_recv, "received_remote": n_remote}
    send_idx = in_rank.t().nonzero(as_tuple=True)[1]

    cases = []
    for tname, buf in buffers.items():
        for fmt in ("bf16", "fp8"):
            cases.append((tname, buf, fmt))
    for tname, buf, fmt in tqdm(cases, desc=f"rank {rank} normal", disable=rank != 0):
        xin = x if fmt == "bf16" else x_fp8
        row = hidden * 2 if fmt == "bf16" else fp8_row

        def dispatch(buf=buf, xin=xin):
            pr, _, pe, ir, _ = buf.get_dispatch_layout(topk_idx, experts)
            return buf.dispatch(xin, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                topk_idx=topk_idx, topk_weights=topk_w)

        timed(f"{tname}/dispatch/{fmt}", dispatch, n_recv * row, n_remote * row)
        try:  # the same routing again through a handle: no layout, no counts exchange on the host
            h0 = dispatch()[4]
            timed(f"{tname}/dispatch/{fmt}/handle", lambda buf=buf, xin=xin, h0=h0: buf.dispatch(xin, handle=h0),
                  n_recv * row, n_remote * row)
        except Exception as e:
            out[f"{tname}/dispatch/{fmt}/handle"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        if fmt == "bf16":
            timed(f"{tname}/layout", lambda buf=buf: buf.get_dispatch_layout(topk_idx, experts), 0)
            try:
                recv_x, _, _, _, handle, _ = dispatch()
                timed(f"{tname}/combine/bf16", lambda buf=buf, r=recv_x, h=handle: buf.combine(r, h),
                      n_send * hidden * 2, (n_send - send_counts[rank]) * hidden * 2)
            except Exception as e:
                out[f"{tname}/combine/bf16"] = {"error": f"{type(e).__name__}: {e}"[:400]}

    # How the NVLink kernels scale with the SMs they get (default: Buffer.num_sms).
    if "nvlink" in buffers:
        buf, default_sms = buffers["nvlink"], Buffer.num_sms
        for sms in (32, 96, 132):
            Buffer.set_num_sms(sms)

            def sweep_dispatch(buf=buf):
                pr, _, pe, ir, _ = buf.get_dispatch_layout(topk_idx, experts)
                return buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                    topk_idx=topk_idx, topk_weights=topk_w)

            timed(f"nvlink/dispatch/bf16/sms{sms}", sweep_dispatch, n_recv * hidden * 2, n_remote * hidden * 2)
            try:
                r, _, _, _, h, _ = sweep_dispatch()
                timed(f"nvlink/combine/bf16/sms{sms}", lambda r=r, h=h: buf.combine(r, h), n_send * hidden * 2,
                      (n_send - send_counts[rank]) * hidden * 2)
            except Exception as e:
                out[f"nvlink/combine/bf16/sms{sms}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        Buffer.set_num_sms(default_sms)

    # The peer: NCCL all-to-all of the already-permuted rows.
    for fmt, row in (("bf16", hidden * 2), ("fp8", fp8_row)):
        payload = x.index_select(0, send_idx).view(torch.uint8).view(n_send, -1)
        if fmt == "fp8":
            payload = torch.empty(n_send, row, dtype=torch.uint8, device=dev)
        recv = torch.empty(n_recv, row, dtype=torch.uint8, device=dev)
        rs, ss = [c * row for c in recv_counts], [c * row for c in send_counts]
        timed(f"nccl_a2a/dispatch/{fmt}", lambda p=payload, r=recv, rs=rs, ss=ss: dist.all_to_all_single(
            r.view(-1), p.reshape(-1), rs, ss), n_recv * row, n_remote * row)
        if fmt == "bf16":
            back = torch.empty(n_send, row, dtype=torch.uint8, device=dev)
            timed("nccl_a2a/combine/bf16", lambda b=back, r=recv, rs=rs, ss=ss: dist.all_to_all_single(
                b.view(-1), r.view(-1), ss, rs), n_send * row, (n_send - send_counts[rank]) * row)

    # Low latency: 128 tokens per rank.
    xl, il, wl = x[:ll_tokens].contiguous(), topk_idx[:ll_tokens].contiguous(), topk_w[:ll_tokens].contiguous()
    epr = experts // world
    pairs = int((il >= 0).sum())
    for tname, buf in buffers.items():
        try:
            recv, count, handle, _, _ = buf.low_latency_dispatch(xl, il, ll_tokens, experts, use_fp8=True)
            timed(f"{tname}/ll_dispatch/fp8", lambda buf=buf: buf.low_latency_dispatch(xl, il, ll_tokens, experts,
                                                                                       use_fp8=True),
                  pairs * fp8_row)
            y = torch.randn(epr, world * ll_tokens, hidden, device=dev).to(torch.bfloat16)
            buf.low_latency_dispatch(xl, il, ll_tokens, experts, use_fp8=True)
            _, _, handle, _, _ = buf.low_latency_dispatch(xl, il, ll_tokens, experts, use_fp8=True)
            timed(f"{tname}/ll_combine/bf16", lambda buf=buf, h=handle, y=y: buf.low_latency_combine(y, il, wl, h),
                  pairs * hidden * 2)
        except Exception as e:
            out[f"{tname}/ll"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    if "nvlink" in buffers:  # the fixed buffers make the NVLink low-latency calls graph-capturable
        buf = buffers["nvlink"]
        try:
            y = torch.randn(epr, world * ll_tokens, hidden, device=dev).to(torch.bfloat16)
            # Eager calls first: buffers grow (a collective allocation) outside the capture.
            buf.low_latency_dispatch(xl, il, ll_tokens, experts, use_fp8=False)
            _, _, handle, _, _ = buf.low_latency_dispatch(xl, il, ll_tokens, experts, use_fp8=True)
            buf.low_latency_combine(y, il, wl, handle)
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            gd, gc, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.stream(s):
                with torch.cuda.graph(gb, stream=s):  # without the fp8 cast, to see what the cast costs
                    buf._backend.low_latency_dispatch(xl, il, ll_tokens, experts, False, False, False)
                with torch.cuda.graph(gd, stream=s):
                    _, _, gh, _, _ = buf._backend.low_latency_dispatch(xl, il, ll_tokens, experts, True, False, False)
                with torch.cuda.graph(gc, stream=s):
                    buf._backend.low_latency_combine(y, il, wl, gh, False, False, None)
            torch.cuda.synchronize()
            dist.barrier()
            timed("nvlink/ll_dispatch/bf16/graph", gb.replay, pairs * hidden * 2)
            timed("nvlink/ll_dispatch/fp8/graph", gd.replay, pairs * fp8_row)
            timed("nvlink/ll_combine/bf16/graph", gc.replay, pairs * hidden * 2)
        except Exception as e:
            out["nvlink/ll/graph"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    for fmt, row in (("bf16", hidden * 2), ("fp8", fp8_row)):
        inp = torch.empty(world * ll_tokens, row, dtype=torch.uint8, device=dev)
        res = torch.empty_like(inp)
        timed(f"nccl_a2a/ll_tokens/{fmt}", lambda i=inp, r=res: dist.all_to_all_single(r, i),
              world * ll_tokens * row)
    out["device"] = torch.cuda.get_device_name(dev)
    for b in buffers.values():
        b.destroy()
    return out


def _table(results: list[dict]) -> list[dict]:
    names = sorted({k for r in results for k, v in r.items() if isinstance(v, dict) and ("us" in v or "error" in v)})
    rows = []
    for n in names:
        vals = [r.get(n, {}) for r in results]
        if any("error" in v for v in vals):
            rows.append({"case": n, "error": next(v["error"] for v in vals if "error" in v)})
            continue
        rows.append({"case": n, "us_per_rank": [round(v["us"], 1) for v in vals],
                     "us_max": round(max(v["us"] for v in vals), 1),
                     "GBps_per_rank": [round(v["GBps"], 1) for v in vals],
                     "remote_GBps_per_rank": [round(v["remote_GBps"], 1) for v in vals if "remote_GBps" in v]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ll-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--record", action="store_true", help="write the results into docs/benchmarks/ (default: print only)")
    ap.add_argument("--out", default=None, help="write the results into this folder instead")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(HERE).parents[1] / "src"))
    from deepep.testing import run_on_ranks

    results = run_on_ranks(args.gpus, HERE, "bench_rank", backend="nccl", timeout_s=540, pg_timeout_s=120,
                           tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                           ll_tokens=args.ll_tokens, iters=args.iters)
    rows = _table(results)
    ratios = {}
    for what in ("dispatch/bf16", "dispatch/fp8", "combine/bf16"):
        peer = next((r for r in rows if r["case"] == f"nccl_a2a/{what}" and "us_max" in r), None)
        for t in ("nvlink", "torch"):
            ours = next((r for r in rows if r["case"] == f"{t}/{what}" and "us_max" in r), None)
            if peer and ours:
                ratios[f"{t}/{what}"] = round(peer["us_max"] / ours["us_max"], 3)
    print(f"\n{'case':34s} {'us (max over ranks)':>20s} {'GB/s per rank (recv)':>26s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:34s} ERROR {r['error'][:90]}")
        else:
            print(f"{r['case']:34s} {r['us_max']:20.1f} {str(r['GBps_per_rank']):>26s}")
    print("speed-up vs plain NCCL all_to_all_single (same run):", ratios)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpus": args.gpus, "device": results[0].get("device"), "host": platform.node()},
        "config": {k: getattr(args, k) for k in ("tokens", "hidden", "topk", "experts", "ll_tokens", "iters")},
        "rows": results[0].get("rows"),
        "note": "ours includes get_dispatch_layout and all permutation; nccl_a2a moves pre-permuted rows. "
                "GB/s = received bytes (local + remote) / median time; remote_GBps counts NVLink bytes only.",
        "results": rows, "speedup_vs_nccl_a2a": ratios, "per_rank_raw": results,
    }
    if args.out is None and not args.record:
        print("not recorded (pass --record to write docs/benchmarks/)")
        return
    out_dir = Path(args.out) if args.out else Path(HERE).parents[3] / "docs" / "benchmarks"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"deepep_dispatch_{args.gpus}xGPU"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ok = [r for r in rows if "us_max" in r]
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(ok) + 1.5))
        colors = ["tab:green" if r["case"].startswith("nvlink") else "tab:blue" if r["case"].startswith("torch")
                  else "tab:gray" for r in ok]
        ax.barh([r["case"] for r in ok], [r["us_max"] for r in ok], color=colors)
        ax.set_xlabel("µs (median, slowest rank)")
        ax.set_xscale("log")
        ax.set_title(f"deepep on {args.gpus} x {report['machine']['device']}: green = NVLink kernels, "
                     "blue = NCCL transport, gray = plain NCCL all_to_all_single", fontsize=8)
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=120)
    except Exception as e:  # the JSON is the record; the plot is a convenience
        print("plot skipped:", e)
    print("wrote", stem.with_suffix(".json"))


if __name__ == "__main__":
    main()
