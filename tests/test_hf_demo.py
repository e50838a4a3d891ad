"""`tilestack demo`: the long-context job on a small context (the figures' plumbing, not their size)."""

import io
import json

import pytest

pytest.importorskip("transformers")

from tilestack.cli import main  # noqa: E402
from tilestack.demo import run  # noqa: E402


def test_demo_report_on_a_short_context(tmp_path):
    out = io.StringIO()
    path = tmp_path / "demo.json"
    report = run("cpu", context=512, new_tokens=3, top_k=4, json_path=str(path), out=out)
    text = out.getvalue()
    for line in ("prefix hit rate", "time to first token", "decode step", "selection recall", "sparse vs dense"):
        assert line in text, text
    assert json.loads(path.read_text()) == report
    assert report["cached_tokens_b"] == 512  # request B reuses the whole context from the pool
    # Requests B, C and D hit the context (A is cold): 3 x 512 of the 4 x 524 prompt tokens.
    assert report["prefix_hit_rate"] == pytest.approx(3 * 512 / (4 * 524))
    # The control: the sparse path with a budget covering every block gives the dense tokens.
    assert report["wide_sparse_dense_token_agreement"] == 1.0
    assert report["wide_recall_all_heads"] == pytest.approx(1.0)
    assert report["needle_block_selected"] == 1.0  # Quest keeps the planted needle's block at every step
    assert report["recall_needle_head"] > 0.5
    assert 0.0 <= report["sparse_dense_token_agreement"] <= 1.0 and len(report["sparse_tokens"]) == 3


def test_cli_demo_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    assert "--examples" in capsys.readouterr().out
