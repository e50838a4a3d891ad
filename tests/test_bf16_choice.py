"""GemmLinear's bf16 GEMM: deepgemm or cuBLAS per shape, whichever measured faster (tilestack.layers).

CPU: the policy plumbing (TILESTACK_BF16_GEMM, one measurement per shape, none during graph capture) with
the measurement replaced. GPU: both paths against nn.Linear (cuBLAS: bitwise, it is the same call; deepgemm:
calc_diff <= 1e-5, bf16 operands with fp32 accumulation in another order), and under torch.compile a shape
measured for cuBLAS is traced as a plain linear (no tilestack op in the graph).
"""

from __future__ import annotations

import pytest
import torch

from tilestack import layers
from tilestack.layers import GemmLinear, bf16_gemm_choice


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("TILESTACK_BF16_GEMM", raising=False)
    saved = dict(layers.BF16_CHOICES), dict(layers._BF16_TIMES)
    for table in (layers.BF16_CHOICES, layers._BF16_TIMES):
        table.clear()
    yield
    for table, old in zip((layers.BF16_CHOICES, layers._BF16_TIMES), saved):
        table.clear()
        table.update(old)


def test_policy_forces_and_auto_measures_once(monkeypatch):
    calls = []

    def fake(m, n, k, bias, device, weight=None):
        calls.append((m, n, k, bias, device))
        layers.BF16_CHOICES[(layers.m_bucket(m), n, k, bias, device)] = "cublas"
        return "cublas"

    monkeypatch.setattr(layers, "_measure_bf16", fake)
    assert bf16_gemm_choice(64, 128, 256, False, 0) == "cublas"
    assert bf16_gemm_choice(64, 128, 256, False, 0) == "cublas"
    assert bf16_gemm_choice(40, 128, 256, False, 0) == "cublas"      # same M bucket (33..64)
    assert calls == [(64, 128, 256, False, 0)]                      # measured once
    assert bf16_gemm_choice(0, 128, 256, False, 0) == "deepgemm"    # empty: nothing to measure
    monkeypatch.setenv("TILESTACK_BF16_GEMM", "deepgemm")
    assert bf16_gemm_choice(64, 128, 256, False, 0) == "deepgemm"
    monkeypatch.setenv("TILESTACK_BF16_GEMM", "cublas")
    assert bf16_gemm_choice(32, 8, 8, True, 0) == "cublas" and len(calls) == 1


def test_the_measurement_takes_the_layers_own_weight(monkeypatch):
    """Operand bits set the power-limited clocks (H200: cuBLAS's lm_head 6.49 ms on N(0, 1) weights, 4.97 ms on the
    model's), so the choice is timed on the weight of the layer that asks; the traced path finds it by handle."""
    seen = []

    def fake(m, n, k, bias, device, weight=None):
        seen.append(weight)
        return "cublas"

    monkeypatch.setattr(layers, "_measure_bf16", fake)
    gl = GemmLinear(256, 128, bias=False)
    assert layers._traced_bf16_choice(16, 128, 256, False, 0, gl._tilestack_handle) == "cublas"
    assert seen[-1] is gl._parameters["weight"]
    assert layers._traced_bf16_choice(16, 128, 256, False, 0, 0) == "cublas" and seen[-1] is None
    assert bf16_gemm_choice(32, 128, 256, False, 0, gl.weight) == "cublas" and seen[-1] is gl.weight


def test_deepgemm_needs_a_clear_lead(monkeypatch):
    from tilehal import ArgumentError

    assert layers.bf16_pick(0.94, 1.0) == "deepgemm"       # 6 % faster: past the default 5 % margin
    assert layers.bf16_pick(0.97, 1.0) == "cublas"         # 3 % faster: within it
    assert layers.bf16_pick(1.01, 1.0) == "cublas"
    monkeypatch.setenv("TILESTACK_BF16_MARGIN", "0")
    assert layers.bf16_pick(0.99, 1.0) == "deepgemm"
    monkeypatch.setenv("TILESTACK_BF16_MARGIN", "1.5")
    with pytest.raises(ArgumentError, match="TILESTACK_BF16_MARGIN"):
        layers.bf16_pick(0.5, 1.0)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="deepgemm's kernels need an sm_90 GPU")
def test_both_paths_agree_with_nn_linear(monkeypatch):
    import tilehal

    torch.manual_seed(0)
    lin = torch.nn.Linear(2048, 1024, bias=True, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    gl = GemmLinear.from_linear(lin)
    x = torch.randn(3, 40, 2048, device="cuda").bfloat16()
    with torch.no_grad():
        want = lin(x)
        gl(x)
        assert (128, 1024, 2048, True, x.get_device()) in layers.BF16_CHOICES     # measured on first use (M bucket)
        monkeypatch.setenv("TILESTACK_BF16_GEMM", "cublas")
        assert torch.equal(gl(x), want)
        monkeypatch.setenv("TILESTACK_BF16_GEMM", "deepgemm")
        assert tilehal.calc_diff(gl(x), want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="deepgemm's kernels need an sm_90 GPU")
def test_compiled_cublas_shape_is_a_plain_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512, bias=False), torch.nn.Linear(512, 1024, bias=False))
    model = model.to("cuda", torch.bfloat16).requires_grad_(False)
    from tilestack import register_optimizations

    register_optimizations(model, backend="cuda")
    x = torch.randn(256, 1024, device="cuda").bfloat16()
    dev = x.get_device()
    layers.BF16_CHOICES[(256, 512, 1024, False, dev)] = "cublas"
    layers.BF16_CHOICES[(256, 1024, 512, False, dev)] = "deepgemm"
    targets: list[str] = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        want = model(x)
    assert sum("tilestack.gemm_linear" in t for t in targets) == 1      # the deepgemm layer only
    assert any("linear" in t and "tilestack" not in t for t in targets)
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="deepgemm's kernels need an sm_90 GPU")
def test_a_cublas_signature_takes_the_fast_path_from_its_second_call():
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 256, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    gl = GemmLinear.from_linear(lin)
    x = torch.randn(4, 1, 512, device="cuda").bfloat16()
    layers.BF16_CHOICES[(layers.m_bucket(4), 256, 512, False, x.get_device())] = "cublas"
    with torch.no_grad():
        first = gl(x)
        assert gl._routes == {(x.shape, x.dtype, x.device, torch.bfloat16): "cublas"}
        assert torch.equal(gl(x), first) and torch.equal(first, lin(x))


def test_the_cublas_fast_path_of_a_layer_built_without_bias():
    # GemmLinear(bias=False) keeps `bias` as a plain None attribute, not a registered parameter: the routed
    # fast path must not index _parameters["bias"] (KeyError on the H200, 2026-12-02 07:50).
    torch.manual_seed(0)
    gl = GemmLinear(64, 32, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 64).bfloat16()
    gl._routes[(x.shape, x.dtype, x.device, torch.bfloat16)] = "cublas"
    with torch.no_grad():
        assert torch.equal(gl(x), torch.nn.functional.linear(x, gl.weight))
