"""register_optimizations + GemmLinear on the CPU (deepgemm's reference path).

Tolerances (normwise relative error against the original float32 model, computed in float64):
- bf16: each GemmLinear rounds its activations and weight to bf16 (u = 2^-8, RMS ~u/sqrt(3) per
  operand); three layers -> RMS ~ sqrt(6) * u / sqrt(3) = 0.0055 -> tolerance 2x = 0.011.
- fp8 e4m3: u = 2^-4; two fp8 layers (the third is skipped) x two operands -> RMS ~ sqrt(4) * u /
  sqrt(3) = 0.072 -> tolerance 2x = 0.144.
The CUDA selection rules are tested with CUDA availability patched in; the swapped layers still run
on CPU tensors there (deepgemm picks the reference by device). No test here has run on a GPU.
"""

from __future__ import annotations

import logging
import math

import deepgemm
import pytest
import torch
from dataengine import SparseLinear

import tilestack.optimize as opt
from tilestack.layers import GemmLinear
from tilestack.moe import ExpertParallelMoE, ReferenceMoE
from tilestack.optimize import linear_skip_reason, register_optimizations

U_BF16, U_E4M3 = 2.0**-8, 2.0**-4
TOL_BF16 = 2 * math.sqrt(6) * U_BF16 / math.sqrt(3)
TOL_FP8 = 2 * math.sqrt(4) * U_E4M3 / math.sqrt(3)


def mlp(seed: int = 0) -> torch.nn.Sequential:
    """Layer 4 has K = 250: not a multiple of 128 (fp8) nor of 8 (CUDA bf16)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.ReLU(), torch.nn.Linear(384, 250),
                               torch.nn.ReLU(), torch.nn.Linear(250, 64, bias=False))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


@pytest.fixture
def cuda_present(monkeypatch):
    """Pretend a Hopper GPU is present, to test the CUDA selection rules on this machine."""
    monkeypatch.setattr(opt, "_cuda_unavailable_reason", lambda: None)


def test_cpu_bf16_swaps_every_linear_and_stays_close():
    model = mlp()
    x = torch.randn(32, 256)
    with torch.no_grad():
        want = model(x)
        report = register_optimizations(model, backend="cpu")
        got = model(x)
    assert report.names("swapped") == ["0", "2", "4"] and report.skipped == []
    assert all(isinstance(model[i], GemmLinear) and not model[i].fp8 for i in (0, 2, 4))
    assert got.dtype == torch.float32 and rel_err(got, want) < TOL_BF16


def test_cpu_fp8_skips_k_not_multiple_of_128_with_reason(caplog):
    model = mlp()
    x = torch.randn(32, 256)
    with torch.no_grad():
        want = model(x)
        with caplog.at_level(logging.DEBUG, logger="tilestack.optimize"):
            report = register_optimizations(model, backend="cpu", fp8=True)
        got = model(x)
    assert report.names("swapped") == ["0", "2"] and report.names("skipped") == ["4"]
    assert "in_features % 128 == 0" in report.skipped[0].reason and "250" in report.skipped[0].reason
    assert "in_features % 128 == 0" in caplog.text                        # logged at DEBUG too
    assert type(model[4]) is torch.nn.Linear and model[0].fp8
    assert rel_err(got, want) < TOL_FP8
    text = str(report)
    assert "2 swapped, 1 skipped" in text and "skipped 4 (linear)" in text


def test_cuda_rules_skip_misaligned_k(cuda_present):
    model = mlp()
    report = register_optimizations(model, backend="cuda")
    assert report.names("swapped") == ["0", "2"] and report.names("skipped") == ["4"]
    assert "in_features % 8 == 0" in report.skipped[0].reason
    with torch.no_grad():                                   # CPU tensors: deepgemm's reference runs
        assert model(torch.randn(2, 256)).shape == (2, 64)


class _WithHead(torch.nn.Module):
    """A model with an output embedding, as transformers' models expose it (get_output_embeddings)."""

    def __init__(self):
        super().__init__()
        self.body, self.lm_head = torch.nn.Linear(256, 128), torch.nn.Linear(128, 512, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.body(x))


@pytest.mark.parametrize("kwargs, rule", [({}, True), ({"fp8": True}, False), ({"include": ["body", "lm_head"]}, False)],
                         ids=["bf16-default", "fp8", "named"])
