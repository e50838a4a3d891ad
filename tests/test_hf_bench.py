"""bench_hf_decode.py runs end to end on tiny shapes (the H200 run is the lead's; nothing asserts a time)."""

import json

import pytest

pytest.importorskip("transformers")

from tilestack.hf import bench_hf_decode  # noqa: E402


def test_bench_quick_on_cpu_fills_every_column(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench_hf_decode.main(["--device", "cpu", "--quick", "--batch", "2", "--iters", "1",
                                 "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    for L in ("64", "160"):
        res = report["decode_step"][L]
        for col in ("hf_dynamic_eager", "kv_dense_eager", "kv_sparse_eager"):
            assert res[col]["ms"] > 0, (L, col, res[col])
        for col in ("hf_static_graph", "kv_dense_graph", "kv_sparse_graph"):
            assert res[col] == {"skipped": "CUDA graphs need a CUDA device"}
        # The caches hold the same random K/V: kvpool's first decode step gives transformers' logits.
        assert res["kv_dense_vs_hf_max_abs_logit_diff"] < 1e-4
    ttft = report["ttft"]
    assert ttft["cached_tokens"] == 128 and ttft["kv_cold_ms"] > 0 and ttft["hf_cold_ms"] > 0
    assert "decode step, ms" in capsys.readouterr().out


def test_optimize_adds_the_opt_columns_on_a_copy(tmp_path):
    path = tmp_path / "bench.json"
    assert bench_hf_decode.main(["--device", "cpu", "--quick", "--batch", "2", "--iters", "1", "--ttft-context", "0",
                                 "--optimize", "fuse_qkv", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["optimize"]["flags"] == ["fuse_qkv"] and report["optimize"]["swapped"] > 0
    res = report["decode_step"]["64"]
    for col in ("kv_dense_eager", "opt_kv_dense_eager", "opt_kv_sparse_eager"):
        assert res[col]["ms"] > 0, (col, res[col])
    # the optimized copy (GemmLinear: bf16 operands on deepgemm's CPU reference) gives transformers' logits within
    # bf16 operand rounding (2^-8 relative, a few roundings deep)
    assert res["opt_kv_dense_vs_hf_max_abs_logit_diff"] < 2e-2 * res["logit_scale_max_abs"]
    assert res["opt_kv_sparse_graph"] == {"skipped": "CUDA graphs need a CUDA device"}


def test_optimize_refuses_unknown_switches(capsys):
    assert bench_hf_decode.main(["--device", "cpu", "--quick", "--optimize", "fuse_everything"]) == 2
    assert "unknown switches ['fuse_everything']" in capsys.readouterr().out
