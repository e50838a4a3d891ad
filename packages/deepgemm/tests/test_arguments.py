"""deepgemm's public entry points, each argument replaced in turn by a bad value (wrong type, NaN, 0,
-1, huge, empty / NaN tensors): the call succeeds or raises a TileStackError naming the argument,
never a raw torch/Python exception or a hang (issue 16, item 7). CPU reference path."""

import deepgemm
import pytest
import torch
from deepgemm import utils
from tilehal.testing import probe_arguments


def _fp8(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    return utils.per_token_cast_to_fp8(torch.randn(m, k, generator=g)), \
        utils.per_block_cast_to_fp8(torch.randn(n, k, generator=g))


def _bf16(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).bfloat16()


def _masked():
    a, b = _bf16(2, 8, 128), _bf16(2, 16, 128)
    return dict(a=a, b=b, d=torch.zeros(2, 8, 16, dtype=torch.bfloat16),
                masked_m=torch.tensor([3, 8], dtype=torch.int32), expected_m=4)


def _contig():
    return dict(a=_bf16(128, 128), b=_bf16(2, 16, 128), d=torch.zeros(128, 16, dtype=torch.bfloat16),
                grouped_layout=torch.zeros(128, dtype=torch.int32))


CASES = {
    "fp8_gemm_nt": lambda: (deepgemm.fp8_gemm_nt, dict(zip(("a", "b"), _fp8(8, 16, 256)),
                                                       d=torch.empty(8, 16, dtype=torch.bfloat16), c=None)),
    "bf16_gemm_nt": lambda: (deepgemm.bf16_gemm_nt, dict(a=_bf16(8, 128), b=_bf16(16, 128),
                                                         d=torch.empty(8, 16, dtype=torch.bfloat16), c=None)),
    "bf16_gemm_tn": lambda: (deepgemm.bf16_gemm_tn, dict(a=_bf16(128, 8), b=_bf16(128, 16),
                                                         d=torch.empty(8, 16, dtype=torch.float32))),
    "m_grouped_bf16_gemm_nt_masked": lambda: (deepgemm.m_grouped_bf16_gemm_nt_masked, _masked()),
    "m_grouped_bf16_gemm_nt_contiguous": lambda: (deepgemm.m_grouped_bf16_gemm_nt_contiguous, _contig()),
    "per_token_cast_to_fp8": lambda: (utils.per_token_cast_to_fp8, dict(x=torch.randn(4, 256), use_ue8m0=False,
                                                                       gran_k=128)),
    "per_block_cast_to_fp8": lambda: (utils.per_block_cast_to_fp8, dict(x=torch.randn(4, 256), use_ue8m0=False)),
    "per_channel_cast_to_fp8": lambda: (utils.per_channel_cast_to_fp8, dict(x=torch.randn(128, 8), use_ue8m0=False)),
    "per_custom_dims_cast_to_fp8": lambda: (utils.per_custom_dims_cast_to_fp8, dict(x=torch.randn(4, 8), dims=(0,))),
    "per_token_cast_to_fp4": lambda: (utils.per_token_cast_to_fp4, dict(x=torch.randn(4, 256), use_ue8m0=False)),
    "ceil_div": lambda: (deepgemm.ceil_div, dict(a=7, b=2)),
    "align": lambda: (deepgemm.align, dict(x=7, a=4)),
    "get_tma_aligned_size": lambda: (deepgemm.get_tma_aligned_size, dict(x=7, element_size=4)),
    "get_mn_major_tma_aligned_tensor": lambda: (deepgemm.get_mn_major_tma_aligned_tensor, dict(sf=torch.ones(8, 2))),
    "ceil_to_ue8m0": lambda: (deepgemm.ceil_to_ue8m0, dict(x=torch.rand(4) + 0.1)),
    "gemm": lambda: (deepgemm.gemm, dict(a=_bf16(8, 128), b=_bf16(128, 16))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name):
    fn, kwargs = CASES[name]()
    fn(**kwargs)  # the baseline is valid
    assert probe_arguments(fn, kwargs, fresh=CASES[name]) == []
