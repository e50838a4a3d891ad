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


def test_lm_head_and_norm_only_variants_swap_what_they_say(tmp_path):
    # bf16_cublas_head keeps the model's lm_head an nn.Linear (cuBLAS) and swaps the 14 Linears under model.*;
    # bf16_normonly swaps the 5 RMSNorms and no Linear. Their outputs stay within bf16's budget of the plain model.
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "b.json"
    assert mod.main(["--quick", "--only", "prefill", "--variants", "bf16,bf16_cublas_head,bf16_normonly",
                     "--json", str(out)]) == 0
    rows = {r["variant"].split(" (")[0]: r for r in json.loads(out.read_text())["rows"] if r["workload"] == "prefill"}
    assert rows["tilestack_bf16"]["variant"] == "tilestack_bf16 (15 linear)"   # backend cpu: fuse_norm off
    assert rows["tilestack_bf16_cublas_head"]["variant"] == "tilestack_bf16_cublas_head (14 linear)"
    assert rows["tilestack_bf16_normonly"]["variant"] == "tilestack_bf16_normonly (5 norm)"
    for v in ("tilestack_bf16_cublas_head", "tilestack_bf16_normonly"):
        assert rows[v]["ms"] > 0 and rows[v]["calc_diff"] < 1e-4