def test_cuda_bf16_output_embedding_takes_cublas_from_prefill_sizes(cuda_present, monkeypatch, kwargs, rule):
    model = _WithHead()
    report = register_optimizations(model, backend="cuda", **kwargs)
    assert isinstance(model.body, GemmLinear) and isinstance(model.lm_head, GemmLinear)
    assert model.body.cublas_from_m is None
    assert model.lm_head.cublas_from_m == (opt.HEAD_CUBLAS_MIN_M if rule else None)
    assert ("output embedding" in dict((d.name, d.reason) for d in report.swapped)["lm_head"]) is rule
    head = model.lm_head
    monkeypatch.delenv("TILESTACK_BF16_GEMM", raising=False)
    edge = opt.HEAD_CUBLAS_MIN_M
    assert head._cublas_from_here(edge) is rule and not head._cublas_from_here(edge - 1)
    monkeypatch.setenv("TILESTACK_BF16_GEMM", "deepgemm")  # a forced policy wins (A/B timing)
    assert not head._cublas_from_here(edge)
    cpu_model = _WithHead()
    register_optimizations(cpu_model, backend="cpu")  # the rule is CUDA's measurement
    assert cpu_model.lm_head.cublas_from_m is None


def test_a_model_without_an_output_embedding_is_swapped_as_before(cuda_present):
    class NoHead(_WithHead):
        def get_output_embeddings(self):
            raise NotImplementedError  # what transformers' base class does without one

    model = NoHead()
    register_optimizations(model, backend="cuda")
    assert model.lm_head.cublas_from_m is None and isinstance(model.lm_head, GemmLinear)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_backend_without_cuda_is_refused():
    from tilehal import DeviceError

    with pytest.raises(DeviceError, match="backend='cuda' is not usable here"):
        register_optimizations(mlp(), backend="cuda")


def test_skip_reasons_of_the_selection_rules():
    lin = torch.nn.Linear(250, 8)
    assert linear_skip_reason(lin, "cpu") is None
    assert "% 8" in linear_skip_reason(lin, "cuda")
    assert "% 128" in linear_skip_reason(lin, "cpu", fp8=True)
    assert linear_skip_reason(torch.nn.Linear(256, 8), "cuda", fp8=True) is None
    assert "% 4" in linear_skip_reason(torch.nn.Linear(6, 8), "cpu", sparse_24=True)
    assert "float64" in linear_skip_reason(torch.nn.Linear(8, 8, dtype=torch.float64), "cpu")
    mha = torch.nn.MultiheadAttention(64, 4)
    assert "subclasses nn.Linear" in linear_skip_reason(mha.out_proj, "cpu")


def test_state_dict_round_trip():
    model, fresh = mlp(seed=0), mlp(seed=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    register_optimizations(model, backend="cpu")
    assert list(model.state_dict()) == list(sd)
    fresh_opt = mlp(seed=2)
    register_optimizations(fresh_opt, backend="cpu")
    fresh_opt.load_state_dict(sd)                             # original -> optimized (strict)
    fresh.load_state_dict(model.state_dict())                 # optimized -> original (strict)
    x = torch.randn(4, 256)
    with torch.no_grad():
        assert torch.equal(fresh_opt(x), model(x))            # same weights, same deepgemm path
        assert rel_err(fresh(x), model(x)) < TOL_BF16


def test_weight_update_invalidates_the_cached_operand():
    lin = GemmLinear.from_linear(torch.nn.Linear(128, 16), fp8=True)
    x = torch.randn(3, 128)
    with torch.no_grad():
        y1 = lin(x)
        lin.weight.mul_(2)
        y2 = lin(x)
    assert rel_err(y2 - lin.bias, 2 * (y1 - lin.bias)) < 1e-6


def test_gemm_linear_checks_inputs_and_is_inference_only():
    lin = GemmLinear(64, 8)
    with pytest.raises(RuntimeError, match="inference-only"):
        lin(torch.randn(2, 64))
    with torch.no_grad(), pytest.raises(ValueError, match=r"x: expected a tensor \[\.\.\., 64\]"):
        lin(torch.randn(2, 63))
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
        y = lin(x)
        assert y.shape == (2, 5, 8) and y.dtype == torch.bfloat16
        assert lin(torch.zeros(0, 64)).shape == (0, 8)


def test_include_restricts_the_modules_considered():
    model = mlp()
    report = register_optimizations(model, backend="cpu", include=["2"])
    assert report.names("swapped") == ["2"] and isinstance(model[2], GemmLinear)
    assert type(model[0]) is torch.nn.Linear
    with pytest.raises(TypeError, match="include"):
        register_optimizations(mlp(), backend="cpu", include="2")


def test_sparse_24_uses_dataengine_sparse_linear():
    model = mlp()
    report = register_optimizations(model, backend="cpu", sparse_24=True)
    assert report.names("swapped") == ["0", "2"] and isinstance(model[2], SparseLinear)
    assert report.names("skipped") == ["4"] and "% 4 == 0, got 250" in report.skipped[0].reason
    assert "masked_dense" in report.swapped[0].reason and "CUDA" in report.swapped[0].reason
    x = torch.randn(4, 256)
    with torch.no_grad():
        w = model[0].dense_weight()
        assert int((w.view(384, -1, 4) != 0).sum(-1).max()) <= 2
        assert torch.allclose(model[0](x), torch.nn.functional.linear(x, w, model[0].bias))


def test_option_errors():
    with pytest.raises(ValueError, match="backend"):
        register_optimizations(mlp(), backend="tpu")
    with pytest.raises(ValueError, match="fp8 and sparse_24"):
        register_optimizations(mlp(), backend="cpu", fp8=True, sparse_24=True)


def test_subclass_and_root_are_kept_with_reasons():
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(64, 4))
    report = register_optimizations(model, backend="cpu")
    assert report.names("skipped") == ["0.out_proj"] and "subclasses" in report.skipped[0].reason
    root = torch.nn.Linear(8, 8)
    report = register_optimizations(root, backend="cpu")
    assert report.swapped == [] and "root module" in report.skipped[0].reason


