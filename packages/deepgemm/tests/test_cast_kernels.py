"""The fused fp8 casts (kernels/fp8_cast.cuh): every instantiation compiles (NVRTC, CI), and on a GPU
the kernels return what the torch reference returns (run on CPU copies), bit for bit."""

from __future__ import annotations

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import cuda_cast
from deepgemm.utils import is_mn_major_tma_aligned

nvrtc = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")


@nvrtc
def test_every_cast_instantiation_compiles():
    mod = cuda_cast.compile_module()
    assert set(mod.lowered_names) == set(cuda_cast.all_expressions())
    assert len(mod.cubin) > 0


def test_tma_aligned_sf_on_the_cpu_path():
    x = torch.randn(37, 300)
    q, sf = deepgemm.per_token_cast_to_fp8(x, tma_aligned_sf=True)
    q0, sf0 = deepgemm.per_token_cast_to_fp8(x)
    assert is_mn_major_tma_aligned(sf) and torch.equal(sf, sf0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    with pytest.raises(tilehal.ShapeError, match="tma_aligned_sf"):
        deepgemm.per_token_cast_to_fp8(torch.randn(2, 4, 128), tma_aligned_sf=True)


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu().float(), b.cpu().float()
    nan = a.isnan()
    same = torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])  # (no tensor reprs on failure)
    assert same, f"fp8 values differ at {int((a != b).logical_and(~nan).sum())} of {a.numel()} positions"


def _same_sf(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    nan = a.isnan()
    same = torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    assert same, f"scales differ at {int((a != b).logical_and(~nan).sum())} of {a.numel()} positions"


def _special(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[:: max(1, x.numel() // 7)] = 0
    if x.shape[-1] > 3:
        x[..., 0, :] = 0  # an all-zero row: amax clamps to 1e-4
        x[..., -1, 3] = float("nan")  # non-finite values: no part in the amax, NaN kept, +-Inf saturated
        x[..., -1, 1] = float("inf")
        x[..., -1, 2] = -float("inf")
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (7, 200), (128, 7168), (4096, 4096), (3, 5, 384), (33, 130)])
@pytest.mark.parametrize("gran_k", [128, 64, 32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_token_matches_the_torch_ops(dtype, shape, gran_k, ue8m0):
    g = torch.Generator().manual_seed(hash((shape, gran_k)) % 2**31)
    x = _special(torch.randn(shape, generator=g) * 3).to(dtype)
    q, sf = deepgemm.per_token_cast_to_fp8(x.cuda(), use_ue8m0=ue8m0, gran_k=gran_k)
    q0, sf0 = deepgemm.per_token_cast_to_fp8(x, use_ue8m0=ue8m0, gran_k=gran_k)
    _same_fp8(q, q0)
    _same_sf(sf, sf0)
    x3 = x * 3  # the second call of a signature runs its cached plan
    q3, sf3 = deepgemm.per_token_cast_to_fp8(x3.cuda(), use_ue8m0=ue8m0, gran_k=gran_k)
    q30, sf30 = deepgemm.per_token_cast_to_fp8(x3, use_ue8m0=ue8m0, gran_k=gran_k)
    _same_fp8(q3, q30)
    _same_sf(sf3, sf30)
    if len(shape) == 2:
        q2, sf2 = deepgemm.per_token_cast_to_fp8(x.cuda(), use_ue8m0=ue8m0, gran_k=gran_k, tma_aligned_sf=True)
        assert is_mn_major_tma_aligned(sf2)
        _same_sf(sf2, sf0)
        _same_fp8(q2, q0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(128, 128), (7168, 2048), (300, 200), (2, 256, 384), (1, 7)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_block_matches_the_torch_ops(dtype, shape, ue8m0):
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = _special(torch.randn(shape, generator=g)).to(dtype)
    q, sf = deepgemm.per_block_cast_to_fp8(x.cuda(), use_ue8m0=ue8m0)
    q0, sf0 = deepgemm.per_block_cast_to_fp8(x, use_ue8m0=ue8m0)
    _same_fp8(q, q0)
    _same_sf(sf, sf0)


@pytest.mark.gpu
def test_strided_rows_and_odd_alignment():
    base = torch.randn(64, 1000, device="cuda").bfloat16()
    x = base[:, 3:3 + 520]  # rows 2000 bytes apart, start 6 bytes off: the scalar-load instantiation
    q, sf = deepgemm.per_token_cast_to_fp8(x)
    q0, sf0 = deepgemm.per_token_cast_to_fp8(x.cpu())
    _same_fp8(q, q0)
    _same_sf(sf, sf0)
    qb, sfb = deepgemm.per_block_cast_to_fp8(x)
    qb0, sfb0 = deepgemm.per_block_cast_to_fp8(x.cpu())
    _same_fp8(qb, qb0)
    _same_sf(sfb, sfb0)


def test_silu_mul_on_the_cpu_matches_its_definition():
    x = torch.randn(9, 512)
    g, u = x[:, :256], x[:, 256:]
    ref = torch.nn.functional.silu(g) * u
    assert torch.equal(deepgemm.silu_mul(x), ref.bfloat16())
    q, sf = deepgemm.silu_mul_cast_to_fp8(x)
    q0, sf0 = deepgemm.per_token_cast_to_fp8(ref)
    assert torch.equal(sf, sf0) and torch.equal(q.float(), q0.float())
    with pytest.raises(tilehal.ShapeError, match="gate"):
        deepgemm.silu_mul(torch.randn(4, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 256), (8192, 28672), (77, 2 * 200), (5, 2 * 130)])
def test_silu_mul_matches_the_torch_ops(shape):
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=g) * 4).bfloat16().cuda()
    f = shape[1] // 2
    act = torch.nn.functional.silu(x[:, :f].float()) * x[:, f:].float()  # torch on the same GPU
    y = deepgemm.silu_mul(x)
    torch.testing.assert_close(y.float(), act.bfloat16().float(), rtol=2**-7, atol=1e-30)
    assert (y != act.bfloat16()).float().mean().item() < 1e-3  # an exp ulp apart at most, rarely
    q, sf = deepgemm.silu_mul_cast_to_fp8(x, tma_aligned_sf=True)
    assert is_mn_major_tma_aligned(sf)
    q0, sf0 = deepgemm.per_token_cast_to_fp8(act)
    torch.testing.assert_close(sf, sf0, rtol=1e-6, atol=0)
    deq = q.float() * sf.repeat_interleave(128, dim=1)[:, :f]
    deq0 = q0.float() * sf0.repeat_interleave(128, dim=1)[:, :f]
    assert tilehal.calc_diff(deq, deq0) < 1e-6


@nvrtc
def test_gemm_with_bias_in_the_epilogue_compiles():
    """The BIAS instantiations GemmLinear uses (bf16 / fp8, TMA-store epilogue)."""
    from deepgemm.cuda_gemm import compile_kernel, kernel_key
    from deepgemm.heuristics import pick_config

    for kind in ("bf16", "fp8"):
        cfg = pick_config(kind, 4096, 4096, 4096, num_sms=132, tma_store=True)
        key = kernel_key(cfg, 4096, 4096, "normal", 1, torch.bfloat16, False, bias=True)
        assert key.expression.endswith(", true>")
        mod = compile_kernel(key)
        assert key.expression in mod.lowered_names
