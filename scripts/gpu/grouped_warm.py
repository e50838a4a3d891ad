"""Warm the kernel cache for grouped's GPU job (NVRTC only, no GPU): every kernel the job's GPU tests and its
bench_grouped A/B launch (the job: /work/next_gpu/grouped/gpu_job.sh of the session that prepared it). Run it
through scripts/gpu/warm.sh, which copies the carried tree to /tmp/grouped_tree, points the cache at
/tmp/grouped_cache with a fresh key, and preloads the GPU machine's NVRTC (13.0; its builtins library must be on
LD_LIBRARY_PATH too):

    LD_LIBRARY_PATH=/tmp/nvrtc130/x/nvidia/cu13/lib scripts/gpu/warm.sh grouped /work/main/.carry/grouped \\
        python3 scripts/gpu/grouped_warm.py [--moe]

The GPU tests' kernels are listed by mirroring each test's calls (shapes, configs, extra NVRTC options): the
grouped tests of packages/deepgemm/tests/test_gpu.py (through scripts/warm_cache.py's key list), every GPU test
of test_grouped_variants.py (with that module's own config helpers) and test_swiglu_epilogue.py. --moe also
compiles the kernels of bench_models' MoE row.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DG = ROOT / "packages/deepgemm"
# bench_grouped's variants in the job (the A/B of the s27 opt-in schedules against the defaults)
JOB_VARIANTS = "info_overlap,mcast_info,expert,expert16,expert_mcast"
JOB_MASKED_VARIANTS = "default,tma,tma_info,bn96,bn112,cursor"


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod


def test_jobs() -> list:
    """(KernelKey, extra NVRTC options) of every kernel the job's GPU tests launch."""
    import torch
    from deepgemm import cuda_gemm
    from deepgemm.heuristics import pick_config, swiglu_config

    bf16 = torch.bfloat16
    d = torch.empty(1, 1, dtype=bf16)
    jobs = set()
    # test_gpu.py -k "grouped or masked" (warm_cache's list of the GPU tests' kernels, grouped ones, multicast too)
    wc = _module(DG / "scripts/warm_cache.py", "warm_cache")
    wc.set_num_sms(wc.SMS)
    for key in wc.all_keys() | wc.all_keys(max_multicast=1):
        if key.grouping in ("contiguous", "masked"):
            jobs.add((key, ()))
    g, rows, n, k = 4, 256, 576, 384  # test_bf16_grouped_contiguous_mn_major_b_on_gpu
    cfg = pick_config("bf16", g * rows, n, k, num_groups=g, grouping="contiguous", num_sms=132,
                      **cuda_gemm.epilogue(d, n, False, "contiguous"))
    jobs.add((cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, bf16, False), ()))

    # test_grouped_variants.py: each GPU test's default call and its variants' calls
    tv = _module(DG / "tests/test_grouped_variants.py", "test_grouped_variants")
    m = tv._layout([1000, 0, 77, 2000, 128, 5]).numel()
    cfg = tv._contiguous_cfg(m, 1024, 768, 6)
    mcast = dataclasses.replace(cfg, multicast=2, multicast_on_a=True)
    for c, opts in ((cfg, ()), (cfg, tv.INFO), (mcast, ())):
        jobs.add((cuda_gemm.kernel_key(c, 1024, 768, "contiguous", 6, bf16, False), opts))
    m, g, n, k = 1920, 5, 1024, 512  # test_s27_contiguous_schedules_write_what_the_default_writes
    cfg = tv._contiguous_cfg(m, n, k, g)
    jobs.add((cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, bf16, False), ()))
    for v in tv.S27_VARIANTS:
        jobs.add((cuda_gemm.kernel_key(tv._s27_variant(cfg, v), n, k, "contiguous", g, bf16, False), ()))
    g, n, k = 4, 1024, 768  # the masked variant tests (expected_m 128)
    cfg = tv._masked_cfg(128, n, k, g)
    jobs.add((cuda_gemm.kernel_key(cfg, n, k, "masked", g, bf16, False), ()))
    jobs.add((cuda_gemm.kernel_key(cfg, n, k, "masked", g, bf16, False), tv.INFO))
    for on_a in (True, False):
        c = dataclasses.replace(cfg, multicast=2, multicast_on_a=on_a)
        jobs.add((cuda_gemm.kernel_key(c, n, k, "masked", g, bf16, False), ()))
    for v in tv.MASKED_S27:
        c, opts = tv._masked_s27(128, n, k, g, v)
        jobs.add((cuda_gemm.kernel_key(c, n, k, "masked", g, bf16, False), opts))

    # test_swiglu_epilogue.py::test_swiglu_gemm_on_gpu_matches_the_reference (and its reference's plain GEMM: none)
    ts = _module(DG / "tests/test_swiglu_epilogue.py", "test_swiglu_epilogue")
    for counts, f, k in (([1000, 0, 77, 2000, 128, 5, 300, 999], 1024, 512), ([4096, 4096], 14336 // 4, 1024)):
        m, g, n = ts._layout(counts).numel(), len(counts), 2 * f
        cfg = pick_config("fp8", m, n, k, num_groups=g, grouping="contiguous", num_sms=132,
                          **cuda_gemm.epilogue(d, n, False, "contiguous"))
        jobs.add((cuda_gemm.kernel_key(swiglu_config(cfg, m, n), n, k, "contiguous", g, bf16, False), ()))
    return sorted(jobs, key=lambda j: (j[0].expression, j[1]))


def _compile(job):
    from deepgemm import cuda_gemm

    key, opts = job
    return cuda_gemm.compile_kernel(key, opts).cache_hit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", action="store_true", help="also bench_models' MoE row kernels (s26 job)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(DG / "benchmarks/bench_grouped.py"), "--compile", "--jobs", str(args.jobs),
                    "--variants", JOB_VARIANTS, "--masked-variants", JOB_MASKED_VARIANTS], check=True)
    jobs = test_jobs()
    with cf.ProcessPoolExecutor(args.jobs) as pool:
        hits = list(pool.map(_compile, jobs))
    print(f"GPU tests: {len(jobs)} kernels ({sum(hits)} already cached)", flush=True)
    if args.moe:
        moe_kernels()
    print(f"# warmed in {time.perf_counter() - t0:.0f} s", flush=True)


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
    main()
