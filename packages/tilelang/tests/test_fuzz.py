"""Fuzz tilelang's runtime argument handling and memory semantics (issue 16): random sizes (0 and 1
included), dtypes, strides, index values past both ends and NaN/Inf data. Every call either gives
the interpreter's result (the oracle; numpy's for the gather) or raises a TileStackError whose
message names the argument, never a raw numpy exception, a crash or an out-of-bounds access.
Kernels use T.dynamic sizes, so one build per dtype serves every example."""

import functools
import math

import numpy as np
import pytest
import tilehal
import tilelang
import tilelang.language as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["float32", "float16", "bfloat16", "int32"]
VALUES = [0.0, 1.0, -2.5, 3.0e4, 1e-3, math.nan, math.inf, -math.inf]


@functools.cache
def gather(dtype: str, target: str):
    N, M = T.dynamic("N"), T.dynamic("M")

    @T.prim_func
    def main(A: T.Tensor((N,), dtype), idx: T.Tensor((M,), "int32"), B: T.Tensor((M,), dtype)):
        with T.Kernel(T.ceildiv(M, 16)) as bx:
            for i in T.Parallel(16):
                B[bx * 16 + i] = A[idx[bx * 16 + i]]

    return tilelang.compile(main, out_idx=[2], target=target)


@functools.cache
def scatter(target: str):
    M = T.dynamic("M")

    @T.prim_func
    def main(idx: T.Tensor((M,), "int32"), B: T.Tensor((8,), "float32")):
        with T.Kernel(1) as _:
            h = T.alloc_fragment((8,), "float32")
            T.fill(h, 0.0)
            for i in T.serial(M):
                h[idx[i]] = h[idx[i]] + 1.0
            for j in T.Parallel(8):
                B[j] = h[j]

    return tilelang.compile(main, out_idx=[1], target=target)


def _data(draw, dtype, n):
    vals = draw(st.lists(st.sampled_from(VALUES), min_size=n, max_size=n))
    np_dtype = tilehal.to_numpy_dtype(dtype)
    with np.errstate(all="ignore"):
        if dtype == "int32":
            return np.nan_to_num(np.array(vals), nan=0, posinf=7, neginf=-7).astype(np.int32)
        return np.array(vals, dtype=np.float64).astype(np_dtype)


@st.composite
def gather_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.sampled_from([0, 1, 5, 33]))
    m = draw(st.sampled_from([0, 1, 16, 17, 40]))
    a = _data(draw, dtype, n)
    idx = np.array(draw(st.lists(st.integers(-3, n + 3) | st.sampled_from([2**31 - 1, -(2**31)]), min_size=m,
                                 max_size=m)), dtype=np.int64).astype(np.int32)
    mutation = draw(st.sampled_from(["none", "none", "strided", "dtype", "rank", "idx_dtype", "list"]))
    return dtype, a, idx, mutation


@FUZZ
@given(case=gather_case(), target=st.sampled_from(["interp", "cpu"]))
def test_gather_matches_numpy_or_names_the_argument(case, target):
    dtype, a, idx, mutation = case
    if mutation == "strided":
        a = np.repeat(a, 2)[::2]  # a non-contiguous view with the same values
    elif mutation == "dtype":
        a = a.astype(np.float64)
    elif mutation == "rank":
        a = a.reshape(1, -1)
    elif mutation == "idx_dtype":
        idx = idx.astype(np.int64)
    elif mutation == "list":
        a = a.tolist()
    try:
        got = gather(dtype, target)(a, idx)
    except tilehal.TileStackError as e:
        assert mutation != "none", str(e)
        assert any(n in str(e) for n in ("A:", "idx:", "A ", "idx ")), str(e)
        return
    assert mutation == "none"
    ok = (idx >= 0) & (idx < a.shape[0])
    want = np.where(ok, a[np.clip(idx, 0, max(a.shape[0] - 1, 0))] if a.size else 0, 0).astype(a.dtype)
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))  # NaN == NaN here


@FUZZ
@given(idx=st.lists(st.integers(-2, 10), max_size=12))
def test_on_chip_scatter_is_the_interpreters(idx):
    ix = np.array(idx, dtype=np.int32)
    outs = []
    for target in ("interp", "cpu"):
        try:
            outs.append(scatter(target)(ix))
        except tilehal.LaunchError as e:
            assert "store to h" in str(e) and "out of bounds" in str(e)
            outs.append("LaunchError")
    if any(v < 0 or v >= 8 for v in idx):
        assert outs == ["LaunchError", "LaunchError"]
    else:
        np.testing.assert_array_equal(outs[0], np.bincount(ix, minlength=8).astype(np.float32))
        np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("target", ["interp", "cpu"])
def test_call_argument_errors_name_the_parameter(target):
    k = gather("float32", target)
    a, idx = np.ones(4, np.float32), np.zeros(3, np.int32)
    for args, pattern in (((a,), "expected 2 inputs"), ((a, idx, idx, idx), "expected 2 inputs"),
                          ((None, idx), "A: expected a torch tensor or numpy array"),
                          ((a, idx.astype(np.float32)), "idx: expected dtype int32"),
                          ((np.ones((2, 2), np.float32), idx), "A: expected 1 dimensions")):
        with pytest.raises(tilehal.TileStackError, match=pattern):
            k(*args)
