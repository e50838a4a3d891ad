"""Compile (NVRTC, no GPU) the kernels the umbrella GPU tests of FusedRMSNorm / GemmSwiGLU ask for into the
tilehal cache, so a device round spends no time compiling them (run with the device's NVRTC, from the path
the device runs the tree at: the cache key holds both). bench_models.py --precompile --warm-only does the same
for the benchmark's Llama rows. scripts/gpu/warm.sh NAME CARRIED_TREE python3 scripts/gpu/hf17_warm_tests.py runs it
that way (the job then sources scripts/gpu/job.sh NAME)."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_models  # noqa: E402

# tests/test_swiglu.py's (and test_projection_group.py's, test_norm.py's) GPU model: hidden 1024, ffn 2816, 4 heads
# of 256 (2 kv), vocab 512; 4 x 64 tokens and
# the 3 x 5 MLP input.
SWIGLU_NK = [(1024, 1024), (512, 1024), (2816, 1024), (1024, 2816), (5632, 1024), (2048, 1024)]  # + fused q|k|v


def jobs() -> list[tuple]:
    return [(kind, m, n, k) for kind in ("bf16", "fp8") for m in (256, 15) for n, k in SWIGLU_NK]


def _casts_and_norms() -> None:
    from deepgemm import cuda_cast

    from tilestack import norm

    for e in cuda_cast.all_expressions():
        cuda_cast.compile_module((e,))
    for e in norm.all_expressions():
        norm.compile_module((e,))


def main() -> int:
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(bench_models._compile_one, j) for j in jobs()] + [pool.submit(_casts_and_norms)]
        for f in futs:
            f.result()
    print(f"warmed {len(jobs())} GEMM kernels, the casts and the norms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
