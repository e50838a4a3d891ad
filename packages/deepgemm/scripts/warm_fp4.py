"""Compile (NVRTC, no GPU) every FP4 kernel (mma.sync and wgmma) that tests/test_fp4.py and
benchmarks/bench_fp4.py use, in parallel, into the tilehal compile cache (run it on the GPU machine before the tests: ~4 s per kernel).

    python packages/deepgemm/scripts/warm_fp4.py [--jobs 8] [--list]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os

from deepgemm import cuda_fp4

SMS = 132
TEST_SHAPES = [(1, 7168, 2048), (16, 2112, 7168), (64, 4096, 7168), (128, 4096, 7168), (5, 200, 256), (37, 136, 1152)]
BENCH_M = (1, 16, 64, 128)
BENCH_NK = [(7168, 2048), (2112, 7168), (4096, 7168)]


def wgmma_keys() -> list[cuda_fp4.Fp4WgKey]:
    keys = set()
    shapes = [*TEST_SHAPES, (8, 64, 256), (33, 2112, 2048), (64, 7168, 2048), (100, 200, 1024), (128, 2112, 7168),
              (1, 4096, 7168), (16, 2112, 7168)] + [(m, n, k) for m in BENCH_M for n, k in BENCH_NK]
    for m, n, k in shapes:
        for fp8 in (True, False):
            for out_bf16 in (True, False):
                keys.add(cuda_fp4.plan_wgmma(m, n, k, 1, out_bf16, False, False, num_sms=SMS, act_fp8=fp8).key)
    for fp8 in (True, False):
        keys.add(cuda_fp4.plan_wgmma(16, 2112, 7168, 1, False, True, False, num_sms=SMS, act_fp8=fp8).key)  # with C
        keys.add(cuda_fp4.plan_wgmma(64, 2112, 2048, 4, True, False, True, num_sms=SMS, expected_m=16,
                                     act_fp8=fp8).key)  # grouped masked
    os.environ["DEEPGEMM_FP4_WG_NWG"] = "1"  # the bench's A/B of one warpgroup per CTA at M = 64 / 128
    try:
        for m in (64, 128):
            for n, k in BENCH_NK:
                keys.add(cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=SMS).key)
    finally:
        del os.environ["DEEPGEMM_FP4_WG_NWG"]
    for cap in ("2", "4"):  # and of fewer cluster splits at M = 1 / 16
        os.environ["DEEPGEMM_FP4_WG_MAX_SPLITS"] = cap
        try:
            for m in (1, 16):
                for n, k in BENCH_NK:
                    keys.add(cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=SMS).key)
        finally:
            del os.environ["DEEPGEMM_FP4_WG_MAX_SPLITS"]
    return sorted(keys, key=lambda k: k.expression)


def all_keys() -> list:
    return mma_keys() + wgmma_keys()


def mma_keys() -> list[cuda_fp4.Fp4Key]:
    keys = set()
    for m, n, k in TEST_SHAPES:
        for fp8 in (True, False):
            for out_bf16 in (True, False):
                keys.add(cuda_fp4.plan(m, n, k, 1, fp8, out_bf16, False, False, num_sms=SMS).key)
    keys.add(cuda_fp4.plan(16, 2112, 7168, 1, True, False, True, False, num_sms=SMS).key)  # with C
    for fp8 in (True, False):
        keys.add(cuda_fp4.plan(64, 2112, 2048, 4, fp8, True, False, True, num_sms=SMS, expected_m=16).key)
        for m in BENCH_M:
            for n, k in BENCH_NK:
                keys.add(cuda_fp4.plan(m, n, k, 1, fp8, True, False, False, num_sms=SMS).key)
    return sorted(keys, key=lambda k: k.expression)


def _compile(key) -> str:
    cuda_fp4.compile_kernel(key)
    return key.expression


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    keys = all_keys()
    if args.list:
        print("\n".join(k.expression for k in keys))
        return
    with cf.ProcessPoolExecutor(args.jobs) as ex:
        for expr in ex.map(_compile, keys):
            print("compiled", expr, flush=True)


if __name__ == "__main__":
    main()
