"""GemmSwiGLU: transformers' dense gated MLPs fused by register_optimizations (backend="cuda"); its GPU test is
tests/test_fusions_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch
from tilehal import calc_diff

import tilestack.optimize as opt
from tilestack import register_optimizations
from tilestack.layers import GemmLinear, GemmSwiGLU, swiglu_skip_reason


@pytest.fixture
def cuda_present(monkeypatch):
    monkeypatch.setattr(opt, "_cuda_unavailable_reason", lambda: None)


def test_llama_mlps_are_fused_and_keep_their_parameters(cuda_present, make_llama):
    model = make_llama()
    keys = set(model.state_dict())
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        want = model(ids).logits
        rep = register_optimizations(model, backend="cuda", fuse_mlp=True)
        got = model(ids).logits  # CPU tensors: GemmSwiGLU runs its three GemmLinears (deepgemm's reference)
    mlps = [d for d in rep.swapped if d.kind == "mlp"]
    assert [d.name for d in mlps] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(d.replacement == "GemmSwiGLU" for d in mlps)
    assert not any(".mlp." in d.name for d in rep.swapped)  # the MLPs' Linears are the fused module's now
    m = model.model.layers[0].mlp
    assert isinstance(m, GemmSwiGLU) and isinstance(m.down_proj, GemmLinear)
    assert set(model.state_dict()) == keys
    # gate's and up's weights are views of one [2F, H] tensor: no copy kept
    g, u = m.gate_proj.weight, m.up_proj.weight
    assert u.data_ptr() == g.data_ptr() + g.numel() * g.element_size()
    assert calc_diff(got, want) < 1e-4  # bf16 operands of an fp32 model (as GemmLinear alone)


def test_skip_reasons(make_llama):
    mlp = make_llama().model.layers[0].mlp
    assert swiglu_skip_reason(mlp) is None
    bad = copy.deepcopy(mlp)
    bad.act_fn = torch.nn.GELU()
    assert "not SiLU" in swiglu_skip_reason(bad)
    assert "not one of" in swiglu_skip_reason(torch.nn.Linear(4, 4))


def test_replaced_weight_is_concatenated_again(cuda_present, make_llama):
    model = make_llama()
    register_optimizations(model, backend="cuda", fuse_mlp=True)
    m = model.model.layers[0].mlp
    new = torch.randn_like(m.up_proj.weight)
    m.up_proj.weight = torch.nn.Parameter(new)
    op = m._gate_up_operand()
    assert torch.equal(op[m.gate_proj.out_features:], new.bfloat16())  # (an fp32 model: the bf16 operand)


def test_fuse_mlp_off_swaps_linears_one_by_one(cuda_present, make_llama):
    model = make_llama()
    rep = register_optimizations(model, backend="cuda")  # the default: off
    assert not any(d.kind == "mlp" for d in rep.swapped)
    assert "model.layers.0.mlp.gate_proj" in rep.names("swapped")


def test_fused_or_three_gemms_by_measurement(cuda_present, make_llama, monkeypatch):
    import tilehal

    from tilestack import layers

    model = make_llama()
    register_optimizations(model, backend="cuda", fuse_mlp=True)
    mlp = model.model.layers[0].mlp
    x2 = torch.randn(64, 256)
    times = {"fused": 2e-3, "unfused": 1e-3}
    timed = []

    def fake_bench(fn, **kw):
        path = "fused" if "_fused_path" in fn.__code__.co_names else "unfused"
        timed.append(path)
        return tilehal.BenchResult(median_s=times[path], min_s=0, max_s=0, p20_s=0, p80_s=0, iters=1, timer="host")

    monkeypatch.setattr(tilehal, "bench", fake_bench)
    monkeypatch.setattr(layers, "SWIGLU_CHOICES", {})
    monkeypatch.setattr(layers, "_SWIGLU_TIMES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert mlp._path(x2) == "unfused" and timed == ["fused", "unfused"]
    assert mlp._path(x2[:40]) == "unfused" and len(timed) == 2           # same M bucket: measured once
    times["fused"] = 0.5e-3
    assert mlp._path(torch.randn(4096, 256)) == "fused"                  # another bucket, measured again
    assert layers.swiglu_choice_table()[0]["choice"] == "unfused"
    monkeypatch.setenv("TILESTACK_SWIGLU", "fused")
    assert mlp._path(x2) == "fused" and len(timed) == 4
    # Both paths are methods of the module, not shadowed by its attributes (the [2F, H] weight is `_fused`: a
    # method of that name failed on the H200 with "'Tensor' object is not callable").
    assert callable(mlp._fused_path) and callable(mlp._unfused) and isinstance(mlp._fused, torch.Tensor)


def test_both_paths_run_and_agree_on_cpu_tensors(cuda_present, make_llama, monkeypatch):
    """The two paths _path chooses between, called directly (the fused one on deepgemm's CPU reference)."""
    monkeypatch.setenv("TILESTACK_BF16_GEMM", "deepgemm")   # no GPU to measure the gate|up GEMM's choice on
    model = make_llama(torch.bfloat16)
    register_optimizations(model, backend="cuda", fuse_mlp=True)
    mlp = model.model.layers[0].mlp
    x2 = torch.randn(5, 256).bfloat16()
    with torch.no_grad():
        fused, three = mlp._fused_path(x2), mlp._unfused(x2)
    assert fused.shape == three.shape == (5, 256) and calc_diff(fused.float(), three.float()) < 1e-3

