"""Run DeepGEMM's own test files (tests/test_*.py of github.com/deepseek-ai/DeepGEMM, fetched by you;
nothing of them is in this repository) against deepgemm on a GPU, with only the import alias
`deep_gemm -> deepgemm` (plus its `testing` / `utils` submodules).

    python packages/deepgemm/scripts/run_upstream_tests.py --tests /path/to/DeepGEMM/tests \\
        --run test_bf16.test_gemm,test_fp8_fp4.test_gemm --prewarm --jobs 16 --out results.json

--prewarm first runs the selected test functions with every kernel launch replaced by a recorder
(results are not checked in that pass: calc_diff reports 0, bench_kineto a constant), compiles the
recorded kernels in parallel processes, then runs the tests for real, so compile time is spent once,
in parallel, instead of serially inside the timed loops. Each function's stdout is kept; a function
that raises stops at its first failing case (as the upstream file would). The JSON has, per function,
the number of cases that passed (their "> Perf" lines), the failure if any, and the geo-mean speedup
line the test prints (or, for a function cut before that line, the geo-mean of the "x cuBLAS" ratios of
its cases so far, marked partial). Each function's log is written line by line while it runs, so a run
killed by a time limit keeps every case that finished.

--correctness-only sets DG_USE_NVIDIA_TOOLS=1, DeepGEMM's own switch under which bench_kineto returns 1
without profiling (deepgemm.testing honours it the same way): every correctness assert of the files runs,
no timing does, and no speedup is recorded. Such runs may share the GPU with each other; figures come
only from runs without it, on a GPU nothing else uses.

Seeds: torch/random are seeded once per test module, before its first selected function, with the
value its `__main__` block uses (0 for test_fp8_fp4/test_bf16, 1 for test_layout), so functions of one
file selected in their file order see the random stream the file itself would give them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import importlib
import io
import json
import math
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path

import deepgemm
import torch
from deepgemm import cuda_gemm, gemm_1d1d, gemv, plans, splitk, testing, utils


def install_alias() -> None:
    sys.modules["deep_gemm"] = deepgemm
    sys.modules["deep_gemm.testing"] = testing
    sys.modules["deep_gemm.utils"] = utils


class _Recorder:
    """Stands in for tilehal.Kernel during the recording pass: remembers its key, launches nothing."""

    keys: set = set()

    def __init__(self, key):
        _Recorder.keys.add(key)

    def launch(self, *args, **kwargs) -> None:
        return None


@contextlib.contextmanager
def recording():
    saved = (cuda_gemm._kernel, splitk._kernel, gemm_1d1d._kernel, gemv._kernel, testing.calc_diff,
             testing.bench_kineto)
    cuda_gemm._kernel = splitk._kernel = gemm_1d1d._kernel = gemv._kernel = _Recorder
    testing.calc_diff = lambda x, y: 0.0

    def fake_bench(fn, kernel_names, *args, **kwargs):
        fn()
        return 1e-3 if isinstance(kernel_names, str) else (1e-3,) * len(kernel_names)

    testing.bench_kineto = fake_bench
    try:
        yield
    finally:
        (cuda_gemm._kernel, splitk._kernel, gemm_1d1d._kernel, gemv._kernel, testing.calc_diff,
         testing.bench_kineto) = saved


def build(key) -> bool:
    if isinstance(key, splitk.SplitKKey):
        return splitk.compile_kernels([key]).cache_hit
    if isinstance(key, gemm_1d1d.Key1D1D):
        return gemm_1d1d.compile_kernels([key]).cache_hit
    if isinstance(key, gemv.GemvKey):
        return gemv.compile_kernels([key]).cache_hit
    return cuda_gemm.compile_kernel(key).cache_hit


def _resolve(spec: str):
    mod_name, fn_name = spec.split(".")
    mod = importlib.import_module(mod_name)
    return mod, getattr(mod, fn_name)


_MAIN_SEED = re.compile(r"^if __name__ == .__main__.:.*?torch\.manual_seed\((\d+)\)", re.S | re.M)


def _seed(mod) -> None:
    """Seed as the module's __main__ block does (torch.manual_seed(N); random.seed(N)); 0 if it names none."""
    m = _MAIN_SEED.search(Path(mod.__file__).read_text())
    seed = int(m.group(1)) if m else 0
    torch.manual_seed(seed)
    random.seed(seed)


def prewarm(specs: list[str], jobs: int) -> dict:
    for spec in specs:
        _resolve(spec)  # import the test modules first: their `from deep_gemm.testing import ...` must bind the real helpers
    t0 = time.time()
    _Recorder.keys = set()
    errors = {}
    with recording():
        for spec in specs:
            # The test modules bound the helpers at import: point their names at the fakes too.
            mod, fn = _resolve(spec)
            saved = {n: getattr(mod, n) for n in ("calc_diff", "bench_kineto") if hasattr(mod, n)}
            for n in saved:
                setattr(mod, n, getattr(testing, n))
            _seed(mod)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    fn()
            except Exception as e:  # noqa: BLE001 - keys after this point are compiled in the real pass
                errors[spec] = f"{type(e).__name__}: {e}"[:300]
            finally:
                for n, v in saved.items():
                    setattr(mod, n, v)
    # The dry pass's launches went to recorders: host plans made from them (plans.py) would replay
    # recorders in the real pass. Drop them.
    plans.clear()
    keys = sorted(_Recorder.keys, key=lambda k: k.expression)
    t1 = time.time()
    with cf.ProcessPoolExecutor(jobs) as ex:
        hits = list(ex.map(build, keys))
    for f in (cuda_gemm._kernel, splitk._kernel, gemm_1d1d._kernel, gemv._kernel):
        f.cache_clear()
    return {"kernels": len(keys), "cached": sum(hits), "record_s": t1 - t0, "compile_s": time.time() - t1,
            "record_errors": errors}