def test_shared_linear_is_replaced_everywhere():
    shared = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    report = register_optimizations(model, backend="cpu")
    assert report.names("swapped") == ["0"]
    assert model[0] is model[2] and isinstance(model[0], GemmLinear)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(128, 128)
        self.moe = ReferenceMoE(128, 128, 4, 2)
        with torch.no_grad():
            for p in self.moe.parameters():      # bf16-representable, as ExpertParallelMoE stores them
                p.copy_(p.bfloat16().float())

    def forward(self, x):
        return self.moe(self.proj(x))


def test_moe_block_is_swapped_only_when_named():
    model = Block()
    report = register_optimizations(model, backend="cpu")
    assert report.names("skipped") == ["moe"] and "include=" in report.skipped[0].reason
    assert "moe.experts.0.gate_proj" in report.names("swapped")    # its Linears are still candidates

    model = Block()
    x = torch.randn(16, 128)
    with torch.no_grad():
        want = model.moe(x)
        report = register_optimizations(model, backend="cpu", include=["moe"])
        got = model.moe(x)
    assert report.names("swapped") == ["moe"] and isinstance(model.moe, ExpertParallelMoE)
    assert type(model.proj) is torch.nn.Linear                      # include limits Linears too
    assert rel_err(got, want) < 0.009                               # the bf16 MoE tolerance of test_moe.py


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="deepgemm's kernels need an sm_90 GPU")
@pytest.mark.parametrize("fp8, tol", [(False, TOL_BF16), (True, TOL_FP8)])
def test_cuda_backend_on_a_hopper_gpu(fp8, tol):
    """deepgemm's sm_90a dense kernels behind GemmLinear (not yet run on a GPU at the time of writing)."""
    model = mlp().cuda()
    x = torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        want = model(x)
        report = register_optimizations(model, backend="cuda", fp8=fp8)
        got = model(x)
    assert report.names("swapped") == ["0", "2"]
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("fp8", [False, True])
def test_gemm_linear_fp4_weights_cpu(fp8):
    """GemmLinear(fp4=True): e2m1 weights with 1x32 power-of-two scales (deepgemm.cast_weights_to_fp4). The
    result is exactly x @ W_fp4^T + b for the dequantized weight W_fp4 (deepgemm.fp4.reference semantics),
    and W_fp4 is the nearest e2m1 grid point of each weight (error <= one scale unit)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 48)
    g = GemmLinear.from_linear(lin, fp4=True, fp8=fp8)
    x = torch.randn(5, 256)
    packed, sf = deepgemm.cast_weights_to_fp4(lin.weight.detach(), gran_k=32)
    w4 = deepgemm.fp4.decode_e2m1(packed) * sf.repeat_interleave(32, dim=1)
    xa = x.to(torch.bfloat16).float()
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(x)
        xa = a8.float() * sfa.repeat_interleave(128, dim=1)
    with torch.no_grad():
        y = g(x)
        want = xa.double() @ w4.double().T + lin.bias.double()
    assert g.fp4 and "fp4=True" in repr(g)
    assert rel_err(y, want.float()) < 1e-6
    assert (w4 - lin.weight.detach()).abs().max() <= sf.max()
    with pytest.raises(ValueError, match="in_features: expected a multiple of 128"):
        GemmLinear(200, 8, fp4=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 128])
def test_gemm_linear_fp4_weights_gpu(m):
    """GemmLinear(fp4=True) on the GPU (bf16 activations: deepgemm's wgmma FP4 kernel) against the float64 value
    of x @ W_fp4^T + b for the dequantized weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(1)
    lin = torch.nn.Linear(2048, 4096).cuda()
    g = GemmLinear.from_linear(lin, fp4=True)
    x = torch.randn(m, 2048, device="cuda")
    packed, sf = deepgemm.cast_weights_to_fp4(lin.weight.detach(), gran_k=32)
    want = deepgemm.fp4.reference(x.to(torch.bfloat16), None, packed, sf, 32) + lin.bias.double()
    with torch.no_grad():
        y = g(x)
    assert deepgemm.testing.calc_diff(y.double(), want) < 1e-5
