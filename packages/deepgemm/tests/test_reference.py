"""The CPU path (the reference) against a float64 matmul of the dequantized inputs.

Only fp32 summation differs from the oracle, so fp32 outputs agree to ~1e-6 relative; bf16 outputs
add one rounding (2^-9 relative), which calc_diff sees as < 1e-5.
"""

import deepgemm
import pytest
import torch
from tilehal import calc_diff

SHAPES = [(1, 64, 128), (7, 200, 256), (64, 256, 1000), (128, 130, 384), (33, 2112, 7168)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_fp8_gemm_nt_matches_float64(m, n, k, out, h):
    a8, sfa, b8, sfb = h.fp8_operands(m, n, k)
    d = torch.empty(m, n, dtype=out)
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d)
    ref = h.oracle_fp8(a8, sfa, b8, sfb)
    if out == torch.float32:
        torch.testing.assert_close(d.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    assert calc_diff(d, ref) < (1e-10 if out == torch.float32 else 1e-5)


def test_fp8_gemm_accumulates_c_in_place(h):
    a8, sfa, b8, sfb = h.fp8_operands(40, 96, 256, seed=3)
    c = torch.randn(40, 96)
    expect = h.oracle_fp8(a8, sfa, b8, sfb, c)
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), c, c=c)  # d is c: D = C + A B^T in place
    assert calc_diff(c, expect) < 1e-10


def test_fp8_other_layouts_agree_with_nt(h):
    # DeepGEMM's convention: a stored-transposed operand comes with its scales stored transposed too.
    a8, sfa, b8, sfb = h.fp8_operands(24, 136, 384, seed=5)
    ref = torch.empty(24, 136)
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), ref)
    for name, a_st, b_st in [("nn", (a8, sfa), (b8.T.contiguous(), sfb.T.contiguous())),
                             ("tn", (a8.T.contiguous(), sfa.T.contiguous()), (b8.T.contiguous(), sfb.T)),
                             ("tt", (a8.T.contiguous(), sfa.T), (b8, sfb))]:
        d = torch.empty(24, 136)
        getattr(deepgemm, f"fp8_gemm_{name}")(a_st, b_st, d)
        assert torch.equal(d, ref), name


def test_per_block_promotion_is_what_the_reference_does():
    # Two K blocks whose scales differ by 2^20: promotion per block keeps the small block's
    # contribution exactly; the result equals the sum of the two per-block products.
    m, n, k = 4, 8, 256
    a8 = torch.ones(m, k).to(torch.float8_e4m3fn)
    b8 = torch.ones(n, k).to(torch.float8_e4m3fn)
    sfa = torch.tensor([[1.0, 2.0**-20]]).repeat(m, 1)
    sfb = torch.ones(1, 2)
    d = torch.empty(m, n)
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d)
    assert torch.all(d == 128.0 + 128.0 * 2.0**-20)


@pytest.mark.parametrize("layout", ["nt", "nn", "tn", "tt"])
def test_bf16_layouts(layout):
    g = torch.Generator().manual_seed(7)
    m, n, k = 37, 72, 200
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, k, generator=g).bfloat16()
    c = torch.randn(m, n, generator=g)
    a_st = a.T.contiguous() if layout[0] == "t" else a
    b_st = b.T.contiguous() if layout[1] == "n" else b
    d = torch.empty(m, n, dtype=torch.float32)
    getattr(deepgemm, f"bf16_gemm_{layout}")(a_st, b_st, d, c=c)
    ref = a.double() @ b.double().T + c.double()
    assert calc_diff(d, ref) < 1e-10
    d16 = torch.empty(m, n, dtype=torch.bfloat16)
    getattr(deepgemm, f"bf16_gemm_{layout}")(a_st, b_st, d16)
    assert calc_diff(d16, a.double() @ b.double().T) < 1e-5


@pytest.mark.parametrize("fp8", [True, False])
def test_grouped_contiguous(fp8, h):
    g_n, n, k = 3, 136, 256
    counts = [5, 0, 130]  # expert 1 gets no tokens; expert 2 spans two 128-row blocks
    align = deepgemm.get_m_alignment_for_contiguous_layout()
    m_sum = sum(deepgemm.ceil_div(c, align) * align for c in counts) + align  # + one all-padding block
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32)
    start = 0
    for e, cnt in enumerate(counts):
        m_indices[start:start + cnt] = e
        start += deepgemm.ceil_div(cnt, align) * align
    a8, sfa, b8, sfb = h.fp8_operands(m_sum, n, k, groups=g_n, seed=11)
    sentinel = 12345.0
    d = torch.full((m_sum, n), sentinel, dtype=torch.bfloat16)
    if fp8:
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, m_indices)
    else:
        a, b = a8.bfloat16(), b8.bfloat16()
        deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
    # As the sm_90a kernel: a 128-row block takes its expert from its first row; its padding rows are
    # computed with that expert, a block that starts with padding is not written.
    block_expert = m_indices.view(-1, 128)[:, 0].repeat_interleave(128)
    for e in range(g_n):
        rows = (block_expert == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        if fp8:
            ref = h.oracle_fp8(a8[rows], sfa[rows], b8[e], sfb[e])
        else:
            ref = a8[rows].double() @ b8[e].double().T
        assert calc_diff(d[rows], ref) < 1e-5
    assert torch.all(d[block_expert < 0] == sentinel)  # the all-padding block is left as it was
    assert (block_expert < 0).sum() == 128 and (m_indices < 0).sum() > 128


@pytest.mark.parametrize("fp8", [True, False])
def test_grouped_masked(fp8, h):
    g_n, m_max, n, k = 4, 64, 80, 384
    masked_m = torch.tensor([0, 1, 63, 64], dtype=torch.int32)
    a8 = torch.empty(g_n, m_max, k, dtype=torch.float8_e4m3fn)
    sfa = torch.empty(g_n, m_max, 3)
    for gi in range(g_n):
        x, s, _, _ = h.fp8_operands(m_max, 8, k, seed=20 + gi)
        a8[gi], sfa[gi] = x, s
    _, _, b8, sfb = h.fp8_operands(1, n, k, groups=g_n, seed=30)
    d = torch.zeros(g_n, m_max, n, dtype=torch.bfloat16)
    if fp8:
        deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked_m, expected_m=32)
    else:
        deepgemm.m_grouped_bf16_gemm_nt_masked(a8.bfloat16(), b8.bfloat16(), d, masked_m, expected_m=32)
    for gi, rows in enumerate(masked_m.tolist()):
        if rows:
            ref = (h.oracle_fp8(a8[gi, :rows], sfa[gi, :rows], b8[gi], sfb[gi]) if fp8
                   else a8[gi, :rows].double() @ b8[gi].double().T)
            assert calc_diff(d[gi, :rows], ref) < 1e-5
        assert torch.all(d[gi, rows:] == 0)  # rows past masked_m are not written


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_blas_gemm(trans_a, trans_b):
    g = torch.Generator().manual_seed(9)
    m, n, k = 30, 50, 70
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    c = torch.randn(m, n, generator=g).bfloat16()
    out = deepgemm.gemm(a.T.contiguous() if trans_a else a, b.T.contiguous() if trans_b else b,
                        trans_a=trans_a, trans_b=trans_b, alpha=0.5, beta=2.0, c=c)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert calc_diff(out, 0.5 * a.double() @ b.double() + 2.0 * c.double()) < 1e-5
    a32, b32 = a.float(), b.float()
    out32 = deepgemm.gemm(a32, b32, alpha=2.0)
    torch.testing.assert_close(out32, 2.0 * a32 @ b32)