PERF = re.compile(r"^ > Perf")
AVG = re.compile(r"Average .*speedup.*?([0-9.]+)x")
RATIO = re.compile(r"\| +([0-9.]+)x cuBLAS\s*$")


class _Tee(io.TextIOBase):
    """stdout of one test function: kept in memory and written through to its log file line by line; the
    `.times` file next to it gets each completed line's seconds since the function started (where the
    time of a slow file goes: one line per case)."""

    def __init__(self, path: Path | None):
        self.buf = io.StringIO()
        self.file = open(path, "w") if path is not None else None  # noqa: SIM115 - closed by close()
        self.times = open(path.with_suffix(".times"), "w") if path is not None else None  # noqa: SIM115
        self.t0 = time.time()

    def write(self, text: str) -> int:
        self.buf.write(text)
        if self.file is not None:
            self.file.write(text)
            self.file.flush()
            for _ in range(text.count("\n")):
                self.times.write(f"{time.time() - self.t0:.3f}\n")
            self.times.flush()
        return len(text)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.times.close()
        super().close()


def summarize(out: str, err: str | None, correctness_only: bool) -> dict:
    """Cases passed ("> Perf" lines), the failure, and the geo-mean speedup vs cuBLAS of one function's log."""
    lines = out.splitlines()
    res = {"cases_passed": sum(1 for line in lines if PERF.match(line)), "failure": err}
    if correctness_only:
        res["geomean_vs_cublas"] = None  # bench_kineto returned the constant 1: no timing in this run
        return res
    avg = [float(m.group(1)) for line in lines if (m := AVG.search(line))]
    ratios = [float(m.group(1)) for line in lines if PERF.match(line) and (m := RATIO.search(line))]
    ratios = [r for r in ratios if r > 0]
    res["geomean_vs_cublas"] = avg[0] if avg else None
    if not avg and ratios:  # cut before the test printed its average: the cases that finished
        res["geomean_vs_cublas_partial"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        res["geomean_cases"] = len(ratios)
    return res


def run(specs: list[str], log_dir: Path | None, save=None, correctness_only: bool = False) -> dict:
    results = {}
    seeded = set()
    for spec in specs:
        mod, fn = _resolve(spec)
        if mod.__name__ not in seeded:
            _seed(mod)
            seeded.add(mod.__name__)
        tee = _Tee(log_dir / f"{spec}.log" if log_dir is not None else None)
        t0 = time.time()
        err = None
        try:
            with contextlib.redirect_stdout(tee):
                fn()
        except Exception as e:  # noqa: BLE001 - recorded: this is the result being measured
            err = "".join(traceback.format_exception_only(type(e), e)).strip()[:2000]
            tee.write("\n" + err + "\n")
        tee.close()
        results[spec] = {**summarize(tee.buf.getvalue(), err, correctness_only), "seconds": time.time() - t0}
        print(f"{spec}: {results[spec]}", flush=True)
        if save is not None:
            save(results)  # after every function: a run cut by a time limit keeps what finished
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", type=Path, required=True, help="DeepGEMM's tests/ folder (generators.py etc.)")
    ap.add_argument("--run", required=True, help="comma-separated module.function list, e.g. test_bf16.test_gemm")
    ap.add_argument("--prewarm", action="store_true")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="JSON results (logs go next to it)")
    ap.add_argument("--prewarm-only", action="store_true",
                    help="record and compile the selected functions' kernels into the disk cache, run nothing")
    ap.add_argument("--correctness-only", action="store_true",
                    help="DG_USE_NVIDIA_TOOLS=1: DeepGEMM's switch that makes bench_kineto skip profiling")
    args = ap.parse_args()
    if args.correctness_only:
        os.environ["DG_USE_NVIDIA_TOOLS"] = "1"
    install_alias()
    sys.path.insert(0, str(args.tests.resolve()))
    specs = [s.strip() for s in args.run.split(",") if s.strip()]
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__,
              "correctness_only": args.correctness_only, "specs": specs}
    if args.prewarm or args.prewarm_only:
        report["prewarm"] = prewarm(specs, args.jobs)
        print(f"prewarm: {report['prewarm']}", flush=True)
        if args.prewarm_only:
            return
    log_dir = args.out.parent if args.out else None

    def save(results: dict) -> None:
        if args.out:
            args.out.write_text(json.dumps({**report, "results": results}, indent=1))

    save({})
    report["results"] = run(specs, log_dir, save, args.correctness_only)


if __name__ == "__main__":
    main()
