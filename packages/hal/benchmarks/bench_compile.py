"""Cold and cached compile times of tilehal's C and CUDA JITs for a small kernel.

Targets (issue 2): C cold <= 1 s, CUDA cold <= 2 s, cached <= 5 ms.
Usage: python packages/hal/benchmarks/bench_compile.py [--record | --out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
import uuid

import tilehal

C_SRC = """
void scale(const float *x, float *y, float a, long n) {
    for (long i = 0; i < n; i++) y[i] = a * x[i];
}
"""
C_DEF = "void scale(const float *x, float *y, float a, long n);"
CUDA_SRC = r"""
#include <tilehal/tilehal.cuh>
extern "C" __global__ void row_max(const __nv_bfloat16* x, float* out, int cols) {
  float m = -INFINITY;
  for (int j = threadIdx.x; j < cols; j += 32) m = fmaxf(m, tilehal::to_float(x[blockIdx.x * cols + j]));
  m = tilehal::warp_max(m);
  if (threadIdx.x == 0) out[blockIdx.x] = m;
}
"""


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(kind: str, reps: int) -> dict:
    cold, cached = [], []
    for _ in range(reps):
        salt = f"\n/* {uuid.uuid4().hex} */\n"  # a new source each time: a real cold compile
        if kind == "c":
            def compile_once(s=salt):
                return tilehal.compile_c(C_SRC + s, C_DEF, name="bench")
        else:
            def compile_once(s=salt):
                return tilehal.compile_cuda(CUDA_SRC + s, name="bench")
        cold.append(_time(compile_once))
        cached.extend(_time(compile_once) for _ in range(5))
    return {"cold_s": statistics.median(cold), "cached_s": statistics.median(cached), "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="write docs/benchmarks/hal_compile.json (default: print only)")
    ap.add_argument("--out", default=None, help="write the JSON to this file instead")
    args = ap.parse_args()
    os.environ["TILESTACK_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilestack-bench-")
    rows = {"c": measure("c", args.reps)}
    versions = tilehal.compiler_versions()
    if any(versions.values()):
        rows["cuda"] = measure("cuda", args.reps)
    targets = {"c": 1.0, "cuda": 2.0}
    print(f"{'jit':<6}{'cold (s)':>10}{'target':>8}{'cached (ms)':>13}{'target':>8}")
    for k, r in rows.items():
        print(f"{k:<6}{r['cold_s']:>10.3f}{targets[k]:>8.1f}{r['cached_s'] * 1e3:>13.2f}{5.0:>8.1f}")
    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.node()} {tilehal.cpu().name}, {tilehal.cpu().cores} cores",
        "compilers": {"cc": tilehal.c_compiler_version(tilehal.c_compiler() or "cc"), **versions},
        "results": rows,
        "targets": {"c_cold_s": 1.0, "cuda_cold_s": 2.0, "cached_s": 0.005},
    }
    if args.record and not args.out:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "docs", "benchmarks",
                                "hal_compile.json")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
