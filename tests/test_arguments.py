"""The umbrella's public entry points, each argument replaced in turn by a bad value (wrong type, NaN,
0, -1, huge, empty / NaN tensors): the call succeeds or raises a TileStackError naming the argument,
never a raw torch/Python exception or a hang (issue 16, item 7). Plus a fuzz test of GemmLinear
against torch's linear on random shapes (sizes 0 and 1), dtypes and NaN/Inf inputs."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilehal import TileStackError
from tilehal.testing import probe_arguments

import tilestack

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


CASES = {
    "GemmLinear": lambda: (tilestack.GemmLinear, dict(in_features=32, out_features=16, bias=True, fp8=False,
                                                      device="cpu", dtype=torch.bfloat16)),
    "GemmLinear.from_linear": lambda: (tilestack.GemmLinear.from_linear, dict(linear=torch.nn.Linear(32, 16),
                                                                              fp8=False)),
    "GemmLinear.forward": lambda: (tilestack.GemmLinear(32, 16, dtype=torch.bfloat16).forward,
                                   dict(x=torch.randn(4, 32, dtype=torch.bfloat16))),
    "ReferenceMoE": lambda: (tilestack.ReferenceMoE, dict(hidden=16, ffn_hidden=32, num_experts=4, top_k=2,
                                                          norm_topk_prob=False, dtype=torch.float32)),
    "ExpertParallelMoE": lambda: (tilestack.ExpertParallelMoE, dict(hidden=16, ffn_hidden=32, num_experts=4, top_k=2,
                                                                    dtype=torch.bfloat16, use_fp8=False,
                                                                    device="cpu")),
    "register_optimizations": lambda: (tilestack.register_optimizations, dict(model=_model(), backend="cpu",
                                                                              fp8=False, sparse_24=False,
                                                                              include=None)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name):
    fn, kwargs = CASES[name]()
    with torch.no_grad():
        fn(**kwargs)  # the baseline is valid
        assert probe_arguments(fn, kwargs, fresh=CASES[name]) == []


_VALUES = st.sampled_from([0.0, 1.0, -0.5, 2.0, 1e4, math.nan, math.inf, -math.inf])


@FUZZ
@given(m=st.sampled_from([0, 1, 3, 17]), k=st.sampled_from([1, 16, 64, 100]), n=st.sampled_from([1, 8, 33]),
       bias=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       bad=st.lists(st.tuples(st.integers(0, 10**6), _VALUES), max_size=2), wrong_k=st.booleans())
def test_gemm_linear_matches_torch_or_names_the_argument(m, k, n, bias, dtype, bad, wrong_k):
    torch.manual_seed(m * 1000 + k * 10 + n)
    lin = torch.nn.Linear(k, n, bias=bias).to(dtype)
    layer = tilestack.GemmLinear.from_linear(lin)
    x = torch.randn(m, k + (1 if wrong_k else 0), dtype=dtype)
    for pos, v in bad:
        if x.numel():
            x.view(-1)[pos % x.numel()] = v
    with torch.no_grad():
        try:
            got = layer(x)
        except TileStackError as e:
            assert wrong_k and ("x" in str(e) or "a:" in str(e) or "in_features" in str(e)), str(e)
            return
        assert not wrong_k
        want = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float() if bias else None)
    assert got.shape == (m, n) and got.dtype == dtype
    g, w = got.float(), want
    assert torch.equal(torch.isnan(g), torch.isnan(w)) or bool(torch.isnan(w).any())  # NaN rows stay NaN rows
    finite = torch.isfinite(w) & torch.isfinite(g)
    # bf16 operands (deepgemm), also for a float32 layer: each product rounds by <= 2 * 2**-8, the bf16
    # output by 2**-8; so |error| <= 2**-7 * (|x| @ |W|^T + |b|) + 2**-8 * |out| (doubled for slack)
    xa = torch.nan_to_num(x.float().abs(), nan=0.0, posinf=0.0)
    mag = xa @ lin.weight.float().abs().T + (lin.bias.float().abs() if bias else 0)
    bound = 2 * (2**-7 * mag + 2**-8 * w.abs()) + 1e-6
    assert ((g - w).abs()[finite] <= bound[finite]).all()
