"""Warm the kernel cache for fp4's GPU job (NVRTC only, no GPU): every FP4-weight kernel the job's GPU tests
(packages/deepgemm/tests/test_fp4.py -k small) and its bench_fp4 runs launch (the small-M kernel with its A/B
variants, the default policy's mma.sync / wgmma kernels, the mma.sync contender). Run it through
scripts/gpu/warm.sh, which copies the carried tree to /tmp/fp4_tree, points the cache at /tmp/fp4_cache with a
fresh key, and preloads the GPU machine's NVRTC (13.0):

    scripts/gpu/warm.sh fp4 /tmp/fp4_stage python3 scripts/gpu/fp4_warm.py [--jobs 2]

Keys come from the planners with num_sms = 132 (the H200) and, for the cluster kernels, every split cap 1..8
(the launch's cuOccupancyMaxActiveClusters check may take fewer splits, which can change the key). deepgemm
fp8_gemm_nt (the peer) and the fp8 casts are not warmed here: the job compiles them on the device in parallel.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time
from pathlib import Path

from tilehal.testing import environ

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packages/deepgemm/tests"))

SMS = 132
BENCH_NK = [(7168, 2048), (2112, 7168), (4096, 7168)]
# the job's bench_fp4 --variants (gpu_job.sh) = test_fp4.SMALL_VARIANTS: (environment of the small-M kernel, M values)


def small_keys(keys: set, m, n, k, groups=1, out_bf16=True, has_c=False, masked=False, expected_m=None) -> None:
    from deepgemm import cuda_fp4

    for most in range(1, cuda_fp4.MAX_CLUSTER_SPLITS + 1):
        p = cuda_fp4.plan_small(m, n, k, groups, out_bf16, has_c, masked, num_sms=SMS, expected_m=expected_m,
                                max_splits=most)
        if p is not None:
            keys.add(p.key)


def wgmma_keys(keys: set, m, n, k, groups=1, out_bf16=True, has_c=False, masked=False, expected_m=None,
               act_fp8=False) -> None:
    from deepgemm import cuda_fp4

    for most in range(1, cuda_fp4.MAX_CLUSTER_SPLITS + 1):
        keys.add(cuda_fp4.plan_wgmma(m, n, k, groups, out_bf16, has_c, masked, num_sms=SMS, expected_m=expected_m,
                                     act_fp8=act_fp8, max_splits=most).key)


def auto_keys(keys: set, m, n, k, act_fp8=False, out_bf16=True, has_c=False, groups=1, masked=False,
              expected_m=None) -> None:
    """The kernel DEEPGEMM_FP4_KERNEL (as set) picks for this call: small, wgmma or mma.sync."""
    from deepgemm import cuda_fp4

    mm = expected_m or m
    if cuda_fp4.use_small(act_fp8, mm) and cuda_fp4.plan_small(m, n, k, groups, out_bf16, has_c, masked,
                                                               num_sms=SMS, expected_m=expected_m) is not None:
        small_keys(keys, m, n, k, groups, out_bf16, has_c, masked, expected_m)
    elif cuda_fp4.use_wgmma(act_fp8, mm):
        wgmma_keys(keys, m, n, k, groups, out_bf16, has_c, masked, expected_m, act_fp8)
    else:
        keys.add(cuda_fp4.plan(m, n, k, groups, act_fp8, out_bf16, has_c, masked, num_sms=SMS,
                               expected_m=expected_m).key)


def job_keys() -> set:
    import test_fp4 as t

    keys: set = set()
    with environ({"DEEPGEMM_FP4_KERNEL": "small"}):
        for m, n, k in t.SMALL_SHAPES:  # test_gpu_small_kernel_matches_reference: fp32 and bf16 out
            for out_bf16 in (True, False):
                auto_keys(keys, m, n, k, out_bf16=out_bf16)
        for variant, ms in t.SMALL_VARIANTS:  # test_gpu_small_kernel_variants_match
            with environ(variant):
                for m, n, k in ((1, 4096, 7168), (16, 2112, 7168)):
                    if m in ms:
                        for out_bf16 in (True, False):
                            auto_keys(keys, m, n, k, out_bf16=out_bf16)
        for m in (1, 16, 32, 64):  # test_gpu_mixed_scales_c_and_graph_replay[small-*]: fp32 out + C
            auto_keys(keys, m, 2112, 7168, out_bf16=False, has_c=True)
        for fp8 in (True, False):  # test_gpu_grouped_masked[small-*]
            auto_keys(keys, 64, 2112, 2048, act_fp8=fp8, groups=4, masked=True, expected_m=16)
        for n, k in BENCH_NK:  # bench: bf16_fp4_small (M > 32: as auto), its variants at M = 1 / 16, M = 32
            for m in (1, 16, 32, 64, 128):
                auto_keys(keys, m, n, k)
            for variant, ms in t.SMALL_VARIANTS:
                with environ(variant):
                    for m in ms:
                        auto_keys(keys, m, n, k)
    with environ({"DEEPGEMM_FP4_KERNEL": "auto"}):
        for n, k in BENCH_NK:
            for m in (1, 16, 32, 64, 128):
                auto_keys(keys, m, n, k)
    with environ({"DEEPGEMM_FP4_KERNEL": "mma"}):
        for n, k in BENCH_NK:
            for m in (1, 16, 64, 128):
                auto_keys(keys, m, n, k)
    return keys


def warm(job_keys_fn, label: str) -> None:
    """The warm scripts' command line: compile (or, with --list, print) every key job_keys_fn() returns."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true", help="print the keys, compile nothing")
    args = ap.parse_args()
    from deepgemm import cuda_fp4

    keys = sorted(job_keys_fn(), key=lambda key: key.expression)
    if args.list:
        print("\n".join(key.expression for key in keys))
        print(f"{len(keys)} kernels")
        return
    t0 = time.time()

    def build(key):
        return key.expression, cuda_fp4.compile_kernel(key).cache_hit

    with cf.ThreadPoolExecutor(args.jobs) as ex:
        for expr, hit in ex.map(build, keys):
            print(f"{'hit ' if hit else 'new '} {expr}", flush=True)
    print(f"{label}: {len(keys)} kernels in {time.time() - t0:.0f} s")


def main() -> None:
    warm(job_keys, "fp4_warm")


if __name__ == "__main__":
    main()
