"""Values deepgemm refuses or confines (issue 16, item 6): negative or non-finite scales, masked_m
outside [0, M_max], group indices outside [-1, G), and one Inf or NaN in a quantized block (it stays
at its own position instead of turning the block into NaN). Plus a fuzz test of the public API:
every input gives the float64 reference's result or a TileStackError naming an argument."""

import math

import deepgemm
import pytest
import torch
from deepgemm import utils
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilehal import ArgumentError, TileStackError

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _operands(m=64, n=128, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    return utils.per_token_cast_to_fp8(a), utils.per_block_cast_to_fp8(b)


@pytest.mark.parametrize("bad", [-1.0, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("which", ["sfa", "sfb"])
def test_negative_or_non_finite_scales_are_refused(bad, which):
    (a, sfa), (b, sfb) = _operands()
    sf = sfa if which == "sfa" else sfb
    sf[0, 1] = bad
    d = torch.empty(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match=rf"{which}: expected finite scales >= 0, got {bad} at index \(0, 1\)"):
        deepgemm.fp8_gemm_nt((a, sfa), (b, sfb), d)


def test_scales_of_rows_a_grouped_gemm_never_reads_are_not_checked():
    """DeepGEMM's grouped tests leave padding rows' scales as they come (the psum layout's gaps even
    uninitialized): rows with m_indices -1, psum gaps and masked rows past masked_m may hold anything, and the
    results of the rows that count match the float reference; a bad scale in a row that is read is still an
    ArgumentError."""
    g, n, k = 2, 64, 256
    b = torch.randn(g, n, k)
    b8 = torch.empty(g, n, k, dtype=torch.float8_e4m3fn)
    sfb = torch.empty(g, n // 128 + 1, k // 128)
    for i in range(g):
        b8[i], sfb[i] = utils.per_block_cast_to_fp8(b[i])
    # contiguous, psum layout: group 0 owns rows [0, 100), group 1 [128, 200); rows 100-127 and 200-255 are gaps
    a8, sfa = utils.per_token_cast_to_fp8(torch.randn(256, k))
    sfa[100:128] = math.nan
    sfa[200:] = -1.0
    ends = torch.tensor([100, 200], dtype=torch.int32)
    d = torch.zeros(256, n, dtype=torch.bfloat16)
    deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, ends, use_psum_layout=True)
    deq_b = b8.float() * sfb.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)
    deq_a = a8.float() * sfa.repeat_interleave(128, 1)
    for grp, (lo, hi) in enumerate(((0, 100), (128, 200))):
        torch.testing.assert_close(d[lo:hi].float(), deq_a[lo:hi] @ deq_b[grp].T, rtol=1e-2, atol=1e-2)
    sfa[5, 1] = math.inf  # a row group 0 reads
    with pytest.raises(ArgumentError, match=r"sfa: expected finite scales >= 0, got inf at index \(5, 1\)"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, ends, use_psum_layout=True)
    # masked: rows past masked_m[g] are not read
    a3 = torch.empty(g, 64, k, dtype=torch.float8_e4m3fn)
    sfa3 = torch.empty(g, 64, k // 128)
    for i in range(g):
        a3[i], sfa3[i] = utils.per_token_cast_to_fp8(torch.randn(64, k))
    masked_m = torch.tensor([10, 64], dtype=torch.int32)
    sfa3[0, 10:] = math.nan
    d3 = torch.zeros(g, 64, n, dtype=torch.bfloat16)
    deepgemm.m_grouped_fp8_gemm_nt_masked((a3, sfa3), (b8, sfb), d3, masked_m, 32)
    deq_a3 = a3.float() * sfa3.repeat_interleave(128, 2)
    torch.testing.assert_close(d3[0, :10].float(), deq_a3[0, :10] @ deq_b[0].T, rtol=1e-2, atol=1e-2)
    sfa3[1, 63, 0] = -2.0  # group 1 reads all 64 rows
    with pytest.raises(ArgumentError, match=r"sfa: expected finite scales >= 0, got -2.0 at index \(1, 63, 0\)"):
        deepgemm.m_grouped_fp8_gemm_nt_masked((a3, sfa3), (b8, sfb), d3, masked_m, 32)


def test_zero_scales_are_a_zero_block():
    (a, sfa), (b, sfb) = _operands()
    sfa[3, 0] = 0.0
    d = torch.empty(64, 128, dtype=torch.float32)
    deepgemm.fp8_gemm_nt((a, sfa), (b, sfb), d)
    want = (a.float()[3, 128:] * sfa[3, 1]) @ (b.float()[:, 128:] * sfb[:, 1].repeat_interleave(128)[:, None]).T
    torch.testing.assert_close(d[3], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bad", [33, -1, 2**31 - 1])
def test_masked_m_outside_0_to_m_max_is_refused(bad):
    g, m_max, n, k = 2, 32, 64, 256
    a = torch.randn(g, m_max, k).bfloat16()
    b = torch.randn(g, n, k).bfloat16()
    d = torch.zeros(g, m_max, n, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match=rf"masked_m: expected values in \[0, 32\].*got {bad} at index \(1,\)"):
        deepgemm.m_grouped_bf16_gemm_nt_masked(a, b, d, torch.tensor([5, bad], dtype=torch.int32), 16)
    assert not d.any()  # refused before anything ran
    deepgemm.m_grouped_bf16_gemm_nt_masked(a, b, d, torch.tensor([0, 32], dtype=torch.int32), 16)  # both ends ok
    torch.testing.assert_close(d[1], (a[1].float() @ b[1].float().T).bfloat16(), rtol=2e-2, atol=2e-2)
    assert not d[0].any()


def test_group_indices_and_psum_layout_are_checked():
    g, m, n, k = 2, 128, 64, 256
    a = torch.randn(m, k).bfloat16()
    b = torch.randn(g, n, k).bfloat16()
    d = torch.zeros(m, n, dtype=torch.bfloat16)
    for bad in (2, -2):
        mi = torch.zeros(m, dtype=torch.int32)
        mi[3] = bad
        with pytest.raises(ArgumentError, match=rf"grouped_layout: expected values in \[-1, 1\].*got {bad} at index "
                                                rf"\(3,\)"):
            deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, mi)
    with pytest.raises(ArgumentError, match=r"grouped_layout: expected values in \[0, 128\].*got 200"):
        deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, torch.tensor([200, 100], dtype=torch.int32),
                                                   use_psum_layout=True)
    with pytest.raises(ArgumentError, match=r"grouped_layout: expected non-decreasing group ends, got 64 after 100"):
        deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, torch.tensor([100, 64], dtype=torch.int32),
                                                   use_psum_layout=True)


@pytest.mark.parametrize("cast", ["token", "block", "channel"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_one_inf_or_nan_stays_at_its_position(cast, bad):
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    clean = x.clone()
    x[5, 7] = bad
    fn = {"token": utils.per_token_cast_to_fp8, "block": utils.per_block_cast_to_fp8,
          "channel": utils.per_channel_cast_to_fp8}[cast]
    q, sf = fn(x)
    back = q.float()
    if cast == "token":
        back = (back.view(128, 2, 128) * sf[:, :, None]).view(128, 256)
        expect_top = 448 * sf[5, 0]
    elif cast == "block":
        back = (back.view(1, 128, 2, 128) * sf[:, None, :, None]).view(128, 256)
        expect_top = 448 * sf[0, 0]
    else:
        back = (back.view(1, 128, 256) * sf[:, None, :]).view(128, 256)
        expect_top = 448 * sf[0, 7]
    if math.isnan(bad):
        assert math.isnan(back[5, 7]) and back.isnan().sum() == 1
    else:
        assert back[5, 7] == math.copysign(expect_top, bad)  # the largest magnitude at the block's scale
        assert torch.isfinite(back).all()
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[5, 7] = False
    # the block's scale comes from its finite values: every other element is quantized as usual
    ref = clean.double()
    err = (back.double() - ref).abs()[keep]
    assert float(err.max()) <= 0.07 * float(ref.abs().max())  # e4m3: 3 mantissa bits at the block's scale


# ------------------------------------------------------------------ fuzz: the public API

_VALUES = st.sampled_from([0.0, 1.0, -2.5, 3e4, -1e-6, 0.125, math.nan, math.inf, -math.inf])
_SCALE_VALUES = st.sampled_from([1.0, 0.5, 0.0, 2.0**-10, -1.0, math.nan, math.inf])


def _names_an_argument(e: Exception) -> bool:
    msg = str(e)
    return any(f"{n}:" in msg or f"{n} " in msg for n in ("a", "b", "d", "c", "sfa", "sfb", "masked_m", "x",
                                                         "grouped_layout", "expected_m", "recipe"))


@st.composite
def _fp8_case(draw):
    m = draw(st.sampled_from([0, 1, 3, 64, 129]))
    n = draw(st.sampled_from([1, 16, 128, 200]))
    k = draw(st.sampled_from([128, 256, 100]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    a = torch.randn(m, k, generator=g) * draw(st.sampled_from([1.0, 1e3, 1e-3]))
    b = torch.randn(n, k, generator=g)
    if m and draw(st.booleans()):
        a[draw(st.integers(0, m - 1)), draw(st.integers(0, k - 1))] = draw(_VALUES)
    (aq, sfa), (bq, sfb) = utils.per_token_cast_to_fp8(a), utils.per_block_cast_to_fp8(b)
    mutation = draw(st.sampled_from(["none", "sfa_value", "sfb_value", "sfa_shape", "d_shape", "d_dtype", "b_k",
                                     "strided_a"]))
    d = torch.empty(m, n, dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])))
    if mutation == "sfa_value" and sfa.numel():
        sfa[0, 0] = draw(_SCALE_VALUES)
    elif mutation == "sfb_value":
        sfb[-1, -1] = draw(_SCALE_VALUES)
    elif mutation == "sfa_shape":
        sfa = sfa[:, :1]
    elif mutation == "d_shape":
        d = torch.empty(m + 1, n, dtype=d.dtype)
    elif mutation == "d_dtype":
        d = d.half()
    elif mutation == "b_k":
        bq = bq[:, : k // 2]
    elif mutation == "strided_a":
        aq = torch.cat([aq, aq], dim=1)[:, ::2]
    return aq, sfa, bq, sfb, d


def _dequant_reference(aq, sfa, bq, sfb):
    k = aq.shape[1]
    sa = sfa.double().repeat_interleave(128, dim=1)[:, :k]
    sb = sfb.double().repeat_interleave(128, dim=0)[: bq.shape[0]].repeat_interleave(128, dim=1)[:, :k]
    return (aq.double() * sa) @ (bq.double() * sb).T


@FUZZ
@given(case=_fp8_case())
def test_fp8_gemm_matches_the_reference_or_names_an_argument(case):
    aq, sfa, bq, sfb, d = case
    try:
        deepgemm.fp8_gemm_nt((aq, sfa), (bq, sfb), d)
    except TileStackError as e:
        assert _names_an_argument(e), str(e)
        return
    want = _dequant_reference(aq, sfa, bq, sfb)
    got = d.double()
    assert got.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isnan(got), torch.isnan(want))  # a NaN input stays NaN, and nothing else turns NaN
    tol = 1e-2 if d.dtype == torch.bfloat16 else 1e-5
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    assert ((got[finite] - want[finite]).abs() <= tol * (want[finite].abs() + scale * 1e-2) + 1e-30).all()


@FUZZ
@given(g=st.integers(1, 3), m_max=st.sampled_from([0, 1, 8]), n=st.sampled_from([1, 16]),
       counts=st.lists(st.integers(-3, 12), min_size=3, max_size=3), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_masked_grouped_gemm_matches_or_names_masked_m(g, m_max, n, counts, dtype):
    k = 128
    gen = torch.Generator().manual_seed(g * 100 + m_max)
    a = torch.randn(g, m_max, k, generator=gen).bfloat16()
    b = torch.randn(g, n, k, generator=gen).bfloat16()
    d = torch.zeros(g, m_max, n, dtype=torch.bfloat16)
    mm = torch.tensor(counts[:g], dtype=dtype)
    try:
        deepgemm.m_grouped_bf16_gemm_nt_masked(a, b, d, mm, 4)
    except TileStackError as e:
        assert "masked_m" in str(e)
        assert dtype != torch.int32 or any(c < 0 or c > m_max for c in counts[:g])
        assert not d.any()
        return
    for i, rows in enumerate(counts[:g]):
        torch.testing.assert_close(d[i, :rows].float(), a[i, :rows].float() @ b[i].float().T, rtol=2e-2, atol=5e-2)
        assert not d[i, rows:].any()


@FUZZ
@given(m=st.sampled_from([0, 1, 5, 128]), k=st.sampled_from([1, 2, 127, 128, 300]),
       bad=st.lists(st.tuples(st.integers(0, 10**6), _VALUES), max_size=3), ue8m0=st.booleans())
def test_per_token_cast_confines_bad_values(m, k, bad, ue8m0):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    for pos, v in bad:
        if x.numel():
            x.view(-1)[pos % x.numel()] = v
    q, sf = utils.per_token_cast_to_fp8(x, use_ue8m0=ue8m0)
    assert torch.isfinite(sf).all() and (sf > 0).all()
    sk = sf.shape[1] if sf.dim() == 2 else 0
    back = q.float()
    if m and k:
        back = (torch.nn.functional.pad(back, (0, sk * 128 - k)).view(m, sk, 128) * sf[:, :, None]).view(m, -1)[:, :k]
    assert torch.equal(torch.isnan(back), torch.isnan(x))
    assert torch.equal(torch.isinf(back), torch.zeros_like(back, dtype=torch.bool))
