"""scripts/run_upstream_tests.py's bookkeeping (no GPU, no DeepGEMM files needed): how a function's log is
counted, how a cut run's partial geo-mean is formed, the seeds, and the line-by-line log with times."""

import importlib.util
import math
import random
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_upstream_tests.py"


def _runner():
    spec = importlib.util.spec_from_file_location("run_upstream_tests", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LINES = [" > Perf (m=1, ...):  10.0 us | 2 TFLOPS | 2000 GB/s | 0.50x cuBLAS",
         " > Perf (m=128, ...):  12.0 us | 9 TFLOPS | 1000 GB/s | 2.00x cuBLAS",
         " > Perf (num_groups=4, ...): 1000000 us |    2 TFLOPS |    1 GB/s"]


def test_summarize_counts_cases_and_reads_the_average():
    r = _runner()
    done = "\n".join(LINES + ["Average speedup over cuBLASLt: 0.987x"])
    assert r.summarize(done, None, False) == {"cases_passed": 3, "failure": None, "geomean_vs_cublas": 0.987}
    cut = r.summarize("\n".join(LINES), "AssertionError: m=4096", False)
    assert cut["cases_passed"] == 3 and cut["failure"].startswith("AssertionError")
    assert cut["geomean_vs_cublas"] is None and cut["geomean_cases"] == 2
    assert math.isclose(cut["geomean_vs_cublas_partial"], 1.0)  # sqrt(0.5 * 2)
    quiet = r.summarize(done, None, True)  # bench_kineto returned 1: no speedup is recorded
    assert quiet == {"cases_passed": 3, "failure": None, "geomean_vs_cublas": None}


def test_seed_is_the_modules_main_block_seed(tmp_path):
    r = _runner()
    for seed in (0, 1, 17):
        f = tmp_path / f"t{seed}.py"
        f.write_text(f"def test():\n    pass\n\n\nif __name__ == '__main__':\n    torch.manual_seed({seed})\n"
                     f"    random.seed({seed})\n")
        mod = type("M", (), {"__file__": str(f)})
        r._seed(mod)
        assert torch.initial_seed() == seed
        assert random.random() == random.Random(seed).random()


def test_tee_writes_lines_and_their_times_as_they_come(tmp_path):
    r = _runner()
    tee = r._Tee(tmp_path / "f.log")
    tee.write("a\nb")
    assert (tmp_path / "f.log").read_text() == "a\nb"  # flushed before the function ends
    tee.write("c\n")
    tee.close()
    assert tee.buf.getvalue() == "a\nbc\n"
    times = [float(t) for t in (tmp_path / "f.times").read_text().split()]
    assert len(times) == 2 and times == sorted(times)
