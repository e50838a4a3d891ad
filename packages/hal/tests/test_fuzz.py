"""Fuzz tilehal's public argument handling: every input either gives the reference result or a
TileStackError naming the argument; never a crash, a raw numpy/torch exception or an overrun."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilehal import Arg, ArgumentError, ShapeError, TileStackError, calc_diff, check_tensor, get_dtype

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

FLOAT_DTYPES = [np.float16, np.float32, np.float64]
values = st.sampled_from([0.0, 1.0, -2.5, 1e30, -1e-30, math.nan, math.inf, -math.inf, 3.0, 7.25])


@st.composite
def arrays(draw, dtypes=FLOAT_DTYPES):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(dtypes))
    flat = draw(st.lists(values, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    with np.errstate(over="ignore"):
        a = np.array(flat, dtype=np.float64).astype(dtype).reshape(shape)
    if draw(st.booleans()) and a.ndim >= 1 and a.shape[-1] > 1:
        a = a[..., ::2]  # a strided view
    if draw(st.booleans()):
        a = a.T
    return a


def _message_names(err: Exception, *names: str) -> bool:
    return any(n in str(err) for n in names)


@FUZZ
@given(x=arrays(), y=arrays())
def test_calc_diff_matches_the_float64_reference_or_names_the_shapes(x, y):
    try:
        got = calc_diff(x, y)
    except ShapeError as e:
        assert x.shape != y.shape and _message_names(e, "calc_diff")
        return
    a, b = x.astype(np.float64), y.astype(np.float64)
    with np.errstate(all="ignore"):
        denom = float((a * a + b * b).sum())
        want = 0.0 if denom == 0.0 else float(1.0 - 2.0 * (a * b).sum() / denom)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12, abs=1e-12)


@FUZZ
@given(x=arrays(FLOAT_DTYPES + [np.int32, np.int8]), want=st.sampled_from(["float32", "int32", "bf16", "nope"]),
       contiguous=st.booleans(), ndim=st.none() | st.integers(0, 4))
def test_check_tensor_accepts_or_names_the_argument(x, want, contiguous, ndim):
    try:
        out = check_tensor(x, "q", dtype=want, contiguous=contiguous, ndim=ndim)
    except ArgumentError as e:
        assert want == "nope" and _message_names(e, "dtype")
        return
    except ShapeError as e:
        assert str(e).startswith("q: ")
        return
    assert out is x
    assert get_dtype(x.dtype) == get_dtype(want)
    assert not contiguous or x.flags["C_CONTIGUOUS"]
    assert ndim is None or x.ndim == ndim


@FUZZ
@given(v=st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1])),
       kind=st.sampled_from(["i32", "u32", "i64", "u64"]))
def test_integer_args_never_wrap(v, kind):
    lo, hi = {"i32": (-(2**31), 2**31), "u32": (0, 2**32), "i64": (-(2**63), 2**63), "u64": (0, 2**64)}[kind]
    try:
        arg = getattr(Arg, kind)(v)
    except ArgumentError as e:
        assert _message_names(e, f"Arg.{kind}")
        assert isinstance(v, (bool, float)) or not lo <= v < hi
        return
    assert isinstance(v, int) and not isinstance(v, bool) and arg.obj.value == v


@FUZZ
@given(x=st.sampled_from([None, 0, 1.5, True, "float32", "fp8", "bogus", np.float32, np.complex64, object(), [],
                          "torch.bfloat16", np.dtype("int16"), "  Half "]))
def test_get_dtype_returns_a_row_or_names_dtype(x):
    try:
        d = get_dtype(x)
    except TileStackError as e:
        assert isinstance(e, ArgumentError) and _message_names(e, "dtype")
        return
    assert d.name in {"float32", "float8_e4m3", "bfloat16", "int16", "float16"}


@pytest.fixture(scope="module")
def summer(tmp_path_factory):
    pytest.importorskip("cffi")
    from tilehal import compile_c
    from tilehal.testing import environ

    root = tmp_path_factory.mktemp("fuzzcache")
    with environ({"TILESTACK_CACHE_DIR": str(root / "cache"), "TILESTACK_CACHE_KEY_FILE": str(root / "cache.key")}):
        yield compile_c("double total(const double *x, long n) { double s = 0; for (long i = 0; i < n; i++) s += x[i];"
                        " return s; }", "double total(const double *x, long n);", name="fuzz_total")


@FUZZ
@given(x=arrays([np.float64]))
def test_ptr_reads_exactly_the_array_or_refuses_a_strided_view(summer, x):
    try:
        p = summer.ptr(x)
    except ShapeError as e:
        assert not x.flags["C_CONTIGUOUS"] and str(e).startswith("x: expected a C-contiguous")
        return
    got = summer.lib.total(p, x.size)
    with np.errstate(all="ignore"):
        want = float(np.sum(x, dtype=np.float64))
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-9, abs=1e-300)
