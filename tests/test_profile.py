"""tilestack.profile / `tilestack profile` on a tiny transformers Llama on the CPU."""

from __future__ import annotations

import pytest
import torch
from tilehal.testing import without_modules

transformers = pytest.importorskip("transformers")

import tilestack  # noqa: E402
from tilestack.cli import main as cli_main  # noqa: E402


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_profile_attributes_time_and_times_every_swap(tmp_path):
    model = _llama()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rep = tilestack.profile(model, (ids,), out=tmp_path / "r.md", iters=2)
    # The model itself is untouched (the swaps ran on a copy).
    assert all(type(m) is not tilestack.GemmLinear for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    names = {m.name: m for m in rep.modules}
    assert names["<root>"].calls == 1 and names["model.layers.0.mlp.down_proj"].type == "Linear"
    assert names["<root>"].total_ms >= names["model.layers.0.mlp"].total_ms > 0
    # The GEMMs by shape: tokens 16; gate/up 64 -> 128, down 128 -> 64, lm_head 64 -> 64, ...
    shapes = {(g.m, g.n, g.k): g for g in rep.gemms}
    assert shapes[(16, 128, 64)].calls == 2 and shapes[(16, 64, 128)].calls == 1
    assert abs(sum(g.share for g in rep.gemms) - 1) < 1e-6
    # Every Linear swapped and timed, with its output difference (bf16 operands).
    assert len(rep.swaps) == 8 and all(s.before_ms > 0 and s.after_ms > 0 for s in rep.swaps)
    assert all(s.max_rel_diff < 0.011 for s in rep.swaps)
    text = (tmp_path / "r.md").read_text()
    assert "## GEMM shapes" in text and "| `model.layers.0.mlp.down_proj` | linear -> GemmLinear |" in text
    assert rep.plot and (tmp_path / "r.png").stat().st_size > 1000 and "![profile](r.png)" in text


def test_profile_without_matplotlib_says_so(tmp_path):
    model = _llama()
    with without_modules("matplotlib"):
        rep = tilestack.profile(model, torch.zeros(1, 4, dtype=torch.long), out=tmp_path / "r.md", iters=1,
                                optimize=False)
    assert rep.plot is None and "matplotlib is not installed" in (tmp_path / "r.md").read_text()
    assert not (tmp_path / "r.png").exists() and rep.swaps == []


def test_profile_checks_its_arguments():
    with pytest.raises(TypeError, match="inputs: expected the tuple"):
        tilestack.profile(_llama(), [torch.zeros(1, 4, dtype=torch.long)])
    with pytest.raises(ValueError, match="iters"):
        tilestack.profile(_llama(), (torch.zeros(1, 4, dtype=torch.long),), iters=0)


def test_cli_profile_writes_the_report(tmp_path, capsys):
    out = tmp_path / "p.md"
    assert cli_main(["profile", "--model", "llama-tiny", "--batch", "1", "--seq", "8", "--iters", "1",
                     "--out", str(out)]) == 0
    assert "ms per forward" in capsys.readouterr().out and "## Modules" in out.read_text()
