import deepgemm
import pytest
import torch
from tilehal import ShapeError


def test_ceil_div_and_alignment():
    assert deepgemm.ceil_div(7, 128) == 1
    assert deepgemm.ceil_div(256, 128) == 2
    assert deepgemm.ceil_div(257, 128) == 3
    assert deepgemm.get_m_alignment_for_contiguous_layout() == 128
    assert deepgemm.get_tma_aligned_size(7, 4) == 8
    assert deepgemm.get_tma_aligned_size(64, 4) == 64


def test_ceil_div_and_align_take_integer_tensors():
    """DeepGEMM's test generators call align() on elements of an int32 tensor (psum layouts): element-wise,
    no sync; float tensors and non-positive divisors stay ArgumentErrors."""
    from tilehal import ArgumentError

    t = torch.tensor([0, 1, 128, 9884], dtype=torch.int32)
    assert deepgemm.ceil_div(t, 128).tolist() == [0, 1, 1, 78]
    assert deepgemm.align(t[3], 128).item() == 9984 and deepgemm.align(t[3], 128).dtype == torch.int32
    with pytest.raises(ArgumentError, match="ceil_div"):
        deepgemm.ceil_div(torch.tensor([1.5]), 128)
    with pytest.raises(ArgumentError, match="ceil_div"):
        deepgemm.ceil_div(t, 0)


def test_num_sms_roundtrip():
    old = deepgemm.get_num_sms()
    try:
        deepgemm.set_num_sms(78)
        assert deepgemm.get_num_sms() == 78
    finally:
        deepgemm.utils._num_sms = None
    assert deepgemm.get_num_sms() == old
    with pytest.raises(ValueError, match="num_sms"):
        deepgemm.set_num_sms(0)


@pytest.mark.parametrize("m,k", [(1, 128), (7, 200), (64, 512), (3, 1000)])
def test_per_token_cast_roundtrip(m, k):
    x = torch.randn(m, k, dtype=torch.float32) * 3
    x[0, :5] = 0.0
    q, sf = deepgemm.per_token_cast_to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k)
    assert sf.shape == (m, deepgemm.ceil_div(k, 128)) and sf.dtype == torch.float32
    # sf = amax / 448 per 1x128 block, so the block's largest value lands on +-448.
    for kb in range(sf.shape[1]):
        blk = x[:, kb * 128:(kb + 1) * 128]
        torch.testing.assert_close(sf[:, kb], blk.abs().amax(1).clamp(min=1e-4) / 448)
    full = sf.repeat_interleave(128, 1)[:, :k]
    back = q.float() * full
    # e4m3: 3 mantissa bits (relative error <= 2^-4); below 2^-6 subnormals, spacing 2^-9 (half: 2^-10).
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + full * 2**-10 + 1e-6)


@pytest.mark.parametrize("n,k", [(128, 128), (200, 300), (16, 1000)])
def test_per_block_cast_roundtrip(n, k):
    x = torch.randn(n, k) * 5
    q, sf = deepgemm.per_block_cast_to_fp8(x)
    assert sf.shape == (deepgemm.ceil_div(n, 128), deepgemm.ceil_div(k, 128))
    full = sf.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    back = q.float() * full
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + full * 2**-10 + 1e-6)
    assert torch.isclose(sf[0, 0], x[:128, :128].abs().max() / 448)


def test_per_block_cast_batched():
    x = torch.randn(3, 130, 260)
    q, sf = deepgemm.per_block_cast_to_fp8(x)
    assert q.shape == x.shape and sf.shape == (3, 2, 3)
    q1, sf1 = deepgemm.per_block_cast_to_fp8(x[1])
    assert torch.equal(sf[1], sf1) and torch.equal(q[1].view(torch.uint8), q1.view(torch.uint8))


@pytest.mark.parametrize("shape", [(5, 3), (64, 56), (2, 7, 4)])
def test_mn_major_tma_aligned(shape):
    sf = torch.randn(*shape)
    t = deepgemm.get_mn_major_tma_aligned_tensor(sf)
    assert torch.equal(t, sf)
    mn = shape[-2]
    assert t.stride(-2) == 1
    if shape[-1] > 1:
        assert t.stride(-1) == deepgemm.get_tma_aligned_size(mn, 4)
    # already in layout -> returned as is (no copy)
    assert deepgemm.get_mn_major_tma_aligned_tensor(t) is t


def test_transform_sf_checks_shapes():
    sfa = torch.rand(10, 3)
    out = deepgemm.transform_sf_into_required_layout(sfa, 10, 300, is_sfa=True)
    assert torch.equal(out, sfa) and out.stride(0) == 1
    sfb = torch.rand(2, 3)
    assert torch.equal(deepgemm.transform_sf_into_required_layout(sfb, 200, 300, is_sfa=False), sfb)
    with pytest.raises(ShapeError, match=r"sfa: expected shape \(10, 4\), got \(10, 3\)"):
        deepgemm.transform_sf_into_required_layout(sfa, 10, 400, is_sfa=True)
    with pytest.raises(ValueError, match="recipe"):
        deepgemm.transform_sf_into_required_layout(sfa, 10, 300, recipe=(1, 128, 32))


def test_degenerate_gemm_answers_empty_outputs_and_zero_k():
    from deepgemm.utils import degenerate_gemm

    d = torch.full((3, 4), 7.0)
    c = torch.arange(12.0).reshape(3, 4)
    assert degenerate_gemm(3, 4, 0, d, c) and torch.equal(d, c)  # K = 0: D = C
    assert degenerate_gemm(3, 4, 0, d, None) and torch.equal(d, torch.zeros(3, 4))  # no C: D = 0
    d.fill_(7.0)
    assert degenerate_gemm(0, 4, 5, d, c) and degenerate_gemm(3, 0, 5, d, c)  # empty D: left as it is
    assert torch.equal(d, torch.full((3, 4), 7.0))
    assert not degenerate_gemm(3, 4, 5, d, c) and torch.equal(d, torch.full((3, 4), 7.0))  # a kernel's job
