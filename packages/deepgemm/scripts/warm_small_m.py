"""Compile (NVRTC, no GPU needed) the bf16 kernels that DeepGEMM's test_bf16 `test_gemm` shapes, the
split-K and 1D1D GPU tests and `benchmarks/bench_small_m.py` ask for (and the fp8 split-K tests' and
`benchmarks/bench_small_m_fp8.py`'s), in parallel, into the tilehal cache.

Run it on the GPU machine before the tests (its NVRTC differs from the CPU machine's, and the cache
key holds the version):  python packages/deepgemm/scripts/warm_small_m.py --jobs 16
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
from pathlib import Path

import torch
from deepgemm import gemm_1d1d, splitk
from deepgemm.cuda_gemm import compile_kernel, kernel_key, staged_store
from deepgemm.heuristics import pick_config
from deepgemm.utils import set_num_sms

SMS = 132
HERE = Path(__file__).resolve().parent
# DeepGEMM test_bf16 forward (N, K) pairs; the last two write fp32 there.
BF16_OUT_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
FP32_OUT_NK = [(256, 7168), (129280, 7168)]


def planned_key(m: int, n: int, k: int, out: torch.dtype, c: torch.dtype | None, a_mn: bool = False,
                b_mn: bool = False):
    """The kernel cuda_gemm.dense launches for a bf16 GEMM (split-K / tile kernel or persistent)."""
    if a_mn or b_mn:  # read in place by the split-K / tile kernel
        return splitk.splitk_key(splitk.pick_tiles(m, n, k, SMS, has_c=c is not None), n, k, out, c, a_mn, b_mn)
    sk = splitk.pick_splitk(m, n, k, SMS, has_c=c is not None)
    if sk is None and c == torch.bfloat16:
        sk = splitk.pick_tiles(m, n, k, SMS, has_c=True)  # bf16 C: the tile kernel reads it in place
    if sk is not None:
        return splitk.splitk_key(sk, n, k, out, c)
    tma = out == torch.bfloat16 and c is None and n % 8 == 0
    cfg = pick_config("bf16", m, n, k, num_sms=SMS, tma_store=tma,
                      staged_store=staged_store(out, n, c is not None, tma))
    return kernel_key(cfg, n, k, "normal", 1, out, c is not None)


def upstream_test_gemm_keys() -> set:
    keys = set()
    for m in (1, 128, 4096):
        for n, k in BF16_OUT_NK:
            keys.add(planned_key(m, n, k, torch.bfloat16, None))
            keys.add(planned_key(m, n, k, torch.bfloat16, torch.bfloat16))
        for n, k in FP32_OUT_NK:
            keys.add(planned_key(m, n, k, torch.float32, None))
    for n, k in BF16_OUT_NK + FP32_OUT_NK:  # backward: dgrad (4096, K, N), wgrad (N, 4096, K) fp32 + c / bf16
        keys.add(planned_key(4096, k, n, torch.bfloat16, None, b_mn=True))
        keys.add(planned_key(n, 4096, k, torch.float32, torch.float32, a_mn=True, b_mn=True))
        keys.add(planned_key(n, 4096, k, torch.bfloat16, None, a_mn=True, b_mn=True))
    return keys


def test_keys() -> set:
    sys.path.insert(0, str(HERE.parents[0] / "tests"))
    import test_splitk

    keys = set(test_splitk.upstream_keys()) | test_splitk.mn_major_keys()
    for m, n, k in test_splitk.ODD:
        kb = -(-k // 64)
        bm = 64 if m <= 64 else 128
        for bn, s in ((64, 2), (128, 3), (256, 5)):
            cfg = splitk.SplitKConfig(bm, bn, splitk.effective_splits(kb, min(s, kb)), splitk.max_stages(bm, bn), SMS)
            keys.add(splitk.splitk_key(cfg, n, k, torch.float32, torch.float32))
    for m, n, k in ((128, 2112, 7168), (1, 4096, 7168), (1, 576, 7168)):
        keys.add(planned_key(m, n, k, torch.bfloat16, None))
    keys.add(planned_key(128, 2112, 7168, torch.bfloat16, torch.bfloat16))
    import test_1d1d

    keys |= set(test_1d1d.kernel_keys())
    return keys


def bench_keys(with_variants: bool = True) -> set:
    sys.path.insert(0, str(HERE.parents[0] / "benchmarks"))
    import bench_small_m

    keys = set()
    for m, n, k in bench_small_m.SHAPES:
        keys.add(planned_key(m, n, k, torch.bfloat16, None))
        if (n, k) not in bench_small_m.FP32_OUT:  # --small-acc: bf16 C = D
            keys.add(planned_key(m, n, k, torch.bfloat16, torch.bfloat16))
        cfg = pick_config("bf16", m, n, k, num_sms=SMS, tma_store=True)
        keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))  # DEEPGEMM_SPLITK=0
        cand = bench_small_m.mcast_candidate(m, n, k)
        if cand is not None:
            keys.add(splitk.splitk_key(cand, n, k, torch.float32 if (n, k) in bench_small_m.FP32_OUT else torch.bfloat16,
                                       None))
    for m, n, k in bench_small_m.ACC_SHAPES if with_variants else ():
        keys.add(splitk.splitk_key(splitk.pick_tiles(m, n, k, SMS), n, k, torch.bfloat16, torch.bfloat16))
        keys.add(planned_key(m, n, k, torch.bfloat16, torch.bfloat16))
    for m, n, k in bench_small_m.VARIANT_SHAPES if with_variants else ():
        for cfg in bench_small_m.variants(m, n, k):
            keys.add(splitk.splitk_key(cfg, n, k, torch.bfloat16, None))
    return keys


def fp8_keys(with_variants: bool = True) -> set:
    """fp8 split-K kernels of test_splitk.py and of benchmarks/bench_small_m_fp8.py (its persistent rows too)."""
    sys.path.insert(0, str(HERE.parents[0] / "tests"))
    sys.path.insert(0, str(HERE.parents[0] / "benchmarks"))
    import bench_small_m_fp8
    import bench_splitk_mcast
    import test_splitk

    keys = set(test_splitk.fp8_keys()) | set(test_splitk.mcast_keys()) | set(bench_splitk_mcast.keys())
    for m, n, k in bench_small_m_fp8.SHAPES:
        sk = splitk.pick_splitk(m, n, k, SMS, "fp8")
        if sk is not None:
            keys.add(splitk.splitk_key(sk, n, k, torch.bfloat16, None, fp8=True))
        cfg = pick_config("fp8", m, n, k, num_sms=SMS, tma_store=True)
        keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))  # DEEPGEMM_SPLITK=0 / no split-K
        for cand in bench_small_m_fp8.candidates(m, n, k).values():
            keys.add(splitk.splitk_key(cand, n, k, torch.bfloat16, None, fp8=True))
    for m, n, k in bench_small_m_fp8.VARIANT_SHAPES if with_variants else ():
        for cfg in bench_small_m_fp8.variants(m, n, k, mcast=True):
            keys.add(splitk.splitk_key(cfg, n, k, torch.bfloat16, None, fp8=True))
    return keys


def build(key):
    if isinstance(key, splitk.SplitKKey):
        return splitk.compile_kernels([key]).cache_hit
    if isinstance(key, gemm_1d1d.Key1D1D):
        return gemm_1d1d.compile_kernels([key]).cache_hit
    return compile_kernel(key).cache_hit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="all",
                    help="comma-separated sets: all, tests, upstream, bench, first, local, fp8. first: the GPU tests' "
                         "and the benchmark's kernels without its --variants; local: the GPU tests' and the "
                         "benchmark's with --variants; fp8: the fp8 split-K tests' and bench_small_m_fp8's (with "
                         "--variants)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    bad = only - {"all", "tests", "upstream", "bench", "first", "local", "fp8"}
    if bad:
        ap.error(f"--only: unknown set(s) {sorted(bad)}")
    set_num_sms(SMS)
    keys: set = set()
    if only & {"all", "upstream"}:
        keys |= upstream_test_gemm_keys()
    if only & {"all", "tests", "first", "local"}:
        keys |= test_keys()
    if only & {"all", "bench", "first", "local"}:
        keys |= bench_keys(with_variants="first" not in only)
    if only & {"all", "fp8"}:
        keys |= fp8_keys()
    keys = sorted(keys, key=lambda k: k.expression)
    print(f"{len(keys)} kernels", flush=True)
    with cf.ProcessPoolExecutor(args.jobs) as ex:
        hits = list(ex.map(build, keys))
    print(f"{sum(hits)} cached, {len(hits) - sum(hits)} built", flush=True)


if __name__ == "__main__":
    main()
