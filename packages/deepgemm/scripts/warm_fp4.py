"""Compile (NVRTC, no GPU) every FP4 kernel (mma.sync, wgmma, streaming) that tests/test_fp4.py and
benchmarks/bench_fp4.py use, in parallel, into the tilehal compile cache (run it on the GPU machine before the
tests: ~4 s per kernel).

    python packages/deepgemm/scripts/warm_fp4.py [--jobs 8] [--list] [--kinds mma,wgmma,stream]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf

from deepgemm import cuda_fp4
from tilehal.testing import environ

SMS = 132
TEST_SHAPES = [(1, 7168, 2048), (16, 2112, 7168), (64, 4096, 7168), (128, 4096, 7168), (5, 200, 256), (37, 136, 1152)]
BENCH_M = (1, 16, 64, 128)
BENCH_NK = [(7168, 2048), (2112, 7168), (4096, 7168)]
STREAM_SHAPES = [(1, 7168, 2048), (16, 2112, 7168), (3, 4096, 7168), (9, 200, 256), (2, 136, 16384), (16, 72, 1152),
                 (25, 4096, 2048), (33, 2112, 2048), (64, 200, 1024), (128, 4096, 7168)]  # tests/test_fp4.py's


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
    # the bench's A/B: one warpgroup per CTA at M = 64 / 128, fewer cluster splits at M = 1 / 16
    for name, value, ms in (("DEEPGEMM_FP4_WG_NWG", "1", (64, 128)), ("DEEPGEMM_FP4_WG_MAX_SPLITS", "2", (1, 16)),
                            ("DEEPGEMM_FP4_WG_MAX_SPLITS", "4", (1, 16))):
        with environ({name: value}):
            keys.update(cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=SMS).key
                        for m in ms for n, k in BENCH_NK)
    return sorted(keys, key=lambda k: k.expression)


def stream_keys() -> list[cuda_fp4.Fp4StreamKey]:
    keys = set()
    for m, n, k in [*STREAM_SHAPES, *TEST_SHAPES, *((m, n, k) for m in BENCH_M for n, k in BENCH_NK)]:
        for out_bf16 in (True, False):
            p = cuda_fp4.plan_stream(m, n, k, 1, out_bf16, False, False, num_sms=SMS)
            if p is not None:
                keys.add(p.key)
    for m in (16, 64):  # with C (the mixed-scales test)
        keys.add(cuda_fp4.plan_stream(m, 2112, 7168, 1, False, True, False, num_sms=SMS).key)
    keys.add(cuda_fp4.plan_stream(64, 2112, 2048, 4, True, False, True, num_sms=SMS, expected_m=16).key)  # masked
    return sorted(keys, key=lambda k: k.expression)


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


KINDS = {"mma": mma_keys, "wgmma": wgmma_keys, "stream": stream_keys}


def all_keys(kinds=tuple(KINDS)) -> list:
    return [key for kind in kinds for key in KINDS[kind]()]


def _compile(key) -> str:
    cuda_fp4.compile_kernel(key)
    return key.expression


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kernel kinds (mma, wgmma, stream)")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: expected some of {', '.join(KINDS)}, got {', '.join(unknown)}")
    keys = all_keys(kinds)
    if args.list:
        print("\n".join(k.expression for k in keys))
        return
    with cf.ProcessPoolExecutor(args.jobs) as ex:
        for expr in ex.map(_compile, keys):
            print("compiled", expr, flush=True)


if __name__ == "__main__":
    main()
