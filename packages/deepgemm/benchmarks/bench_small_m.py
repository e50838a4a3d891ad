# requires: cuda
"""Small-M bf16 GEMMs (DeepGEMM test_bf16's M = 1 and M = 128 rows) vs cuBLAS, same run, one H200.

For each shape: deepgemm's default dispatch (split-K where `splitk.pick_splitk` takes it), deepgemm
with DEEPGEMM_SPLITK=0 (the persistent kernel alone), and cuBLAS as one GEMM kernel (`torch.mm` into the
preallocated output; DeepGEMM's test times only the GEMM kernel of `cublaslt_gemm_nt`: until 2026-12-02 this
script timed deepgemm.cublaslt_gemm_nt, matmul + a copy, which flattered us by the copy). --small-acc adds
bf16 C = D rows (ours vs cuBLAS addmm_). With --variants, forced split-K configs on a few
shapes (to check the heuristic's choice). Timing: tilehal.bench (CUDA events around a spin kernel, so
host gaps are hidden for every contender), L2 flushed before each call, median of 30.

    python packages/deepgemm/benchmarks/bench_small_m.py [--variants] [--out DIR]
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
from deepgemm import cuda_gemm, splitk

NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048),
      (256, 7168), (129280, 7168)]
FP32_OUT = {(256, 7168), (129280, 7168)}
SHAPES = [(m, n, k) for m in (1, 128) for n, k in NK]
VARIANT_SHAPES = [(1, 2112, 7168), (128, 2112, 7168), (1, 4096, 7168), (128, 4096, 7168), (128, 576, 7168),
                  (128, 7168, 16384)]
# bf16 accumulation (c = d, bf16) at M = 4096: the persistent kernel (C widened to fp32, direct epilogue)
# vs the tile kernel (splits = 1, reads bf16 C) vs cuBLAS.
ACC_SHAPES = [(4096, 2112, 7168), (4096, 7168, 2048), (4096, 32768, 512)]


def variants(m: int, n: int, k: int) -> list[splitk.SplitKConfig]:
    """A few split-K configs around the heuristic's choice (every one fits a single wave), and for M > 64 the
    same with A multicast in 2-CTA clusters (the planned config's too)."""
    kb = -(-k // 64)
    out = []
    for bm in (64,) if m <= 64 else (64, 128):
        for bn in (64, 128, 256):
            tiles = -(-m // bm) * -(-n // bn)
            for s in (2, 4, 8, 16):
                se = splitk.effective_splits(kb, s)
                if tiles * se <= 132:
                    out.append(splitk.SplitKConfig(bm, bn, se, splitk.max_stages(bm, bn), 132))
    if m > 64:
        out += [dataclasses.replace(c, multicast=2) for c in out if c.block_n < 256]
    return out


def cublas_fn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, acc: bool = False):
    """cuBLAS as one kernel, as DeepGEMM's test times it (bench_kineto counts only the GEMM kernel): torch.mm
    into the preallocated bf16 d (acc: d.addmm_, beta = 1, C = d); fp32 d from bf16 inputs through mm's
    out_dtype where torch has it, else matmul + copy (two kernels, noted in the row)."""
    if acc:
        return lambda: d.addmm_(a, b.T)
    if d.dtype == torch.bfloat16:
        return lambda: torch.mm(a, b.T, out=d)
    try:
        torch.mm(a[:1], b[:8].T, out_dtype=torch.float32)
        return lambda: torch.mm(a, b.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return lambda: deepgemm.cublaslt_gemm_nt(a, b, d)


def mcast_candidate(m: int, n: int, k: int) -> splitk.SplitKConfig | None:
    """What pick_splitk would choose with A multicast allowed (MCAST_MIN_M = 64, MCAST_COST = 0.85)."""
    saved = splitk.MCAST_MIN_M, splitk.MCAST_COST
    try:
        splitk.MCAST_MIN_M, splitk.MCAST_COST = 64, 0.85
        splitk._pick.cache_clear()
        return splitk.pick_splitk(m, n, k, 132)
    finally:
        splitk.MCAST_MIN_M, splitk.MCAST_COST = saved
        splitk._pick.cache_clear()


def timed(fn) -> float:
    return tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s


def measure(m: int, n: int, k: int, with_variants: bool) -> dict:
    out_dtype = torch.float32 if (n, k) in FP32_OUT else torch.bfloat16
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(m, n, device="cuda", dtype=out_dtype)
    flops, nbytes = 2 * m * n * k, (m * k + n * k) * 2 + m * n * d.element_size()
    plan = splitk.pick_splitk(m, n, k, deepgemm.get_num_sms())
    ours = timed(lambda: deepgemm.bf16_gemm_nt(a, b, d))
    os.environ["DEEPGEMM_SPLITK"] = "0"
    persistent = timed(lambda: deepgemm.bf16_gemm_nt(a, b, d))
    del os.environ["DEEPGEMM_SPLITK"]
    cublas = timed(cublas_fn(a, b, d))
    ref = a.float() @ b.float().T
    deepgemm.bf16_gemm_nt(a, b, d)
    r = {"shape": [m, n, k], "out": str(out_dtype).replace("torch.", ""),
         "plan": None if plan is None else [plan.block_m, plan.block_n, plan.splits, plan.stages],
         "ours_us": ours * 1e6, "persistent_us": persistent * 1e6, "cublas_us": cublas * 1e6,
         "ours_gbps": nbytes / ours / 1e9, "ours_tflops": flops / ours / 1e12,
         "ratio_vs_cublas": cublas / ours, "persistent_ratio_vs_cublas": cublas / persistent,
         "calc_diff": float(deepgemm.testing.calc_diff(d, ref))}
    cand = mcast_candidate(m, n, k)
    if cand is not None and cand != plan:
        cuda_gemm.dense(a, None, b, None, d, None, config=cand)
        cand_diff = float(deepgemm.testing.calc_diff(d, ref))
        t = timed(lambda: cuda_gemm.dense(a, None, b, None, d, None, config=cand))
        r["mcast_candidate"] = {"plan": [cand.block_m, cand.block_n, cand.splits, cand.stages, cand.multicast],
                                "us": t * 1e6, "calc_diff": cand_diff}
    if with_variants:
        r["variants"] = {}
        for cfg in variants(m, n, k):
            t = timed(lambda cfg=cfg: cuda_gemm.dense(a, None, b, None, d, None, config=cfg))
            r["variants"][f"bm{cfg.block_m}_bn{cfg.block_n}_s{cfg.splits}{'_mc2' if cfg.multicast > 1 else ''}"] = t * 1e6
    print(f"{m:4d}x{n:6d}x{k:5d} plan={r['plan']} ours {r['ours_us']:7.1f} us ({r['ours_gbps']:5.0f} GB/s)  "
          f"persistent {r['persistent_us']:7.1f}  cuBLAS {r['cublas_us']:7.1f}  -> {r['ratio_vs_cublas']:.2f}x "
          f"(persistent {r['persistent_ratio_vs_cublas']:.2f}x) diff {r['calc_diff']:.1e}"
          + (f"\n    mcast candidate: {r['mcast_candidate']}" if "mcast_candidate" in r else "")
          + (f"\n    variants: {r['variants']}" if "variants" in r else ""), flush=True)
    return r


def measure_small_acc(m: int, n: int, k: int) -> dict:
    """bf16 accumulation into a bf16 D at small M (DeepGEMM's acc=1 rows): ours (C = D, read in place) vs
    cuBLAS d.addmm_ (one GEMM kernel with beta = 1)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    d0 = d.clone()
    deepgemm.bf16_gemm_nt(a, b, d, c=d)
    diff = float(deepgemm.testing.calc_diff(d, a.float() @ b.float().T + d0.float()))
    ours = timed(lambda: deepgemm.bf16_gemm_nt(a, b, d, c=d))
    e = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
    ours_no_c = timed(lambda: deepgemm.bf16_gemm_nt(a, b, e))
    cublas = timed(cublas_fn(a, b, d, acc=True))
    r = {"shape": [m, n, k], "ours_us": ours * 1e6, "ours_without_c_us": ours_no_c * 1e6, "cublas_addmm_us": cublas * 1e6,
         "ratio_vs_cublas": cublas / ours, "calc_diff": diff}
    print(f"acc {m}x{n}x{k}: ours {r['ours_us']:.1f} us (without C {r['ours_without_c_us']:.1f}), cuBLAS addmm "
          f"{r['cublas_addmm_us']:.1f} -> {r['ratio_vs_cublas']:.2f}x, diff {diff:.1e}", flush=True)
    return r


def measure_acc(m: int, n: int, k: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float().T + d.float()
    persistent = timed(lambda: deepgemm.bf16_gemm_nt(a, b, d, c=d))
    tile = splitk.pick_tiles(m, n, k, deepgemm.get_num_sms())
    tile_t = timed(lambda: cuda_gemm.dense(a, None, b, None, d, d, config=tile))
    cublas = timed(lambda: deepgemm.cublaslt_gemm_nt(a, b, d, c=d))
    e = d.clone()
    cuda_gemm.dense(a, None, b, None, e, e, config=tile)  # e = e + a @ b^T from the same start
    r = {"shape": [m, n, k], "persistent_us": persistent * 1e6, "tile_kernel_us": tile_t * 1e6,
         "tile": [tile.block_m, tile.block_n, tile.splits], "cublas_us": cublas * 1e6,
         "tile_calc_diff": float(deepgemm.testing.calc_diff(e, a.float() @ b.float().T + d.float())),
         "ref_finite": bool(torch.isfinite(ref).all())}
    print(f"acc {m}x{n}x{k}: persistent {r['persistent_us']:.1f} us, tile kernel {r['tile_kernel_us']:.1f} us, "
          f"cuBLAS {r['cublas_us']:.1f} us, tile diff {r['tile_calc_diff']:.1e}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--acc", action="store_true", help="also the M = 4096 bf16-accumulation rows")
    ap.add_argument("--small-acc", action="store_true", help="also bf16 C = D rows at the small-M shapes (bf16 out)")
    ap.add_argument("--m", default="1,128", help="comma-separated M values of the small-M rows")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ms = {int(x) for x in args.m.split(",")}
    shapes = [s for s in SHAPES if s[0] in ms]
    rows = [measure(m, n, k, args.variants and (m, n, k) in VARIANT_SHAPES) for m, n, k in shapes]
    acc_rows = [measure_acc(m, n, k) for m, n, k in ACC_SHAPES] if args.acc else []
    small_acc_rows = ([measure_small_acc(m, n, k) for m, n, k in shapes if (n, k) not in FP32_OUT]
                      if args.small_acc else [])
    geo = math.exp(sum(math.log(r["ratio_vs_cublas"]) for r in rows) / len(rows))
    geo_p = math.exp(sum(math.log(r["persistent_ratio_vs_cublas"]) for r in rows) / len(rows))
    print(f"geo-mean vs cuBLAS: ours {geo:.3f}x, persistent only {geo_p:.3f}x")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
                "timing": "tilehal.bench median of 30, L2 flushed", "geomean_vs_cublas": geo,
                "geomean_persistent_vs_cublas": geo_p}
        meta["cublas"] = "one GEMM kernel (torch.mm out= / out_dtype; addmm_ for C = D), as DeepGEMM's test times it"
        (args.out / "deepgemm_small_m_h200.json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "acc_rows": acc_rows, "small_acc_rows": small_acc_rows}, indent=1))


if __name__ == "__main__":
    main()
