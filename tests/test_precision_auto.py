"""register_optimizations(precision="auto"): fp8 or bf16 per Linear from measured error and speed."""

from __future__ import annotations

import pytest
import tilehal
import torch

from tilestack import GemmLinear, register_optimizations


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(256, 256)
        self.b = torch.nn.Linear(256, 64)
        self.c = torch.nn.Linear(64, 32)       # in_features 64: no fp8 (128-wide scale blocks)
        self.unused = torch.nn.Linear(256, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _fake_bench(fp8_ms: float, bf16_ms: float):
    def bench(fn, **kw):
        # The timed callable is a bound lambda over the module: read its precision from the default arg.
        mod = fn.__defaults__[0]
        t = (fp8_ms if mod.fp8 else bf16_ms) / 1e3
        return tilehal.BenchResult(t, t, t, t, t, 1, "fake")
    return bench


def _reasons(report):
    return {d.name: d.reason for d in report.swapped}


def test_auto_picks_fp8_where_within_budget_and_faster(monkeypatch):
    monkeypatch.setattr(tilehal, "bench", _fake_bench(fp8_ms=1.0, bf16_ms=2.0))
    model, x = Net(), torch.randn(32, 256)
    report = register_optimizations(model, backend="cpu", precision="auto", calibration=(x,), error_budget=0.2)
    r = _reasons(report)
    assert model.a.fp8 and model.b.fp8 and r["a"].startswith("fp8 e4m3: within budget and faster")
    assert not model.c.fp8 and "fp8 not possible: fp8 needs in_features % 128 == 0" in r["c"]
    assert not model.unused.fp8 and "not reached by the calibration forward" in r["unused"]
    # The reason carries the measured errors: fp8's is the real one of this layer on this input.
    err = float(r["a"].split("error fp8 ")[1].split(" ")[0])
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, model.a.weight, model.a.bias)
        assert abs(err - float((model.a(x) - ref).norm() / ref.norm())) < 1e-3
    assert "precision='auto'" in str(report)


def test_auto_keeps_bf16_when_fp8_is_slower_or_over_budget(monkeypatch):
    monkeypatch.setattr(tilehal, "bench", _fake_bench(fp8_ms=3.0, bf16_ms=2.0))
    model, x = Net(), torch.randn(32, 256)
    r = _reasons(register_optimizations(model, backend="cpu", precision="auto", calibration=(x,), error_budget=0.2))
    assert not model.a.fp8 and r["a"].startswith("bf16: fp8 not faster here")
    monkeypatch.setattr(tilehal, "bench", _fake_bench(fp8_ms=1.0, bf16_ms=2.0))
    model = Net()
    r = _reasons(register_optimizations(model, backend="cpu", precision="auto", calibration=(x,), error_budget=1e-4))
    assert not model.a.fp8 and r["a"].startswith("bf16: fp8 over the error budget")
    assert all(isinstance(m, GemmLinear) for m in (model.a, model.b, model.c))


def test_auto_with_the_real_timer_runs_and_explains():
    model, x = Net(), torch.randn(16, 256)
    report = register_optimizations(model, backend="cpu", precision="auto", calibration=(x,), timing_iters=2)
    for d in report.swapped:
        assert d.reason.startswith(("fp8 e4m3:", "bf16:", "bf16 (")), d.reason


def test_auto_argument_errors():
    with pytest.raises(TypeError, match="calibration: expected the tuple"):
        register_optimizations(Net(), backend="cpu", precision="auto")
    with pytest.raises(ValueError, match="precision: expected"):
        register_optimizations(Net(), backend="cpu", precision="int4")
    with pytest.raises(ValueError, match="at most one"):
        register_optimizations(Net(), backend="cpu", precision="auto", fp8=True, calibration=(torch.zeros(1, 256),))
    with pytest.raises(ValueError, match="error_budget"):
        register_optimizations(Net(), backend="cpu", precision="auto", calibration=(torch.zeros(1, 256),),
                               error_budget=0)
