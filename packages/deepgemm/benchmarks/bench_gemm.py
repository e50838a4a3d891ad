# requires: cuda
"""deepgemm vs cuBLAS on one H200, same shapes, same run.

Peers: torch.matmul (bf16), torch._scaled_mm with per-row scales (fp8), and torch._scaled_mm with
the same blockwise recipe as ours (1x128 activation / 128x128 weight scales; cuBLAS accepts it only
for some shapes: the refusal is recorded). Timing: tilehal.bench (CUDA events, warm-up, median),
L2 flushed between calls. With --record, writes docs/benchmarks/deepgemm_h200.json and .png.

    python packages/deepgemm/benchmarks/bench_gemm.py [--quick] [--record | --out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import platform
from pathlib import Path

import deepgemm
import tilehal
import torch
from deepgemm import cuda_gemm, heuristics
from tilehal.progress import progress

DENSE_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
GROUPED_NK = [(4096, 7168), (7168, 2048)]
ROOT = Path(__file__).resolve().parents[3]


GRAPH = False  # --graph: also time a CUDA-graph replay of every contender (L2 flushed too)


class Timed(float):
    """A median time (s) that may carry the CUDA-graph replay's median as `.graph`."""

    graph: float | None = None


def timed(fn) -> float:
    t = Timed(tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s)
    if GRAPH:
        t.graph = tilehal.bench_graph(fn, warmup=3, iters=30, flush_l2=True).median_s
    return t


def fp8_inputs(m, n, k, groups=None):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, k) if groups is None else (groups, n, k), device="cuda", dtype=torch.bfloat16)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    return a, b, a8, deepgemm.get_mn_major_tma_aligned_tensor(sfa), b8, sfb


def row(kind, shape, flops, nbytes, ours_s, peers: dict) -> dict:
    r = {"kind": kind, "shape": shape, "ours_us": ours_s * 1e6, "ours_tflops": flops / ours_s / 1e12,
         "ours_gbps": nbytes / ours_s / 1e9}
    og = getattr(ours_s, "graph", None)
    if og:
        r["ours_graph_us"], r["ours_graph_tflops"] = og * 1e6, flops / og / 1e12
    for name, t in peers.items():
        if isinstance(t, str):
            r[f"{name}_error"] = t
            continue
        r[f"{name}_us"] = t * 1e6
        r[f"{name}_tflops"] = flops / t / 1e12
        r[f"ratio_vs_{name}"] = t / ours_s  # > 1: ours is faster
        tg = getattr(t, "graph", None)
        if og and tg:
            r[f"{name}_graph_us"] = tg * 1e6
            r[f"ratio_vs_{name}_graph"] = tg / og
    return r


def try_time(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return timed(fn)
    except Exception as e:  # the peer refused this shape/layout: record why
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def bench_dense_fp8(m, n, k):
    _, _, a8, sfa, b8, sfb = fp8_inputs(m, n, k)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ours = timed(lambda: deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d))
    one_a = torch.ones(m, 1, device="cuda")
    one_b = torch.ones(1, n, device="cuda")
    peers = {
        "scaled_mm_rowwise": try_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=one_a, scale_b=one_b,
                                                               out_dtype=torch.bfloat16)),
        "scaled_mm_blockwise": try_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=sfa, scale_b=sfb.T,
                                                                 out_dtype=torch.bfloat16)),
    }
    flops = 2 * m * n * k
    nbytes = m * k + n * k + 2 * m * n
    r = row("fp8_dense", [m, n, k], flops, nbytes, ours, peers)
    picked = heuristics.pick_config("fp8", m, n, k, tma_store=True)
    if m >= 1024 and picked.overlap_promotion:
        # A/B of the overlapped promotion: the same tile on the serial path (wait_group 0 per K block).
        serial = dataclasses.replace(picked, allow_overlap=False)
        t = timed(lambda: cuda_gemm.dense(a8, sfa, b8, sfb, d, None, config=serial))
        r["ours_serial_promotion_us"] = t * 1e6
        r["ours_serial_promotion_tflops"] = flops / t / 1e12
    return r


