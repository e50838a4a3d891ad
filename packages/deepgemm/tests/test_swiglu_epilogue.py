"""m_grouped_fp8_gemm_nt_contiguous_swiglu: the contiguous grouped fp8 GEMM with silu(gate) * up in its epilogue.

CPU: the API against an independent float64 oracle (dequantized operands, per-row expert, silu * up), on ragged
groups with an empty expert and padding blocks. NVRTC (CI): the SWIGLU kernel instantiations compile without
spills. GPU: the kernel against the reference path on the same GPU.
"""

from __future__ import annotations

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import cuda_gemm, reference
from deepgemm.heuristics import pick_config, swiglu_config

nvrtc = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")


def _layout(counts, align=128):
    """int32 per-row experts: each expert's rows padded to `align` with -1 (an empty expert has no rows)."""
    rows = []
    for e, c in enumerate(counts):
        rows += [e] * c + [-1] * (-c % align)
    return torch.tensor(rows, dtype=torch.int32)


def _operands(m, f, k, groups, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((m, k), generator=g).bfloat16()
    w = (torch.randn((groups, 2 * f, k), generator=g) / k**0.5).bfloat16()  # gate rows, then up rows
    return a, w


def _oracle(a8, sfa, w8, sfb, m_indices, f):
    """float64 silu(gate) * up per row with the row's expert (interleaved weights de-interleaved here)."""
    a = a8.double() * sfa.double().repeat_interleave(128, dim=1)[:, :a8.shape[1]]
    out = torch.zeros((a8.shape[0], f), dtype=torch.float64)
    for e in range(w8.shape[0]):
        s = sfb[e].double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        b = w8[e].double() * s[:w8.shape[1], :w8.shape[2]]
        gate, up = deepgemm.swiglu_deinterleave(a @ b.T)
        rows = m_indices.long() == e
        out[rows] = (torch.nn.functional.silu(gate) * up)[rows]
    return out


def test_interleave_round_trip():
    w = torch.randn(3, 256, 40)
    wi = deepgemm.swiglu_interleave(w)
    assert torch.equal(wi[:, 64:128], w[:, 128:192])  # the first up block follows the first gate block
    gate, up = deepgemm.swiglu_deinterleave(wi.transpose(-1, -2))
    assert torch.equal(gate, w[:, :128].transpose(-1, -2)) and torch.equal(up, w[:, 128:].transpose(-1, -2))
    with pytest.raises(tilehal.ShapeError, match="multiple of 64"):
        deepgemm.swiglu_interleave(torch.randn(2, 96, 8))


@pytest.mark.parametrize("counts,f,k", [([130, 0, 77, 256], 128, 256), ([1, 200], 192, 384)])
def test_swiglu_gemm_on_the_cpu_matches_the_oracle(counts, f, k):
    m_indices = _layout(counts)
    m = m_indices.numel()
    a, w = _operands(m, f, k, len(counts), seed=sum(counts))
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    w8, sfb = deepgemm.per_block_cast_to_fp8(deepgemm.swiglu_interleave(w))
    d = torch.full((m, f), 7.0, dtype=torch.bfloat16)
    deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu((a8, sfa), (w8, sfb), d, m_indices)
    ref = _oracle(a8, sfa, w8, sfb, m_indices, f)
    valid = m_indices >= 0
    assert tilehal.calc_diff(d[valid].double(), ref[valid]) < 1e-5
    blocks = (m_indices < 0).view(-1, 128)[:, 0]  # blocks starting with padding are not written
    assert torch.all(d.view(-1, 128, f)[blocks] == 7.0)


def test_swiglu_gemm_rejects_bad_shapes():
    m_indices = _layout([128])
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(128, 128))
    w8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(1, 192, 128))
    with pytest.raises(tilehal.ShapeError, match="multiple of 128"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu((a8, sfa), (w8, sfb), torch.empty(128, 96).bfloat16(),
                                                         m_indices)
    w8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(1, 256, 128))
    with pytest.raises(tilehal.ShapeError, match="d"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu((a8, sfa), (w8, sfb), torch.empty(128, 256).bfloat16(),
                                                         m_indices)


SWIGLU_SHAPES = [(9216, 28672, 4096, 8), (512, 512, 256, 4), (256, 384, 384, 2)]  # (M_sum, 2F, K, G)


def _swiglu_key(m, n, k, g):
    cfg = swiglu_config(pick_config("fp8", m, n, k, num_groups=g, grouping="contiguous", num_sms=132,
                                    tma_store=True), m, n)
    return cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False)


@nvrtc
def test_swiglu_kernels_compile_without_spills(h):
    keys = [_swiglu_key(*s) for s in SWIGLU_SHAPES]
    assert all(k.swiglu and k.block_n == 128 and k.expression.endswith("false, false, true>") for k in keys)
    exprs = [k.expression for k in keys]
    mod = tilehal.compile_cuda(cuda_gemm.kernel_source(), arch="sm_90a", name="deepgemm_gemm_sm90",
                               options=cuda_gemm.OPTIONS + ("--ptxas-options=-v",), name_expressions=exprs)
    h.check_compiled(mod, exprs)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,f,k", [([1000, 0, 77, 2000, 128, 5, 300, 999], 1024, 512),
                                        ([4096, 4096], 14336 // 4, 1024)])
def test_swiglu_gemm_on_gpu_matches_the_reference(counts, f, k):
    m_indices = _layout(counts).cuda()
    m = m_indices.numel()
    a, w = _operands(m, f, k, len(counts), seed=len(counts))
    a8, sfa = deepgemm.per_token_cast_to_fp8(a.cuda())
    w8, sfb = deepgemm.per_block_cast_to_fp8(deepgemm.swiglu_interleave(w).cuda())
    d = torch.full((m, f), 7.0, dtype=torch.bfloat16, device="cuda")
    deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu((a8, sfa), (w8, sfb), d, m_indices)
    full = torch.zeros((m, 2 * f), dtype=torch.float32, device="cuda")
    reference.grouped_contiguous(a8, w8, m_indices, full, sfa, sfb)
    gate, up = deepgemm.swiglu_deinterleave(full)
    ref = torch.nn.functional.silu(gate) * up
    valid = m_indices >= 0
    assert tilehal.calc_diff(d[valid].float(), ref[valid]) < 1e-5
    blocks = (m_indices < 0).view(-1, 128)[:, 0]
    assert torch.all(d.view(-1, 128, f)[blocks] == 7.0)
