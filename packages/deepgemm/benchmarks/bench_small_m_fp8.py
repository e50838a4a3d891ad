# requires: cuda
"""Small-M fp8 GEMMs (1x128 / 128x128 scales) vs torch._scaled_mm, same run, one H200.

Issue 19's target: fp8 M = 64 and 128 on the six DeepSeek (N, K) shapes >= 1.1x `torch._scaled_mm` with
per-row scales; DeepGEMM's test_fp8_fp4 also times M = 1 against `_scaled_mm` with per-tensor scales (its
cuBLASLt baseline, `deepgemm.cublaslt_gemm_nt`). Contenders per shape: deepgemm's default dispatch (fp8
split-K where `splitk.pick_splitk(..., "fp8")` takes it), deepgemm with DEEPGEMM_SPLITK=0 (the persistent
kernel alone), `_scaled_mm` per-row (scale_a [M, 1], scale_b [1, N]) and per-tensor. Timing: tilehal.bench
(CUDA events around a spin kernel: GPU time), L2 flushed before each call, median; ours and per-row also
as a CUDA-graph replay (tilehal.bench_graph, L2 flushed too). With --variants, forced split-K configs on
VARIANT_SHAPES (to check the heuristic's choice).

    python packages/deepgemm/benchmarks/bench_small_m_fp8.py [--variants [--mcast]] [--iters 30] [--m 1,64,128] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import platform
from pathlib import Path

import deepgemm
import tilehal
import torch
from deepgemm import cuda_gemm, reference, splitk

NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
SHAPES = [(m, n, k) for m in (1, 64, 128) for n, k in NK]
VARIANT_SHAPES = [(1, 2112, 7168), (1, 7168, 16384), (1, 7168, 2048), (64, 2112, 7168), (64, 7168, 2048),
                  (128, 2112, 7168), (128, 4096, 7168), (128, 7168, 16384), (128, 7168, 2048)]
ITERS = 30


def variants(m: int, n: int, k: int, mcast: bool = False) -> list[splitk.SplitKConfig]:
    """fp8 split-K configs around the heuristic's choice (every one fits a single wave); with `mcast` also each
    with A multicast in 2-CTA clusters (M >= 64)."""
    kb = -(-k // 128)
    out = []
    for bm in (64,) if m <= 64 else (64, 128):
        for bn in splitk.FP8_BLOCK_N_CANDIDATES:
            tiles = -(-m // bm) * -(-n // bn)
            for s in (2, 3, 4, 7, 8, 14):
                se = splitk.effective_splits(kb, min(s, kb))
                cfg = splitk.SplitKConfig(bm, bn, se, splitk.max_stages(bm, bn, True), 132, fp8=True)
                if tiles * se <= 132 and se >= 2 and cfg not in out:
                    out.append(cfg)
    if mcast and m >= 64:  # A multicast in 2-CTA clusters: every n-block re-reads the A panel
        out += [dataclasses.replace(c, multicast=2) for c in out]
    return out


def candidates(m: int, n: int, k: int) -> dict[str, splitk.SplitKConfig]:
    """What pick_splitk would choose for fp8 if it took every split the model prefers to the persistent plan
    (both FP8 gains 1.0), and that with A multicast allowed (MCAST_MIN_M = 64, MCAST_COST = 0.85): the plans a
    heuristic change would put in production, timed in the same run."""
    names = ("FP8_MIN_GAIN_SMALL_M", "FP8_MIN_GAIN", "MCAST_MIN_M", "MCAST_COST")
    saved = tuple(getattr(splitk, x) for x in names)
    out = {}
    try:
        for name, values in {"gain_1.0": (1.0, 1.0, None, 1.0), "mcast": (1.0, 1.0, 64, 0.85)}.items():
            for x, v in zip(names, values):
                setattr(splitk, x, v)
            splitk._pick.cache_clear()
            cfg = splitk.pick_splitk(m, n, k, 132, "fp8")
            if cfg is not None:
                out[name] = cfg
    finally:
        for x, v in zip(names, saved):
            setattr(splitk, x, v)
        splitk._pick.cache_clear()
    return out


def timed(fn, graph: bool = False) -> tuple[float, float | None]:
    t = tilehal.bench(fn, warmup=3, iters=ITERS, flush_l2=True).median_s
    tg = tilehal.bench_graph(fn, warmup=3, iters=ITERS, flush_l2=True).median_s if graph else None
    return t, tg


def inputs(m: int, n: int, k: int):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    # MN-major activation scales, as the fused cast writes them (else every call transposes them)
    return a8, sfa, deepgemm.get_mn_major_tma_aligned_tensor(sfa), b8, sfb


MCAST = False  # --mcast


def measure(m: int, n: int, k: int, with_variants: bool) -> dict:
    a8, sfa, sfa_t, b8, sfb = inputs(m, n, k)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    plan = splitk.pick_splitk(m, n, k, deepgemm.get_num_sms(), "fp8")
    ours, ours_g = timed(lambda: deepgemm.fp8_gemm_nt((a8, sfa_t), (b8, sfb), d), graph=True)
    calc = float(deepgemm.testing.calc_diff(d, reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)))
    os.environ["DEEPGEMM_SPLITK"] = "0"
    try:
        persistent, _ = timed(lambda: deepgemm.fp8_gemm_nt((a8, sfa_t), (b8, sfb), d))
    finally:
        del os.environ["DEEPGEMM_SPLITK"]
    one_a, one_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    one = torch.ones((), device="cuda")
    rowwise, rowwise_g = timed(lambda: torch._scaled_mm(a8, b8.T, scale_a=one_a, scale_b=one_b,
                                                        out_dtype=torch.bfloat16), graph=True)
    tensorwise, _ = timed(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    nbytes = m * k + n * k + 2 * m * n + 4 * (m + n // 128 + 1) * (k // 128 + 1)
    r = {"shape": [m, n, k], "plan": None if plan is None else [plan.block_m, plan.block_n, plan.splits, plan.stages],
         "ours_us": ours * 1e6, "ours_graph_us": ours_g * 1e6, "persistent_us": persistent * 1e6,
         "scaled_mm_rowwise_us": rowwise * 1e6, "scaled_mm_rowwise_graph_us": rowwise_g * 1e6,
         "scaled_mm_tensorwise_us": tensorwise * 1e6, "ours_gbps": nbytes / ours / 1e9,
         "ours_tflops": 2 * m * n * k / ours / 1e12, "ratio_vs_rowwise": rowwise / ours,
         "ratio_vs_rowwise_graph": rowwise_g / ours_g, "ratio_vs_tensorwise": tensorwise / ours,
         "persistent_ratio_vs_rowwise": rowwise / persistent, "calc_diff": calc}
    r["candidates"] = {}
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)
    for name, cfg in candidates(m, n, k).items():
        if plan is not None and cfg == plan:
            continue
        cuda_gemm.dense(a8, sfa_t, b8, sfb, d, None, config=cfg)
        diff = float(deepgemm.testing.calc_diff(d, ref))
        t, _ = timed(lambda cfg=cfg: cuda_gemm.dense(a8, sfa_t, b8, sfb, d, None, config=cfg))
        r["candidates"][name] = {"plan": [cfg.block_m, cfg.block_n, cfg.splits, cfg.stages, cfg.multicast],
                                 "us": t * 1e6, "calc_diff": diff}
    if with_variants:
        r["variants"] = {}
        for cfg in variants(m, n, k, MCAST):
            t, _ = timed(lambda cfg=cfg: cuda_gemm.dense(a8, sfa_t, b8, sfb, d, None, config=cfg))
            r["variants"][f"bm{cfg.block_m}_bn{cfg.block_n}_s{cfg.splits}{'_mc2' if cfg.multicast > 1 else ''}"] = t * 1e6
    print(f"{m:4d}x{n:6d}x{k:5d} plan={r['plan']} ours {r['ours_us']:6.1f} us (graph {r['ours_graph_us']:6.1f}, "
          f"{r['ours_gbps']:5.0f} GB/s) persistent {r['persistent_us']:6.1f}  scaled_mm row {r['scaled_mm_rowwise_us']:6.1f} "
          f"(graph {r['scaled_mm_rowwise_graph_us']:6.1f}) tensor {r['scaled_mm_tensorwise_us']:6.1f} -> "
          f"{r['ratio_vs_rowwise']:.2f}x row ({r['ratio_vs_rowwise_graph']:.2f}x graph), {r['ratio_vs_tensorwise']:.2f}x "
          f"tensor; persistent {r['persistent_ratio_vs_rowwise']:.2f}x; diff {calc:.1e}"
          + (f"\n    candidates: {r['candidates']}" if r["candidates"] else "")
          + (f"\n    variants: {r['variants']}" if "variants" in r else ""), flush=True)
    return r


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    global ITERS, MCAST
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--mcast", action="store_true", help="with --variants: also the multicast-A variants")
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--m", default="1,64,128", help="comma-separated M values")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ITERS, MCAST = args.iters, args.mcast
    ms = {int(x) for x in args.m.split(",")}
    rows = [measure(m, n, k, args.variants and (m, n, k) in VARIANT_SHAPES) for m, n, k in SHAPES if m in ms]
    summary = {}
    for m in sorted(ms):
        sel = [r for r in rows if r["shape"][0] == m]
        summary[f"m{m}"] = {"geomean_vs_rowwise": geo(r["ratio_vs_rowwise"] for r in sel),
                            "geomean_vs_rowwise_graph": geo(r["ratio_vs_rowwise_graph"] for r in sel),
                            "geomean_vs_tensorwise": geo(r["ratio_vs_tensorwise"] for r in sel),
                            "min_vs_rowwise": min(r["ratio_vs_rowwise"] for r in sel),
                            "persistent_geomean_vs_rowwise": geo(r["persistent_ratio_vs_rowwise"] for r in sel)}
        print(f"M = {m}: " + ", ".join(f"{key} {v:.3f}" for key, v in summary[f"m{m}"].items()), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
                "timing": f"tilehal.bench median of {ITERS}, L2 flushed; graph: tilehal.bench_graph, L2 flushed"}
        (args.out / "deepgemm_small_m_fp8_h200.json").write_text(
            json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