def variant_configs(kind, m, n, k):
    """The heuristic's pick plus neighbours it did not pick: other tile widths, multicast on/off."""
    from deepgemm.heuristics import block_n_candidates, pick_config

    picked = pick_config(kind, m, n, k, tma_store=True)
    widths = sorted({picked.block_n, *((128, 144, 160, 192) if kind == "fp8" else (192, 224, 256))})
    out = []
    for bn in widths:
        if bn not in block_n_candidates(kind):
            continue
        for mc in (1, 2):
            multicast, on_a = heuristics.pick_multicast("normal", m, n, picked.block_m, bn, picked.num_sms, mc)
            tiles = deepgemm.ceil_div(m, picked.block_m) * deepgemm.ceil_div(n, bn)
            w, util = heuristics.waves(tiles, picked.num_sms)
            cfg = dataclasses.replace(picked, block_n=bn, multicast=multicast, multicast_on_a=on_a, num_waves=w,
                                      last_wave_util=util,
                                      stages=heuristics.max_stages(kind, picked.block_m, bn, picked.block_m * bn * 2))
            if cfg not in out:
                out.append(cfg)
    return picked, out


def bench_variants(kind, m, n, k):
    """Time every variant config of one dense shape (ours only), to check the heuristic's choice."""
    if kind == "fp8":
        _, _, a8, sfa, b8, sfb = fp8_inputs(m, n, k)
    else:
        a8 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b8 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        sfa = sfb = None
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    picked, cfgs = variant_configs(kind, m, n, k)
    rows = []
    for cfg in cfgs:
        t = timed(lambda cfg=cfg: cuda_gemm.dense(a8, sfa, b8, sfb, d, None, config=cfg))
        rows.append({"kind": kind, "shape": [m, n, k], "block_n": cfg.block_n, "multicast": cfg.multicast,
                     "multicast_on_a": cfg.multicast_on_a, "stages": cfg.stages, "waves": cfg.num_waves,
                     "picked": cfg == picked, "us": t * 1e6, "tflops": 2 * m * n * k / t / 1e12})
    return rows


def bench_dense_bf16(m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ours = timed(lambda: deepgemm.bf16_gemm_nt(a, b, d))
    peers = {"cublas_bf16": try_time(lambda: torch.matmul(a, b.T))}
    return row("bf16_dense", [m, n, k], 2 * m * n * k, 2 * (m * k + n * k + m * n), ours, peers)


def bench_contiguous(groups, rows, n, k):
    m = groups * rows
    _, _, a8, sfa, b8, sfb = fp8_inputs(m, n, k, groups=groups)
    m_indices = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ours = timed(lambda: deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, m_indices))
    # Peer: the same work as one per-row _scaled_mm per expert (what a framework without a grouped kernel runs).
    one_b = torch.ones(1, n, device="cuda")
    one_a = torch.ones(rows, 1, device="cuda")

    def loop():
        for g in range(groups):
            torch._scaled_mm(a8[g * rows:(g + 1) * rows], b8[g].T, scale_a=one_a, scale_b=one_b,
                             out_dtype=torch.bfloat16)

    peers = {"scaled_mm_rowwise_loop": try_time(loop)}
    return row("fp8_grouped_contiguous", [groups, rows, n, k], 2 * m * n * k,
               m * k + groups * n * k + 2 * m * n, ours, peers)


