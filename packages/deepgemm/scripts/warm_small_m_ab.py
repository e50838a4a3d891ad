"""Warm the compile cache (NVRTC, no GPU) with every kernel session 27's small-M GPU job launches:
`sweep_small_m.py --ab`'s M = 128 rows (the default dispatch and the opt-in plans) and the GPU tests the job runs
(split-K reductions, multicast par_reduce, GEMV, C_TMA, C_EARLY), so the device compiles nothing.
(warm_small_m.py warms the upstream test_bf16 / bench_small_m sets from planned keys.)

The dispatch runs on CPU tensors with the launch, the TMA descriptor encoding and the device queries stubbed out
(`fake_device`): the host code picks plans exactly as on the GPU and every kernel key it reaches is recorded;
then each is compiled. Where the device decides at run time (a multicast par_reduce grid that the driver cannot
hold falls back to the last-CTA reduction; cluster plans likewise), both kernels are compiled.
Run it with the device's NVRTC version (the cache key holds it), e.g.
    TILESTACK_CACHE_DIR=... TILESTACK_CACHE_KEY_FILE=... python packages/deepgemm/scripts/warm_small_m_ab.py
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import deepgemm
import torch
from deepgemm import cuda_gemm, gemv, splitk
from deepgemm.heuristics import pick_config
from deepgemm.utils import set_num_sms
from tilehal.testing import environ

HERE = Path(__file__).resolve().parents[1]
SMS = 132
bf16 = torch.bfloat16


class _Rec:
    """Stands in for a compiled kernel: keeps the key, launches nothing, cannot answer occupancy queries."""

    keys: dict = {}

    def __init__(self, key):
        _Rec.keys[key.expression] = key

    def launch(self, *args, **kwargs) -> None:
        return None


@contextlib.contextmanager
def fake_device():
    """cuda_gemm / splitk / gemv host paths on CPU tensors: kernels recorded (_Rec), no descriptors, no device."""
    saved = []

    def patch(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    for mod in (cuda_gemm, splitk, gemv):
        patch(mod, "_kernel", _Rec)
    patch(cuda_gemm, "_capability_check", lambda device: None)
    patch(cuda_gemm, "_encode", lambda *args, **kw: bytes(128))
    patch(splitk, "_encode", lambda *args, **kw: bytes(128))
    patch(splitk, "_device_sms", lambda device: SMS)
    patch(splitk, "_workspace", lambda device, ws, cnt: (None, None))
    try:
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def bf16_call(m, n, k, c_dtype=None, out=bf16, config=None, in_place=False, a_mn=False, b_mn=False):
    a = torch.zeros(k, m, dtype=bf16).T if a_mn else torch.zeros(m, k, dtype=bf16)
    b = torch.zeros(k, n, dtype=bf16).T if b_mn else torch.zeros(n, k, dtype=bf16)
    d = torch.zeros(m, n, dtype=out)
    c = d if in_place else (None if c_dtype is None else torch.zeros(m, n, dtype=c_dtype))
    cuda_gemm.dense(a, None, b, None, d, c, config=config)


def fp8_call(m, n, k, c_dtype=None, out=bf16, config=None):
    a8 = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    b8 = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(torch.ones(m, -(-k // 128)))
    sfb = torch.ones(-(-n // 128), -(-k // 128))
    d = torch.zeros(m, n, dtype=out)
    c = None if c_dtype is None else torch.zeros(m, n, dtype=c_dtype)
    cuda_gemm.dense(a8, sfa, b8, sfb, d, c, config=config)


def sweep_calls() -> None:
    """sweep_small_m.py --ab --m 128 --fp8-m 128: every row's default and opt-in plans."""
    sys.path.insert(0, str(HERE / "benchmarks"))
    import sweep_small_m as sw

    sw.AB = True
    for n, k in sw.NK:
        out = torch.float32 if (n, k) in sw.FP32_OUT else bf16
        for acc in (False, True):
            if acc and (n, k) in sw.FP32_OUT:
                continue
            bf16_call(128, n, k, out=out, in_place=acc)
            for cfg in sw.plans_for(128, n, k, acc).values():
                bf16_call(128, n, k, out=out, in_place=acc, config=cfg)
    for n, k in sw.FP8_NK:
        fp8_call(128, n, k)
        for cfg in sw.fp8_plans(128, n, k).values():
            fp8_call(128, n, k, config=cfg)


