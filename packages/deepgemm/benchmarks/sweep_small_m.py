# requires: cuda
"""bf16 small-M sweep (issue 18's M = 1 and M = 128 rows) vs cuBLAS, same run, one H200: for each shape
cuBLAS (one GEMM kernel: torch.mm into the preallocated D, addmm_ for C = D), deepgemm's default dispatch,
and forced plans: at M = 1 the GEMV kernel and the split-K plan; at M = 128 the split-K plan with the
last-CTA reduction, with every split reducing a slice (par_reduce) and through the cluster's shared memory
(cluster_reduce), and such tiles of 128 rows x 64 / 128 / 256 columns with as many splits as fit one wave. Timing: tilehal.bench (L2 flushed, median) and,
with --graph, a CUDA-graph replay (L2 flushed). Every kernel is compiled first, in parallel (--jobs), from one pass with launches recorded.
--ab: only the default dispatch and the opt-in paths of session 27 (the C_TMA epilogue and split-K C_EARLY with C;
the persistent kernel with A multicast over 2-CTA clusters, whose plain remote release was never timed at M = 128).

    python packages/deepgemm/benchmarks/sweep_small_m.py [--graph] [--jobs 16] [--m 1,128] [--ab] [--out DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import time
from pathlib import Path

import deepgemm
import tilehal
import torch
from deepgemm import cuda_gemm, gemv, heuristics, reference, splitk
from deepgemm.heuristics import pick_config

NK = [(2112, 7168), (576, 7168), (4096, 7168), (256, 7168), (7168, 2048), (24576, 1536), (32768, 512),
      (7168, 16384)]
FP32_OUT = {(256, 7168)}
SMS = 132
GRAPH = False
DEFAULT_ONLY = False  # --default-only: cuBLAS / _scaled_mm and deepgemm's own dispatch, no forced plans
CLUSTER = "all"  # --cluster: "no" leaves the cluster_reduce plans out, "only" times only them (and cuBLAS)
AB = False  # --ab: the default and the opt-in A/B plans only (ab_plans)
# beside --persistent-tiles: (block_n, stages) of the tile kernel; 128 x 128 with 3 stages leaves two CTAs per SM
TILE_KERNEL_PLANS = [(256, splitk.max_stages(128, 256)), (128, splitk.max_stages(128, 128)), (128, 3)]
ONLY_PLANS: set[str] = set()  # --plans: time only these named plans beside the default
PERSISTENT_TILES: list[tuple[int, int]] = []  # --persistent-tiles: (block_m, block_n) of the persistent kernel to time


def timed(fn) -> dict:
    r = {"us": tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s * 1e6}
    if GRAPH:
        r["graph_us"] = tilehal.bench_graph(fn, warmup=3, iters=30, flush_l2=True).median_s * 1e6
    return r


def mcast_variant(kind: str, m: int, n: int, k: int, acc: bool = False, out_dtype=torch.bfloat16):
    """The persistent kernel's plan with A multicast over 2-CTA clusters (neighbouring n-blocks share the A tile:
    at M = 128 every n-block CTA re-reads the A panel), or None where the default is not persistent / not pairable."""
    if splitk.pick_splitk(m, n, k, SMS, kind) is not None:
        return None
    ep = cuda_gemm.epilogue(torch.empty(m, n, dtype=out_dtype), n, acc, "normal")
    base = pick_config(kind, m, n, k, num_sms=SMS, **ep)
    if -(-n // base.block_n) % 2 or base.block_m % 16:
        return None
    return dataclasses.replace(base, multicast=2, multicast_on_a=True)


def ab_plans(m: int, n: int, k: int, acc: bool, out_dtype=torch.bfloat16) -> dict[str, object]:
    """The opt-in plans next session's A/B decides on (bf16): with C = D, the C_TMA epilogue (the persistent
    heuristic's tile for it, as DEEPGEMM_C_EPILOGUE=tma picks it) and, where the default is split-K, the same plan
    with C_EARLY (DEEPGEMM_SPLITK_C=early) and with A multicast (C_EARLY too with C). (The bf16 persistent rows without
    C are >= 0.9x already: their A multicast is left to `plans_for`'s full sweep.)"""
    out: dict[str, object] = {}
    bf16_c = acc and out_dtype == torch.bfloat16 and n % 8 == 0
    if bf16_c:
        out["c_tma"] = pick_config("bf16", m, n, k, num_sms=SMS, tma_store=True, c_tma=True)
    sk = splitk.pick_splitk(m, n, k, SMS)
    if acc and sk is not None and sk.splits > 1:
        out["splitk_c_early"] = dataclasses.replace(sk, c_early=True)
    if sk is not None and m >= 64:  # the default split-K plan with A multicast (par_reduce where the clusters fit)
        mc = dataclasses.replace(sk, multicast=2, c_early=acc and sk.splits > 1)
        gx, gy, gz = mc.grid(m, n)
        if -(-n // sk.block_n) >= 2 and gx * gy * gz <= SMS:
            out["splitk_mcast" + ("_c_early" if mc.c_early else "")] = mc
    return out


def persistent_tiles(m: int, n: int, k: int, acc: bool, out_dtype=torch.bfloat16) -> dict[str, object]:
    """The persistent kernel's plan (with a bf16 C = D: the C_TMA epilogue, as the default dispatch picks it) with
    other tiles (--persistent-tiles): each (block_m, block_n) with the deepest ring that fits next to its epilogue.
    Issue 18's 128 x 32768 x 512 with C: the default 128 x 256 tiles are one wave (every CTA stores its D tile at
    the same time, after a main loop of 8 K blocks); narrower tiles give each CTA 2-4 tiles whose stores and C loads
    overlap the next tile's main loop."""
    if not PERSISTENT_TILES or splitk.pick_splitk(m, n, k, SMS, has_c=acc) is not None:
        return {}
    c_tma = acc and out_dtype == torch.bfloat16 and n % 8 == 0
    ep = {"tma_store": True, "c_tma": True} if c_tma else cuda_gemm.epilogue(torch.empty(0, n, dtype=out_dtype), n,
                                                                               acc, "normal")
    base = pick_config("bf16", m, n, k, num_sms=SMS, **ep)
    default = heuristics.tile_rule(base, m, n, k)  # the tile the dispatch takes (the model's, or a measured rule's)
    out: dict[str, object] = {}
    for bm, bn in PERSISTENT_TILES:
        if (bm, bn) == (default.block_m, default.block_n):
            continue
        cfg = heuristics.with_tile(base, m, n, bm, bn)
        out[f"persistent_bm{bm}_bn{bn}_s{cfg.stages}"] = cfg
    if c_tma and m > 64:  # the one-CTA-per-tile kernel (splits = 1; reads the bf16 C in place after its main loop)
        for bn, stages in TILE_KERNEL_PLANS:
            out[f"tile_kernel_bn{bn}_s{stages}"] = splitk.SplitKConfig(128, bn, 1, stages, SMS)
    return out


def plans_for(m: int, n: int, k: int, acc: bool = False) -> dict[str, object]:
    """name -> a SplitKConfig, a GemmConfig or "gemv"; "default" is the dispatch itself (not listed)."""
    if AB:
        return ab_plans(m, n, k, acc, torch.float32 if (n, k) in FP32_OUT else torch.bfloat16)
    if PERSISTENT_TILES:  # those tiles, and (--plans) the named plans of the search below
        out = persistent_tiles(m, n, k, acc, torch.float32 if (n, k) in FP32_OUT else torch.bfloat16)
        return {**out, **(_search_plans(m, n, k, acc) if ONLY_PLANS else {})}
    return _search_plans(m, n, k, acc)


def _search_plans(m: int, n: int, k: int, acc: bool) -> dict[str, object]:
    out: dict[str, object] = {}
    if m == 128:
        mc = mcast_variant("bf16", m, n, k, acc, torch.float32 if (n, k) in FP32_OUT else torch.bfloat16)
        if mc is not None:
            out["persistent_mcast_a"] = mc
    if m == 1:
        out["gemv"] = "gemv"
    base = splitk.pick_splitk(m, n, k, SMS, has_c=acc)
    if base is not None:
        out["plan_last_cta"] = dataclasses.replace(base, par_reduce=False, cluster_reduce=False)
        out["plan_par"] = dataclasses.replace(base, par_reduce=True, cluster_reduce=False)
    if base is not None and base.splits <= 8:
        out["plan_cluster"] = dataclasses.replace(base, cluster_reduce=True, par_reduce=False)
    if m == 128:
        kb = -(-k // 64)
        for bn in (64, 128, 256):
            tiles = -(-n // bn)
            s = SMS // tiles
            if s < 2:
                continue
            se = splitk.effective_splits(kb, min(s, splitk.MAX_SPLITS, kb))
            out[f"par_bm128_bn{bn}_s{se}"] = splitk.SplitKConfig(128, bn, se, splitk.max_stages(128, bn), SMS,
                                                                 par_reduce=True)
            for cs in sorted({min(s, 8), 4}):  # a tile's splits as one cluster (<= 8: portable size)
                if 2 <= cs <= s:
                    ce = splitk.effective_splits(kb, cs)
                    out[f"cluster_bm128_bn{bn}_s{ce}"] = splitk.SplitKConfig(128, bn, ce, splitk.max_stages(128, bn),
                                                                             SMS, cluster_reduce=True)
    return _cluster_filter(out)


def _cluster_filter(plans: dict) -> dict:
    if DEFAULT_ONLY:
        return {}
    if ONLY_PLANS:  # --plans: these names only (beside the default)
        plans = {k: v for k, v in plans.items() if k in ONLY_PLANS}
    if CLUSTER == "all":
        return plans
    keep = CLUSTER == "only"  # the plans that use thread-block clusters: cluster_reduce, persistent multicast

    def clustered(v) -> bool:
        return getattr(v, "cluster_reduce", False) or getattr(v, "multicast", 1) > 1

    return {k: v for k, v in plans.items() if clustered(v) == keep}


def clusters_info(m: int, n: int, cfg, key_fn) -> dict | None:
    """For a cluster_reduce plan: its clusters and how many the driver holds at once (a second wave is fatal)."""
    if not getattr(cfg, "cluster_reduce", False):
        return None
    gx, gy, gz = cfg.grid(m, n)
    try:
        have = splitk._kernel(key_fn(cfg)).max_active_clusters(cfg.num_threads, cfg.smem_bytes, (1, 1, cfg.splits))
    except Exception as e:  # noqa: BLE001 - informational only
        have = f"{type(e).__name__}: {e}"[:120]
    return {"clusters": gx * gy, "size": cfg.splits, "max_active": have}


class _Recorder:
    """Stands in for a compiled kernel while the runs are recorded: keeps the key, launches nothing."""

    keys: dict = {}

    def __init__(self, key):
        _Recorder.keys[key.expression] = key

    def launch(self, *args, **kwargs) -> None:
        return None


def _compile(key) -> str:
    if isinstance(key, splitk.SplitKKey):
        splitk.compile_kernels([key])
    elif isinstance(key, gemv.GemvKey):
        gemv.compile_kernels([key])
    else:
        cuda_gemm.compile_kernel(key)
    return key.expression


def prewarm(cases: list, fp8_cases: list, jobs: int) -> int:
    """Every deepgemm kernel the runs use, compiled in parallel: one pass with launches recorded, not run."""
    mods = (cuda_gemm, splitk, gemv)
    saved = [mod._kernel for mod in mods]
    for mod in mods:
        mod._kernel = _Recorder
    try:
        for cs in cases:
            for fn in runs_of(*operands(*cs)).values():
                fn()
        for m, n, k in fp8_cases:
            for fn in fp8_runs_of(*fp8_operands(m, n, k)).values():
                fn()
    finally:
        for mod, f in zip(mods, saved):
            mod._kernel = f
    deepgemm.plans.clear()  # plans made in the recording pass would replay recorders
    with cf.ProcessPoolExecutor(jobs) as ex:
        list(ex.map(_compile, _Recorder.keys.values()))
    for f in saved:
        f.cache_clear()
    return len(_Recorder.keys)


def operands(m: int, n: int, k: int, acc: bool):
    out_dtype = torch.float32 if (n, k) in FP32_OUT else torch.bfloat16
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(m, n, device="cuda", dtype=out_dtype)
    return m, n, k, a, b, d, d if acc else None


def runs_of(m, n, k, a, b, d, c) -> dict:
    runs = {} if CLUSTER == "only" and not DEFAULT_ONLY else {"default": lambda: deepgemm.bf16_gemm_nt(a, b, d, c=c)}
    for name, cfg in plans_for(m, n, k, c is not None).items():
        if cfg == "gemv":
            runs[name] = lambda: gemv.gemv_bf16(a, b, d, c, SMS)
        else:
            runs[name] = lambda cfg=cfg: cuda_gemm.dense(a, None, b, None, d, c, config=cfg)
    return runs


FP8_NK = [(24576, 1536), (32768, 512), (7168, 16384), (7168, 2048), (2112, 7168), (576, 7168), (4096, 7168)]


def fp8_plans(m: int, n: int, k: int) -> dict[str, object]:
    """fp8 at small M: persistent tiles of other widths than the heuristic's (block_n x N tiles over the SMs),
    and split-K with every split reducing a slice (128 x 64 / 128 tiles, as many splits as fit one wave)."""
    out: dict[str, object] = {}
    if AB:  # the persistent plan with A multicast (the plain remote release: never timed at M = 128)
        mc = mcast_variant("fp8", m, n, k)
        return {} if mc is None else {"persistent_mcast_a": mc}
    base = pick_config("fp8", m, n, k, num_sms=SMS, tma_store=True)
    for bn in (32, 64, 96, 112, 128, 160):
        if bn != base.block_n and bn * 2 >= base.block_n and bn <= 2 * base.block_n:
            out[f"persistent_bn{bn}"] = dataclasses.replace(
                base, block_n=bn, stages=heuristics.max_stages("fp8", base.block_m, bn, base.block_m * bn * 2))
    kb = -(-k // 128)
    for bn in (64, 128):
        s = SMS // (-(-n // bn) * -(-m // 128))
        if s >= 2:
            se = splitk.effective_splits(kb, min(s, kb))
            out[f"par_bm128_bn{bn}_s{se}"] = splitk.SplitKConfig(128, bn, se, splitk.max_stages(128, bn, True), SMS,
                                                                 fp8=True, par_reduce=True)
    for bn in (64, 128):
        s = SMS // (-(-n // bn) * -(-m // 128))
        if s >= 2:
            ce = splitk.effective_splits(kb, min(s, 8, kb))
            out[f"cluster_bm128_bn{bn}_s{ce}"] = splitk.SplitKConfig(128, bn, ce, splitk.max_stages(128, bn, True),
                                                                     SMS, fp8=True, cluster_reduce=True)
    sk = splitk.pick_splitk(m, n, k, SMS, "fp8")
    if sk is not None:
        out["plan_par"] = dataclasses.replace(sk, par_reduce=True)
    mc = mcast_variant("fp8", m, n, k)
    if mc is not None:
        out["persistent_mcast_a"] = mc
    return _cluster_filter(out)


def fp8_operands(m: int, n: int, k: int):
    # random e4m3 operands and positive scales (no cast kernel to compile: the scales' values do not change the time)
    a8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sfa = torch.rand(m, -(-k // 128), device="cuda") + 0.5
    sfb = torch.rand(-(-n // 128), -(-k // 128), device="cuda") + 0.5
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    return m, n, k, a8, sfa, deepgemm.get_mn_major_tma_aligned_tensor(sfa), b8, sfb, d


def fp8_runs_of(m, n, k, a8, sfa, sfa_t, b8, sfb, d) -> dict:
    runs = ({} if CLUSTER == "only" and not DEFAULT_ONLY
            else {"default": lambda: deepgemm.fp8_gemm_nt((a8, sfa_t), (b8, sfb), d)})
    for name, cfg in fp8_plans(m, n, k).items():
        runs[name] = lambda cfg=cfg: cuda_gemm.dense(a8, sfa_t, b8, sfb, d, None, config=cfg)
    return runs


def run_fp8_shape(m: int, n: int, k: int) -> dict:
    ops = fp8_operands(m, n, k)
    _, _, _, a8, sfa, sfa_t, b8, sfb, d = ops
    one_a, one_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    row_t = timed(lambda: torch._scaled_mm(a8, b8.T, scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16))
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)
    row = {"shape": [m, n, k], "kind": "fp8", "scaled_mm_rowwise": row_t, "runs": {}}
    for name, fn in fp8_runs_of(*ops).items():
        fn()
        t = timed(fn)
        t["calc_diff"] = float(deepgemm.testing.calc_diff(d, ref))
        t["vs_rowwise"] = row_t["us"] / t["us"]
        if GRAPH:
            t["graph_vs_rowwise"] = row_t["graph_us"] / t["graph_us"]
        row["runs"][name] = t
    best = min(row["runs"].items(), key=lambda kv: kv[1]["us"], default=("none", None))
    print(f"fp8 {m}x{n}x{k}: _scaled_mm row {row_t['us']:.1f} us; "
          + "; ".join(f"{nm} {t['us']:.1f} {t['vs_rowwise']:.2f}x{' BAD' if t['calc_diff'] > 1e-5 else ''}"
                      for nm, t in row["runs"].items()) + f" | best {best[0]}", flush=True)
    return row


def run_shape(m: int, n: int, k: int, acc: bool) -> dict:
    m, n, k, a, b, d, c = operands(m, n, k, acc)
    out_dtype = d.dtype
    d0 = d.float().clone()
    ref = a.float() @ b.float().T + (d0 if acc else 0)
    if acc:
        cub = timed(lambda: d.addmm_(a, b.T))
    elif out_dtype == torch.bfloat16:
        cub = timed(lambda: torch.mm(a, b.T, out=d))
    else:
        cub = timed(lambda: torch.mm(a, b.T, out_dtype=torch.float32))
    row = {"shape": [m, n, k], "out": str(out_dtype).replace("torch.", ""), "acc": acc, "cublas": cub, "runs": {}}

    def check(fn) -> float:
        d.copy_(d0)
        fn()
        v = float(deepgemm.testing.calc_diff(d, ref))
        d.copy_(d0)
        return v

    cfgs = plans_for(m, n, k, c is not None)
    for name, fn in runs_of(m, n, k, a, b, d, c).items():
        diff = check(fn)
        t = timed(fn)
        t["calc_diff"] = diff
        info = clusters_info(m, n, cfgs.get(name), lambda cfg: splitk.splitk_key(cfg, n, k, d.dtype,
                                                                                  None if c is None else c.dtype))
        if info:
            t["clusters"] = info
        t["vs_cublas"] = cub["us"] / t["us"]
        if GRAPH:
            t["graph_vs_cublas"] = cub["graph_us"] / t["graph_us"]
        row["runs"][name] = t
    best = min(row["runs"].items(), key=lambda kv: kv[1]["us"], default=("none", None))
    nbytes = (n * k + m * k) * 2 + m * n * d.element_size() * (2 if acc else 1)
    row["byte_floor_us_at_4tbps"] = nbytes / 4.0e12 * 1e6
    print(f"{m}x{n}x{k}{' acc' if acc else ''} ({row['out']}): cuBLAS {cub['us']:.1f} us"
          + (f" (graph {cub['graph_us']:.1f})" if GRAPH else "") + f", floor {row['byte_floor_us_at_4tbps']:.1f}; "
          + "; ".join(f"{nm} {t['us']:.1f}" + (f"/{t['graph_us']:.1f}" if GRAPH else "")
                      + f" {t['vs_cublas']:.2f}x{' BAD' if t['calc_diff'] > 1e-5 else ''}"
                      for nm, t in row["runs"].items())
          + f" | best {best[0]}", flush=True)
    return row


def main() -> None:
    global GRAPH, CLUSTER, DEFAULT_ONLY, AB
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--m", default="1,128")
    ap.add_argument("--acc", default="0,1", help="C = D rows too (1), plain (0)")
    ap.add_argument("--nk", default=None, help="only these N x K, e.g. 2112x7168,576x7168")
    ap.add_argument("--acc-nk", default=None, help="the C = D rows only for these N x K")
    ap.add_argument("--fp8-m", default="", help="fp8 rows at these M (vs _scaled_mm per-row), e.g. 128")
    ap.add_argument("--fp8-nk", default=None, help="only these fp8 N x K")
    ap.add_argument("--prewarm-only", action="store_true")
    ap.add_argument("--cluster", choices=("all", "no", "only"), default="all",
                    help="the cluster_reduce plans too / not / only (a run of its own: a cluster plan that hangs)")
    ap.add_argument("--name", default="sweep_small_m.json", help="the JSON's file name in --out")
    ap.add_argument("--default-only", action="store_true", help="only the peer and deepgemm's own dispatch")
    ap.add_argument("--ab", action="store_true", help="the default and the opt-in plans of ab_plans only")
    ap.add_argument("--once", action="store_true", help="one launch of each contender (under ncu), no timing")
    ap.add_argument("--plans", default="", help="only these named plans beside the default, e.g. plan_par,plan_cluster")
    ap.add_argument("--persistent-tiles", default="", help="only the persistent kernel with these BMxBN tiles "
                    "(beside the default), e.g. 128x128,128x64,64x256")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    GRAPH = args.graph
    CLUSTER = args.cluster
    DEFAULT_ONLY = args.default_only
    AB = args.ab
    ONLY_PLANS.update(p for p in args.plans.split(",") if p)
    PERSISTENT_TILES[:] = [tuple(int(v) for v in t.split("x")) for t in args.persistent_tiles.split(",") if t]
    nks = NK if args.nk is None else [tuple(int(v) for v in s.split("x")) for s in args.nk.split(",")]
    acc_nks = nks if args.acc_nk is None else [tuple(int(v) for v in s.split("x")) for s in args.acc_nk.split(",")]
    cases = [(m, n, k, bool(int(acc))) for m in (int(x) for x in args.m.split(",") if x) for n, k in nks
             for acc in args.acc.split(",") if not (int(acc) and ((n, k) in FP32_OUT or (n, k) not in acc_nks))]
    fp8_cases = [(m, n, k) for m in (int(x) for x in args.fp8_m.split(",") if x) for n, k in FP8_NK
                 if args.fp8_nk is None or f"{n}x{k}" in args.fp8_nk.split(",")]
    t0 = time.time()
    print(f"prewarm: {prewarm(cases, fp8_cases, args.jobs)} kernels in {time.time() - t0:.1f} s", flush=True)
    if args.prewarm_only:
        return
    if args.once:  # one launch of every contender, for ncu (no timing, no checks)
        for cs in cases:
            m, n, k, a, b, d, c = operands(*cs)
            if c is not None:
                d.addmm_(a, b.T)
            elif d.dtype == torch.bfloat16:
                torch.mm(a, b.T, out=d)
            else:
                torch.mm(a, b.T, out_dtype=torch.float32)
            for fn in runs_of(m, n, k, a, b, d, c).values():
                fn()
        for m, n, k in fp8_cases:
            ops = fp8_operands(m, n, k)
            a8, b8 = ops[3], ops[6]
            torch._scaled_mm(a8, b8.T, scale_a=torch.ones(m, 1, device="cuda"), scale_b=torch.ones(1, n, device="cuda"),
                             out_dtype=torch.bfloat16)
            for fn in fp8_runs_of(*ops).values():
                fn()
        torch.cuda.synchronize()
        print("once: done", flush=True)
        return
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "timing": "tilehal.bench median of 30, L2 flushed" + ("; graph: tilehal.bench_graph, L2 flushed"
                                                                  if GRAPH else ""),
            "cublas": "torch.mm out= (bf16), out_dtype=float32 (fp32), d.addmm_ (C = D)", "cluster": CLUSTER,
            "env": {k: v for k, v in os.environ.items() if k.startswith("DEEPGEMM_")}}
    rows, fp8_rows = [], []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / args.name).write_text(json.dumps({"meta": meta, "rows": rows, "fp8_rows": fp8_rows}, indent=1))

    for cs in cases:
        rows.append(run_shape(*cs))
        save()
    for cs in fp8_cases:
        fp8_rows.append(run_fp8_shape(*cs))
        save()
    best = {}
    for r in rows:
        for nm, t in r["runs"].items():
            best.setdefault(nm, []).append(t["vs_cublas"])
    geo = {nm: math.exp(sum(map(math.log, v)) / len(v)) for nm, v in best.items() if len(v) == len(rows)}
    print("geo-mean vs cuBLAS (rows where every variant ran):", geo)


if __name__ == "__main__":
    main()