def bench_masked(groups, m_max, n, k):
    _, _, a8, sfa, b8, sfb = fp8_inputs(groups * m_max, n, k, groups=groups)
    a8 = a8.view(groups, m_max, k)
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa.view(groups, m_max, -1))
    masked_m = torch.full((groups,), m_max, device="cuda", dtype=torch.int32)
    d = torch.empty(groups, m_max, n, device="cuda", dtype=torch.bfloat16)
    ours = timed(lambda: deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked_m, m_max))
    one_b = torch.ones(1, n, device="cuda")
    one_a = torch.ones(m_max, 1, device="cuda")

    def loop():
        for g in range(groups):
            torch._scaled_mm(a8[g], b8[g].T, scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16)

    peers = {"scaled_mm_rowwise_loop": try_time(loop)}
    m = groups * m_max
    return row("fp8_grouped_masked", [groups, m_max, n, k], 2 * m * n * k,
               m * k + groups * n * k + 2 * m * n, ours, peers)


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M = 4096 dense shapes only")
    ap.add_argument("--record", action="store_true", help="write the results into docs/benchmarks/ (default: print only)")
    ap.add_argument("--out", default=None, help="write the results into this folder instead")
    ap.add_argument("--variants", action="store_true",
                    help="also time the tile widths / multicast settings the heuristic did not pick (M = 4096)")
    ap.add_argument("--only", default=None, help="only the jobs whose benchmark name contains one of these (comma-separated, e.g. masked,contiguous)")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays (every contender)")
    args = ap.parse_args()
    global GRAPH
    GRAPH = args.graph
    jobs = []
    for m in ((4096,) if args.quick else (64, 128, 4096)):
        for n, k in DENSE_NK:
            jobs.append((bench_dense_fp8, (m, n, k)))
    for m in ((4096,) if args.quick else (128, 4096)):
        for n, k in DENSE_NK:
            jobs.append((bench_dense_bf16, (m, n, k)))
    if not args.quick:
        for n, k in GROUPED_NK:
            for g, rows in ((4, 8192), (8, 4096)):
                jobs.append((bench_contiguous, (g, rows, n, k)))
            for g, rows in ((1, 1024), (2, 512), (4, 256)):
                jobs.append((bench_masked, (g, rows, n, k)))
    if args.only:
        jobs = [j for j in jobs if any(x in j[0].__name__ for x in args.only.split(","))]
    results = []
    for fn, shape in progress(jobs, desc="bench"):
        results.append(fn(*shape))
        torch.cuda.empty_cache()

    hdr = f"{'kind':24s} {'shape':>24s} {'ours us':>9s} {'TFLOPS':>8s} {'GB/s':>7s}  peers (TFLOPS, ours/peer speed ratio)"
    print(hdr)
    for r in results:
        peers = []
        for key in r:
            if key.endswith("_tflops") and not key.startswith("ours"):
                name = key[:-7]
                peers.append(f"{name} {r[key]:.0f} x{r['ratio_vs_' + name]:.2f}")
            elif key.endswith("_error"):
                peers.append(f"{key[:-6]} n/a")
        print(f"{r['kind']:24s} {str(r['shape']):>24s} {r['ours_us']:9.1f} {r['ours_tflops']:8.0f} "
              f"{r['ours_gbps']:7.0f}  " + "; ".join(peers))

    def sel(kind, m=None):
        return [r for r in results if r["kind"] == kind and (m is None or r["shape"][0] == m)]

    summary = {
        "fp8_m4096_geomean_vs_scaled_mm_rowwise": geomean([r.get("ratio_vs_scaled_mm_rowwise") for r in sel("fp8_dense", 4096)]),
        "fp8_m4096_best_tflops": max((r["ours_tflops"] for r in sel("fp8_dense", 4096)), default=None),
        "bf16_m4096_geomean_vs_cublas": geomean([r.get("ratio_vs_cublas_bf16") for r in sel("bf16_dense", 4096)]),
        "fp8_small_m_geomean_vs_scaled_mm_rowwise": geomean(
            [r.get("ratio_vs_scaled_mm_rowwise") for r in sel("fp8_dense", 64) + sel("fp8_dense", 128)]),
        "contiguous_best_tflops": max((r["ours_tflops"] for r in sel("fp8_grouped_contiguous")), default=None),
        "masked_1x1024_tflops": [r["ours_tflops"] for r in sel("fp8_grouped_masked") if r["shape"][:2] == [1, 1024]],
        # > 1: the overlapped promotion is faster than the same tile with the serial one
        "fp8_overlap_speedup_geomean": geomean(
            [r["ours_serial_promotion_us"] / r["ours_us"] for r in sel("fp8_dense") if "ours_serial_promotion_us" in r]),
        # the target rows, from the CUDA-graph replays (--graph)
        "graph_fp8_m4096_geomean_vs_scaled_mm_rowwise": geomean(
            [r.get("ratio_vs_scaled_mm_rowwise_graph") for r in sel("fp8_dense", 4096)]),
        "graph_fp8_m4096_geomean_vs_scaled_mm_blockwise": geomean(
            [r.get("ratio_vs_scaled_mm_blockwise_graph") for r in sel("fp8_dense", 4096)]),
        "fp8_m4096_geomean_vs_scaled_mm_blockwise": geomean(
            [r.get("ratio_vs_scaled_mm_blockwise") for r in sel("fp8_dense", 4096)]),
        "graph_bf16_m4096_geomean_vs_cublas": geomean([r.get("ratio_vs_cublas_bf16_graph") for r in sel("bf16_dense", 4096)]),
        "masked_tflops": {str(r["shape"]): round(r["ours_tflops"]) for r in sel("fp8_grouped_masked")},
        "contiguous_tflops": {str(r["shape"]): round(r["ours_tflops"]) for r in sel("fp8_grouped_contiguous")},
    }
    for r in results:
        if "ours_serial_promotion_us" in r:
            print(f"fp8 {str(r['shape']):>20s} overlapped promotion {r['ours_tflops']:6.0f} TFLOPS, "
                  f"serial {r['ours_serial_promotion_tflops']:6.0f} TFLOPS")
    variants = []
    if args.variants:
        for kind in ("fp8", "bf16"):
            for n, k in progress(DENSE_NK, desc=f"variants {kind}"):
                variants += bench_variants(kind, 4096, n, k)
                torch.cuda.empty_cache()
        print(f"{'kind':5s} {'shape':>20s} {'BN':>4s} {'mc':>3s} {'st':>3s} {'waves':>5s} {'us':>8s} {'TFLOPS':>7s}")
        for v in variants:
            mc = f"{v['multicast']}{'A' if v['multicast_on_a'] else 'B'}" if v["multicast"] > 1 else "1"
            print(f"{v['kind']:5s} {str(v['shape']):>20s} {v['block_n']:4d} {mc:>3s} {v['stages']:3d} {v['waves']:5d} "
                  f"{v['us']:8.1f} {v['tflops']:7.0f}{'  <- picked' if v['picked'] else ''}")
    print(json.dumps(summary, indent=1))
    if args.out is None and not args.record:
        print("not recorded (pass --record to write docs/benchmarks/deepgemm_h200.json)")
        return
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
            "num_sms": deepgemm.get_num_sms(), "timer": "tilehal.bench, CUDA events, L2 flushed, median of 30"}
    (out / "deepgemm_h200.json").write_text(json.dumps({"meta": meta, "summary": summary, "results": results,
                                                       "variants": variants}, indent=1))
    try:
        plot(results, out / "deepgemm_h200.png")
    except ImportError:
        print("matplotlib missing: no plot")


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 5))
    labels = [f"{r['kind'].replace('fp8_', '').replace('grouped_', 'g_')}\n{'x'.join(map(str, r['shape']))}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["ours_tflops"] for r in results], width=0.4, label="deepgemm")
    peer = [max([r[k] for k in r if k.endswith("_tflops") and not k.startswith("ours")], default=0) for r in results]
    ax.bar([i + 0.2 for i in x], peer, width=0.4, label="best cuBLAS peer")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"deepgemm vs cuBLAS, {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