def test_calls() -> None:
    """The kernels of the GPU tests the job runs (their parameter tables, through the same host code)."""
    sys.path.insert(0, str(HERE / "tests"))
    import test_c_epilogue as tc
    import test_gemv as tg
    import test_splitk as ts

    # test_splitk: upstream shapes (default dispatch, GEMV at M = 1), par / cluster reductions vs last CTA,
    # multicast par_reduce vs without, deterministic / graph / off-switch / fallback tests.
    for m in (1, 128):
        for n, k in ((2112, 7168), (576, 7168), (4096, 7168), (256, 7168)):
            for acc in (False, True):
                out = torch.float32 if (n, k) in ts.FP32_OUT_NK else bf16
                bf16_call(m, n, k, out=out, in_place=acc)
    for fp8, (m, n, k), (bm, bn, s), cd in ts.PAR_CASES:
        for cluster in (False, True):
            cfg = ts.par_cfg(fp8, m, n, k, bm, bn, s, cluster=cluster)
            last = dataclasses.replace(cfg, par_reduce=False, cluster_reduce=False)
            for conf in (cfg, last):
                (fp8_call if fp8 else bf16_call)(m, n, k, c_dtype=cd, out=cd or bf16, config=conf)
    for fp8, (m, n, k), (bm, bn, s), cd in ts.MCAST_PAR_CASES:
        mc = dataclasses.replace(ts.mcast_cfg(fp8, m, n, k, bm, bn, s), par_reduce=True)
        for conf in (mc, dataclasses.replace(mc, par_reduce=False), dataclasses.replace(mc, multicast=1)):
            (fp8_call if fp8 else bf16_call)(m, n, k, c_dtype=cd, out=cd or bf16, config=conf)
    cfg = splitk.SplitKConfig(block_m=128, block_n=64, splits=4, stages=4, num_sms=SMS, cluster_reduce=True)
    for conf in (cfg, dataclasses.replace(cfg, cluster_reduce=False, par_reduce=True),
                 dataclasses.replace(cfg, cluster_reduce=False)):
        bf16_call(128, 2112, 1024, config=conf)  # test_cluster_reduce_falls_back_when_the_clusters_do_not_fit
    for acc in (False, True):
        bf16_call(128, 2112, 7168, in_place=acc)  # deterministic, repeated and in place
    bf16_call(2, 4096, 7168)  # in a CUDA graph
    with environ({"DEEPGEMM_SPLITK": "0"}):
        bf16_call(2, 576, 7168)  # the off switch
    # test_gemv: upstream shapes with and without C, forced warps on odd shapes, strided rows, graph + off switch
    with environ({"DEEPGEMM_GEMV": "1"}):
        for n, k in tg.UPSTREAM_NK:
            out = torch.float32 if (n, k) in tg.FP32_OUT_NK else bf16
            for acc in (False, True):
                bf16_call(1, n, k, out=out, in_place=acc)
    for n, k in tg.ODD_NK:
        for w in (1, 8):
            for out in (torch.float32, bf16):
                _Rec(gemv.GemvKey(n, k, w, out == bf16, True, out == bf16))
    with environ({"DEEPGEMM_GEMV": "0"}):
        bf16_call(1, 4096, 7168)
    bf16_call(1, 576, 7168, b_mn=True)  # refused shapes: MN-major B through the tile kernel
    # test_c_epilogue: C_TMA vs staged, the switch, C_EARLY in every reduction, in place through the switch
    for m, n, k in tc.CTMA_SHAPES:
        bf16_call(m, n, k, c_dtype=bf16, config=tc.ctma_cfg(m, n, k))
        bf16_call(m, n, k, c_dtype=bf16, config=pick_config("bf16", m, n, k, num_sms=SMS, staged_store=4))
    with environ({"DEEPGEMM_C_EPILOGUE": "tma"}):
        bf16_call(128, 7168, 2048, c_dtype=bf16)
    for fp8, (m, n, k), (bm, bn, s), cd in tc.EARLY_CASES:
        par = tc.early_cfg(fp8, m, n, k, bm, bn, s, 1)
        plans = [par, dataclasses.replace(par, par_reduce=False)]
        if par.splits <= 8:
            plans.append(dataclasses.replace(par, par_reduce=False, cluster_reduce=True))
        for conf in plans:
            (fp8_call if fp8 else bf16_call)(m, n, k, c_dtype=cd, out=cd, config=conf)
    with environ({"DEEPGEMM_SPLITK_C": "early"}):
        bf16_call(128, 4096, 7168, in_place=True)


def twins(keys: list) -> list:
    """Kernels the device may switch to at run time: a multicast par_reduce grid the driver cannot hold at once
    reduces in the last CTA; a cluster_reduce grid falls back to par_reduce or the last CTA."""
    out = []
    for key in keys:
        if isinstance(key, splitk.SplitKKey) and key.reduce == 1 and key.multicast > 1:
            out.append(dataclasses.replace(key, reduce=0))
        if isinstance(key, splitk.SplitKKey) and key.reduce == 2:
            out += [dataclasses.replace(key, reduce=1), dataclasses.replace(key, reduce=0)]
    return out


def _compile(key) -> tuple[str, bool]:
    if isinstance(key, splitk.SplitKKey):
        mod = splitk.compile_kernels([key])
    elif isinstance(key, gemv.GemvKey):
        mod = gemv.compile_kernels([key])
    else:
        mod = cuda_gemm.compile_kernel(key)
    return key.expression, mod.cache_hit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true", help="print the kernels, compile none")
    args = ap.parse_args()
    set_num_sms(SMS)
    t0 = time.perf_counter()
    with fake_device():
        sweep_calls()
        test_calls()
    keys = list(_Rec.keys.values())
    keys += [k for k in twins(keys) if k.expression not in _Rec.keys]
    keys = list({k.expression: k for k in keys}.values())
    print(f"{len(keys)} kernels ({time.perf_counter() - t0:.1f} s to plan)", flush=True)
    if args.list:
        for k in sorted(keys, key=lambda k: k.expression):
            print(k.expression)
        return
    built = 0
    with cf.ProcessPoolExecutor(args.jobs) as ex:
        for i, (expr, hit) in enumerate(ex.map(_compile, keys)):
            built += not hit
            print(f"{i + 1}/{len(keys)} {'hit' if hit else 'built'} {expr}", flush=True)
    print(f"# {built} built, {len(keys) - built} cached, {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
