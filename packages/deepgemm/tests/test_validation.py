"""Bad input raises ShapeError/ValueError naming the argument and both values, before any launch."""

import deepgemm
import pytest
import torch
from tilehal import ShapeError


def fp8(*shape):
    return torch.zeros(*shape).to(torch.float8_e4m3fn)


def good(m=64, n=128, k=256):
    return (fp8(m, k), torch.ones(m, 2)), (fp8(n, k), torch.ones(1, 2)), torch.empty(m, n, dtype=torch.bfloat16)


def test_good_inputs_pass():
    a, b, d = good()
    deepgemm.fp8_gemm_nt(a, b, d)


@pytest.mark.parametrize("mutate,pattern", [
    (lambda a, b, d: ((a[0].float(), a[1]), b, d), r"a: expected dtype float8_e4m3fn, got float32"),
    (lambda a, b, d: (a, (fp8(128, 384), b[1]), d), r"b: expected K .* = 256, got 384"),
    (lambda a, b, d: (a, b, torch.empty(64, 100, dtype=torch.bfloat16)), r"d: expected shape \(64, 128\), got \(64, 100\)"),
    (lambda a, b, d: (a, b, torch.empty(64, 128, dtype=torch.float16)), r"d: expected dtype bfloat16 or float32, got float16"),
    (lambda a, b, d: ((a[0], torch.ones(64, 3)), b, d), r"sfa: expected shape \(64, 2\), got \(64, 3\)"),
    (lambda a, b, d: (a, (b[0], torch.ones(2, 2)), d), r"sfb: expected shape \(1, 2\), got \(2, 2\)"),
    (lambda a, b, d: ((a[0], torch.ones(64, 2, dtype=torch.float64)), b, d), r"sfa: expected dtype float32, got float64"),
    (lambda a, b, d: (a[0], b, d), r"a: expected a \(tensor, scales\) pair"),
])
def test_fp8_bad_input(mutate, pattern):
    a, b, d = mutate(*good())
    with pytest.raises(ShapeError, match=pattern):
        deepgemm.fp8_gemm_nt(a, b, d)


def test_c_shape_and_recipe():
    a, b, d = good()
    with pytest.raises(ShapeError, match=r"c: expected shape \(64, 128\), got \(64, 1\)"):
        deepgemm.fp8_gemm_nt(a, b, d, c=torch.zeros(64, 1, dtype=d.dtype))
    # As DeepGEMM: C has D's dtype.
    with pytest.raises(ShapeError, match=r"c: expected dtype bfloat16, got float32"):
        deepgemm.fp8_gemm_nt(a, b, d, c=torch.zeros(64, 128))
    with pytest.raises(deepgemm.UnsupportedError, match=r"recipe: expected per-token activation scales"):
        deepgemm.fp8_gemm_nt(a, b, d, recipe=(128, 128, 128))
    with pytest.raises(ValueError, match=r"recipe: expected either recipe or the recipe_a/recipe_b pair"):
        deepgemm.fp8_gemm_nt(a, b, d, recipe=(1, 128, 128), recipe_a=(1, 128), recipe_b=(128, 128))
    with pytest.raises(ValueError, match=r"recipe_a/recipe_b: expected both or neither"):
        deepgemm.fp8_gemm_nt(a, b, d, recipe_a=(1, 128))


def test_bf16_bad_input():
    a = torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"b: expected K .* = 32, got 16"):
        deepgemm.bf16_gemm_nt(a, torch.zeros(4, 16, dtype=torch.bfloat16), torch.empty(8, 4))
    with pytest.raises(ShapeError, match=r"a: expected 2 dimensions, got 3"):
        deepgemm.bf16_gemm_nt(a[None], torch.zeros(4, 32, dtype=torch.bfloat16), torch.empty(8, 4))


def test_grouped_contiguous_bad_input():
    a, sfa = fp8(256, 128), torch.ones(256, 1)
    b, sfb = fp8(2, 64, 128), torch.ones(2, 1, 1)
    d = torch.empty(256, 64, dtype=torch.bfloat16)
    idx = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(ShapeError, match=r"grouped_layout: expected dtype int32, got int64"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, idx.long())
    with pytest.raises(ShapeError, match=r"grouped_layout: expected shape \(256,\), got \(255,\)"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, idx[:255])
    with pytest.raises(ShapeError, match=r"a: expected M_sum to be a multiple of 128 .*, got 200"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a[:200], sfa[:200]), (b, sfb), d[:200], idx[:200])
    with pytest.raises(ShapeError, match=r"sfb: expected 3 dimensions, got 2 \(shape \(1, 1\)\)"):
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb[0]), d, idx)


def test_grouped_masked_bad_input():
    a, sfa = fp8(2, 64, 128), torch.ones(2, 64, 1)
    b, sfb = fp8(2, 32, 128), torch.ones(2, 1, 1)
    d = torch.empty(2, 64, 32, dtype=torch.bfloat16)
    mm = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ShapeError, match=r"masked_m: expected shape \(2,\), got \(3,\)"):
        deepgemm.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, torch.zeros(3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"expected_m: expected a positive int"):
        deepgemm.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, mm, 0)
    with pytest.raises(ShapeError, match=r"a: expected G .* = 2, got 3"):
        deepgemm.m_grouped_fp8_gemm_nt_masked((fp8(3, 64, 128), sfa), (b, sfb), d, mm, 4)


def test_blas_gemm_bad_input():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"b: expected K .* = 8, got 5"):
        deepgemm.gemm(a, torch.zeros(5, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"c: expected a tensor when beta != 0"):
        deepgemm.gemm(a, torch.zeros(8, 3, dtype=torch.bfloat16), beta=1.0)
    with pytest.raises(ShapeError, match=r"b: expected dtype bfloat16, got float32"):
        deepgemm.gemm(a, torch.zeros(8, 3))
