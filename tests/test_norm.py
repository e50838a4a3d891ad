"""FusedRMSNorm: transformers' RMSNorm formula in one CUDA kernel (tilestack.norm).

CPU: the kernel compiles for sm_90a (NVRTC, no GPU needed); every class in RMSNORM_CLASSES computes exactly
rms_norm_reference (bitwise, so the one formula the kernel reproduces is theirs); the swap keeps the weight.
GPU: against the transformers module on the same bf16 input. The kernel sums the squares in another order
than torch's mean, so a row's fp32 scale may differ in its last bits and an output element by a bf16 ulp or two
(2^-7 relative each) where the product lies near a rounding boundary: the test allows one ulp on < 1 % of the
elements and nothing more.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tilestack.norm import (
    MAX_HIDDEN,
    RMSNORM_CLASSES,
    FusedRMSNorm,
    compile_module,
    rms_norm,
    rms_norm_reference,
    rmsnorm_skip_reason,
)

transformers = pytest.importorskip("transformers")

_MODULES = {"LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2", "Qwen3RMSNorm": "qwen3",
            "MixtralRMSNorm": "mixtral", "Qwen2MoeRMSNorm": "qwen2_moe", "Qwen3MoeRMSNorm": "qwen3_moe",
            "DeepseekV3RMSNorm": "deepseek_v3"}


def _hf_norm(cls_name: str, h: int, dtype=torch.float32, eps: float = 1e-5):
    mod = importlib.import_module(f"transformers.models.{_MODULES[cls_name]}.modeling_{_MODULES[cls_name]}")
    norm = getattr(mod, cls_name)(h, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=torch.Generator().manual_seed(2)).to(dtype))
    return norm


def test_kernel_compiles_for_sm90a():
    assert compile_module() is not None


def test_every_listed_class_is_known():
    assert set(_MODULES) == set(RMSNORM_CLASSES)


@pytest.mark.parametrize("cls_name", sorted(RMSNORM_CLASSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_class_computes_the_reproduced_formula(cls_name, dtype):
    norm = _hf_norm(cls_name, 96, dtype)
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, norm.variance_epsilon))
        fused = FusedRMSNorm(norm)
        assert fused.weight is norm.weight
        assert torch.equal(fused(x), norm(x))        # CPU input: the torch formula, bitwise


def test_skip_reasons():
    assert rmsnorm_skip_reason(torch.nn.LayerNorm(8)) is not None
    assert rmsnorm_skip_reason(_hf_norm("LlamaRMSNorm", 8)) is None


def test_register_optimizations_swaps_the_norms_of_a_llama():
    from tilestack import register_optimizations

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        rep = register_optimizations(model, backend="cpu", fuse_norm=True, include=["*norm*"])
        got = model(ids).logits
    assert sorted(d.name for d in rep.swapped if d.kind == "norm") == [
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
    assert isinstance(model.model.norm, FusedRMSNorm)
    assert torch.equal(got, want)                    # CPU: the same torch ops


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_launch_arguments_follow_the_kernel_signature(monkeypatch):
    """The host side of _rms_norm_cuda without a GPU: the kernel stubbed, its launches recorded (the argument order
    of rms_norm_bf16, the fp8 scale layout, one plan per signature, the pre-cast kept for the next GEMM)."""
    import tilestack.norm as nm

    launches, built = [], []

    class Stub:
        def launch(self, grid, block, args):
            launches.append((grid, block, args))

    monkeypatch.setattr(nm, "_kernel", lambda expr: built.append(expr) or Stub())
    monkeypatch.setattr(nm, "_PLANS", {})
    x, w = torch.randn(3, 5, 256).bfloat16(), torch.ones(256).bfloat16()
    y = nm._rms_norm_cuda(x, w, 1e-5)
    y8, (q, sf) = nm._rms_norm_cuda(x, w, 1e-5, fp8=True)
    nm._rms_norm_cuda(x, w, 1e-5)
    assert built == [nm.kernel_expression(1, True, False), nm.kernel_expression(1, True, True)]   # plans reused
    (g, b, plain), (_, _, cast), _ = launches
    assert (g, b) == (15, nm.THREADS) and y.shape == y8.shape == x.shape
    assert plain[:5] == (plain[0], w, plain[2], 15, 256) and plain[8] is None and plain[9] is None
    assert [a.obj.value for a in plain[5:8]] == [256, 256, pytest.approx(1e-5)]
    assert cast[8] is q and cast[9] is sf and [a.obj.value for a in cast[10:]] == [1, sf.stride(1)]
    assert q.shape == (15, 256) and q.dtype == torch.float8_e4m3fn and sf.shape == (15, 2) and sf.stride(0) == 1
    assert nm.precast_fp8(y8.view(-1, 256))[0] is q


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the kernel is built for sm_90a")
@pytest.mark.parametrize("shape, h_view", [((4096, 4096), None), ((2, 37, 100), None), ((3, 5000), 4096),
                                           ((64, 1, MAX_HIDDEN), None), ((1, 128), None), ((0, 64), None)])
def test_kernel_matches_the_transformers_module(shape, h_view):
    norm = _hf_norm("LlamaRMSNorm", h_view or shape[-1], torch.bfloat16, eps=1e-6).cuda()
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 3).bfloat16().cuda()
    if h_view is not None:
        x = x[..., :h_view]                           # rows strided wider than H
    with torch.no_grad():
        want = norm(x)
        got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel() == 0:
        return
    # A one-ulp change of the normalized value moves the product by ~1 ulp, and its rounding by another.
    ulp = (want.float().abs() * 2.0**-6).clamp_min(2.0**-126)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= ulp).all())
    assert float((diff > 0).float().mean()) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the kernel is built for sm_90a")
def test_module_fast_path_gives_the_checked_result():
    norm = _hf_norm("LlamaRMSNorm", 4096, torch.bfloat16).cuda()
    fused = FusedRMSNorm(norm)
    x = torch.randn(64, 1, 4096, device="cuda").bfloat16()
    with torch.no_grad():
        first = fused(x)
        assert fused._ok is not None
        assert torch.equal(fused(x), first) and torch.equal(first, rms_norm(x, norm.weight, norm.variance_epsilon))
        y = torch.randn(3, 4096, device="cuda").bfloat16()                       # another signature: checked
        assert torch.equal(fused(y), rms_norm(y, norm.weight, norm.variance_epsilon))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the kernel is built for sm_90a")
@pytest.mark.parametrize("rows, h", [(4096, 4096), (64, 4096), (5, 384), (1, 128)])
def test_fp8_output_is_the_cast_of_the_output(rows, h):
    """rms_norm_fp8: the bf16 output, and bit for bit what deepgemm's per-token cast makes of it."""
    import deepgemm

    from tilestack.norm import precast_fp8, rms_norm_fp8

    norm = _hf_norm("LlamaRMSNorm", h, torch.bfloat16, eps=1e-5).cuda()
    x = (torch.randn(rows, h, generator=torch.Generator().manual_seed(7)) * 3).bfloat16().cuda()
    x[0, :3] = torch.tensor([0.0, 1e4, -1e4]).bfloat16()                     # a wide block: its scale moves
    with torch.no_grad():
        y, (q, sf) = rms_norm_fp8(x, norm.weight, norm.variance_epsilon)
        assert torch.equal(y, rms_norm(x, norm.weight, norm.variance_epsilon))
        q_ref, sf_ref = deepgemm.per_token_cast_to_fp8(y, tma_aligned_sf=True)
    assert q.shape == q_ref.shape and sf.shape == sf_ref.shape and sf.stride() == sf_ref.stride()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)
    got = precast_fp8(y.view(-1, h))
    assert got is not None and got[0] is q                                   # the next fp8 GEMM's operand
    y.add_(0)                                                                # written since: not reused
    assert precast_fp8(y) is None
