"""Warm the kernel cache for fp4m's GPU job (NVRTC only, no GPU): the decode-to-shared FP4 kernel (DEEPGEMM_FP4_KERNEL=dec)
for its GPU tests (packages/deepgemm/tests/test_fp4_dec.py), the bench rows (M = 64 / 128 at the issue shapes: dec with
bf16 and e4m3 activations and its (BN, splits) variants, each with every split cap the launch's cluster fit may step
down to), the default policy for both activation kinds and the e4m3 wgmma kernel at those rows, and the ncu launches. Run it through
scripts/gpu/warm.sh:

    scripts/gpu/warm.sh fp4m /tmp/fp4m_stage python3 scripts/gpu/fp4m_warm.py [--jobs 2] [--list]

deepgemm fp8_gemm_nt (the peer) is not warmed here: the job compiles it on the device in parallel with its tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tilehal.testing import environ

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "packages/deepgemm/tests"))

from fp4_warm import BENCH_NK, SMS, auto_keys, warm  # noqa: E402

BENCH_MS = (1, 16, 64, 128)
# the job's bench variants (gpu_job.sh V): (BN, splits, multicast, CTAs per SM, warp-specialized slots), both kinds
BENCH_VARIANTS = ((None, None, None, None, "2"), (None, None, None, None, "3"), (None, None, None, None, "4"))


def dec_keys(keys: set, m, n, k, fp8, out_bf16=True, has_c=False, bn=None, splits=None, mcast=None,
             blocks=None, ws=None) -> None:
    """The dec plan and every plan the launch's cluster fit may step down to (split caps 1 .. the plan's)."""
    from deepgemm import cuda_fp4

    p = cuda_fp4._plan_dec(m, n, k, out_bf16, has_c, fp8, SMS, bn, splits, mcast, blocks, ws)
    keys.add(p.key)
    for most in range(1, p.splits):
        keys.add(cuda_fp4._plan_dec(m, n, k, out_bf16, has_c, fp8, SMS, bn, str(most), mcast, blocks, ws).key)
    if p.key.mcast > 1:  # the launch widens the slice while the driver holds fewer clusters than the GPC model
        for wider in (p.key.bn + 8, p.key.bn + 16):
            if wider <= (cuda_fp4.DEC_FP8_MAX_BN if fp8 else 256):
                keys.add(cuda_fp4._plan_dec(m, n, k, out_bf16, has_c, fp8, SMS, str(wider), "1", mcast, blocks).key)


def job_keys() -> set:
    import test_fp4_dec as t

    keys: set = set(t.DEC_KEYS)
    for m, n, k in t.GPU_SHAPES:  # test_gpu_dec_kernel_matches_reference: fp32 and bf16 out, dec and ws
        for fp8 in (False, True):
            for out_bf16 in (True, False):
                for ws in (None, t.WS):
                    dec_keys(keys, m, n, k, fp8, out_bf16, ws=ws)
    for bn, sp, mc, bl, ws in t.VARIANTS:  # test_gpu_dec_variants_mixed_scales_c_and_graph_replay: fp32 out + C
        for fp8 in (False, True):
            for m in (64, 128):
                if t.fits(fp8, bn, ws):
                    dec_keys(keys, m, 2112, 7168, fp8, False, True, bn, sp, mc, bl, ws)
    for n, k in BENCH_NK:
        for m in BENCH_MS:
            for fp8 in (False, True):
                dec_keys(keys, m, n, k, fp8)
                for bn, sp, mc, bl, ws in BENCH_VARIANTS:
                    dec_keys(keys, m, n, k, fp8, bn=bn, splits=sp, mcast=mc, blocks=bl, ws=ws)
            with environ({"DEEPGEMM_FP4_KERNEL": "auto"}):
                auto_keys(keys, m, n, k)  # bf16_fp4_auto
                auto_keys(keys, m, n, k, act_fp8=True)  # fp8_fp4 (the e4m3 default: mma.sync)
    return keys


if __name__ == "__main__":
    warm(job_keys, "fp4m warm")
