"""Warm the kernel cache for grouped's GPU round (NVRTC only, no GPU): bench_grouped's kernels and the ones
bench_models' MoE row launches (fp8 SwiGLU gate|up + down, bf16 gate|up + down, casts, silu, combine).
Run with the device's NVRTC version (13.0) from the same tree path the device uses, which scripts/gpu/warm.sh
arranges (the job then sources scripts/gpu/job.sh NAME):
    scripts/gpu/warm.sh NAME CARRIED_TREE python3 scripts/gpu/grouped_warm.py
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def moe_kernels() -> None:
    import torch
    from deepgemm import cuda_cast, cuda_gemm
    from deepgemm.heuristics import pick_config, swiglu_config

    from tilestack import moe

    h, f, e = 4096, 14336, 8
    m = moe.local_layout_rows(4096 * 2, e, 128)
    d = torch.empty((1, 1), dtype=torch.bfloat16)
    keys = []
    for kind in ("fp8", "bf16"):
        for n, k in ((2 * f, h), (h, f)):
            cfg = pick_config(kind, m, n, k, num_groups=e, grouping="contiguous", num_sms=132,
                              **cuda_gemm.epilogue(d, n, False, "contiguous"))
            keys.append(cuda_gemm.kernel_key(cfg, n, k, "contiguous", e, torch.bfloat16, False))
            if kind == "fp8" and n == 2 * f:
                keys.append(cuda_gemm.kernel_key(swiglu_config(cfg, m, n), n, k, "contiguous", e, torch.bfloat16,
                                                 False))
    bf16 = torch.bfloat16
    casts = (cuda_cast.token_expression(bf16, 128, True), cuda_cast.block_expression(bf16, True),
             cuda_cast.silu_expression(bf16, False, True), cuda_cast.silu_expression(bf16, True, True))
    with cf.ProcessPoolExecutor(2) as pool:
        futs = [pool.submit(cuda_gemm.compile_kernel, k) for k in keys]
        futs += [pool.submit(cuda_cast.compile_module, (c,)) for c in casts]
        futs.append(pool.submit(moe.compile_combine, (moe.combine_expression(True),)))
        futs.append(pool.submit(moe.compile_layout))
        for fu in futs:
            fu.result()
    print(f"moe: {len(keys)} GEMM kernels + casts + combine", flush=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "packages/deepgemm/benchmarks/bench_grouped.py"), "--compile",
                    "--jobs", "2"], check=True)
    moe_kernels()
    # the fp8 / bf16 grouped kernels deepgemm's GPU tests launch
    subprocess.run([sys.executable, str(ROOT / "packages/deepgemm/scripts/warm_cache.py"), "--only", "grouped",
                    "--jobs", "2"], check=True, stdout=subprocess.DEVNULL)
    print(f"# warmed in {time.perf_counter() - t0:.0f} s", flush=True)
