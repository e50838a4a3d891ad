"""Warm the kernel cache for fp4b's GPU job (NVRTC only, no GPU): DEEPGEMM_FP4_SMALL_FIT=driver compiles every
(row warps, splits) candidate of a shape to ask the driver about it, so the job's GPU tests
(packages/deepgemm/tests/test_fp4_fit.py), its `bench_fp4.py --plans` step, its bench runs (the small kernel with
the GPC model and with the driver's counts, the 24-warp build at M = 1 both ways, the default policy) and its ncu
launch need all of them, plus the model planner's keys for every split cap (fp4_warm.small_keys: the launch's
step-down) and the default policy's. Run it through scripts/gpu/warm.sh:

    scripts/gpu/warm.sh fp4b /tmp/fp4b_stage python3 scripts/gpu/fp4b_warm.py [--jobs 2] [--list]

deepgemm fp8_gemm_nt (the peer) is not warmed here: the job compiles it on the device in parallel with its tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tilehal.testing import environ

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "packages/deepgemm/tests"))

from fp4_warm import BENCH_NK, SMS, auto_keys, warm, wgmma_keys  # noqa: E402

# the job's 24-warp-build variants at M = 1 (gpu_job.sh B3): the build session 28's ncu read ran at 2 splits
B3 = {"DEEPGEMM_FP4_SMALL_MINB": "3", "DEEPGEMM_FP4_SMALL_SLOTS": "3"}


def fit_keys(keys: set, m, n, k, out_bf16=True) -> None:
    """What a DEEPGEMM_FP4_SMALL_FIT=driver call may build: every candidate, and (no candidate fits) the kernel the
    policy falls back to (wgmma from AUTO_WGMMA_MIN_M tokens on, else mma.sync)."""
    from deepgemm import cuda_fp4

    keys |= cuda_fp4.small_candidate_keys(m, n, k, 1, out_bf16, False, False)
    if cuda_fp4.use_wgmma(False, m):
        wgmma_keys(keys, m, n, k, out_bf16=out_bf16)
    else:
        keys.add(cuda_fp4.plan(m, n, k, 1, False, out_bf16, False, False, num_sms=SMS).key)


def job_keys() -> set:
    import test_fp4_fit as t

    keys: set = set()
    with environ({"DEEPGEMM_FP4_KERNEL": "small"}):
        for m, n, k in t.FIT_SHAPES:  # test_gpu_small_driver_fit_matches_reference: fp32 and bf16 out
            for out_bf16 in (True, False):
                fit_keys(keys, m, n, k, out_bf16)
        for n, k in BENCH_NK:  # --plans, bench: bf16_fp4_small (model) and fit_small (driver) at the 12 rows
            for m in (1, 16, 64, 128):
                fit_keys(keys, m, n, k)
                auto_keys(keys, m, n, k)
            with environ(B3):  # b3 / fit_b3 at M = 1
                fit_keys(keys, 1, n, k)
                auto_keys(keys, 1, n, k)
    with environ({"DEEPGEMM_FP4_KERNEL": "auto"}):  # bf16_fp4_auto: the default policy
        for n, k in BENCH_NK:
            for m in (1, 16, 64, 128):
                auto_keys(keys, m, n, k)
    return keys


def main() -> None:
    warm(job_keys, "fp4b_warm")


if __name__ == "__main__":
    main()
