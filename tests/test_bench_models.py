"""benchmarks/bench_models.py --quick: the GPU benchmark's code paths on the CPU (tiny shapes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_models.py"


def test_quick_run_fills_every_row_or_says_why(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "b.json"
    assert mod.main(["--quick", "--only", "host,prefill,decode", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["meta"]["quick"] is True
    by = {(r["workload"], r["variant"].split(" (")[0]): r for r in rows}
    for variant in ("plain", "tilestack_bf16", "tilestack_fp8"):
        assert by[("prefill", variant)]["ms"] > 0
        assert by[("decode_eager", variant)]["ms"] > 0
        assert by[("decode_graph", variant)]["note"].startswith("skipped: CUDA graphs need a GPU")
    # Output agreement is part of each row: bf16 swaps within DeepGEMM's 1e-4 calc_diff budget here.
    assert by[("prefill", "tilestack_bf16")]["calc_diff"] < 1e-4
    assert by[("prefill", "tilestack_fp8")]["calc_diff"] < 1e-2
    assert {r["variant"] for r in rows if r["workload"] == "host"} >= {"cuBLAS F.linear", "deepgemm.bf16_gemm_nt"}
