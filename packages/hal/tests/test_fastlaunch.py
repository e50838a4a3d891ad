"""LaunchPlan (tilehal.jit.fastlaunch) without a GPU: what a plan packs must be byte-for-byte what the
checked slow path passes (ctypes objects built by launch._to_ctype), and every argument it cannot
vouch for must be a MISS (the slow path then raises its error)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tilehal import Arg
from tilehal.jit import fastlaunch
from tilehal.jit.launch import _to_ctype

torch = pytest.importorskip("torch")  # tilehal installs without torch (nox -s isolation)


class Rec:
    """A fake cuLaunchKernel recording the launch and the bytes every parameter pointer points to."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.calls = []

    def __call__(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        arr = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        blobs = [ctypes.string_at(arr[i], n) for i, n in enumerate(self.sizes)]
        self.calls.append(((fn, gx, gy, gz, bx, by, bz, smem, stream), blobs))
        return 0


class Point(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int32), ("y", ctypes.c_double), ("tag", ctypes.c_uint8)]


def _expected(args):
    objs = [_to_ctype(i, a, -1) if not isinstance(a, torch.Tensor) else ctypes.c_void_p(a.data_ptr())
            for i, a in enumerate(args)]
    return [bytes(o) for o in objs]


def _plan(args, grid=(3, 2, 1), block=(128, 1, 1), smem=4096):
    rec = Rec([len(b) for b in _expected(args)])
    plan = fastlaunch.build_plan(args, 0xABC, grid, block, smem, rec, torch.Tensor, Arg)
    return plan, rec


def _mixed():
    t = torch.arange(8, dtype=torch.float32)
    return [t, t[2:], 7, -3, 2.5, True, None, b"\x01" * 128, bytearray(b"\x02" * 64), Arg.i64(2**40),
            Arg.u32(2**32 - 1), Arg.f64(0.1), Arg.ptr(0), Arg.raw(bytes(range(128))), np.int64(-5), np.float32(1.5),
            ctypes.c_uint16(65535), Point(1, 2.0, 3), Arg(Point(-4, 0.5, 9))]


def test_plan_packs_what_the_slow_path_passes():
    args = _mixed()
    plan, rec = _plan(args)
    assert plan.go(args, -1, 0x55) == 0
    (launch, blobs), = rec.calls
    assert launch == (0xABC, 3, 2, 1, 128, 1, 1, 4096, 0x55)
    assert blobs == _expected(args)


def test_plan_repacks_new_values_each_call():
    t = torch.zeros(4)
    plan, rec = _plan([t, 1, 1.0, Arg.i64(1)])
    u = torch.ones(16)
    for args in ([u, 2, -0.5, Arg.i64(-(2**62))], [t[1:], -(2**31), 3e38, Arg.i64(0)]):
        assert plan.go(args, -1, 1) == 0
        assert rec.calls[-1][1] == _expected(args)


@pytest.mark.parametrize("bad, why", [
    ([torch.zeros(4), 1, 1.0], "argument count"),
    ([torch.zeros(4), 1, 1.0, 2, 3], "argument count"),
    ([torch.zeros(4, dtype=torch.int32).numpy(), 1, 1.0, Arg.i64(1)], "type of a tensor slot"),
    ([torch.zeros(4), 1.0, 1.0, Arg.i64(1)], "float in an int slot"),
    ([torch.zeros(4), True, 1.0, Arg.i64(1)], "bool in an int slot"),
    ([torch.zeros(4), 2**31, 1.0, Arg.i64(1)], "int32 overflow"),
    ([torch.zeros(4), 1, 1.0, Arg.i32(1)], "Arg of another C type"),
    ([torch.zeros(4), 1, 1e39, Arg.i64(1)], "float32 overflow"),
])
def test_plan_misses_what_it_cannot_vouch_for(bad, why):
    plan, rec = _plan([torch.zeros(4), 1, 1.0, Arg.i64(1)])
    assert plan.go(bad, -1, 0) == fastlaunch.MISS, why
    assert rec.calls == []


def test_plan_misses_on_another_device_or_bytes_length():
    plan, rec = _plan([torch.zeros(4), b"x" * 128])
    assert plan.go([torch.zeros(4), b"x" * 128], 0, 0) == fastlaunch.MISS  # tensors on cpu (-1), plan for cuda:0
    assert plan.go([torch.zeros(4), b"x" * 64], -1, 0) == fastlaunch.MISS
    assert plan.go([torch.zeros(4), b"x" * 128], -1, 0) == 0
    assert len(rec.calls) == 1


def test_plan_without_arguments_and_error_codes_pass_through():
    rec = Rec([])
    plan = fastlaunch.build_plan([], 1, (1, 1, 1), (32, 1, 1), 0, rec, torch.Tensor, Arg)
    assert plan.go([], -1, 0) == 0 and len(rec.calls) == 1
    assert plan.go([1], -1, 0) == fastlaunch.MISS

    def fails(*a):
        return 700

    plan = fastlaunch.build_plan([3], 1, (1, 1, 1), (32, 1, 1), 0, fails, torch.Tensor, Arg)
    assert plan.go([4], -1, 0) == 700


def test_parameters_are_aligned():
    args = [True, b"\x07" * 128, Arg.u64(5), np.int16(3), 1.0, Arg.f64(2.0)]
    rec = Rec([len(b) for b in _expected(args)])
    plan = fastlaunch.build_plan(args, 1, (1, 1, 1), (32, 1, 1), 0, rec, torch.Tensor, Arg)
    ptrs = [plan._ptrs[i] for i in range(len(args))]
    for p, b in zip(ptrs, _expected(args)):
        assert p % min(16, max(1, len(b) if len(b) in (1, 2, 4, 8) else 16)) == 0


def test_unplannable_argument_is_reported():
    with pytest.raises(fastlaunch.Unplannable):
        fastlaunch.build_plan([np.float16(1)], 1, (1, 1, 1), (32, 1, 1), 0, Rec([2]), torch.Tensor, Arg)


@given(st.lists(st.one_of(st.integers(-(2**31), 2**31 - 1), st.floats(width=32, allow_nan=False),
                          st.integers(0, 2**64 - 1).map(Arg.u64), st.binary(min_size=16, max_size=16)),
                min_size=1, max_size=12))
def test_plan_matches_ctypes_for_any_scalars(args):
    plan, rec = _plan(args)
    assert plan.go(args, -1, 0) == 0
    assert rec.calls[-1][1] == _expected(args)


@given(st.integers(0, 232448), st.integers(0, 8192))
def test_needs_smem_optin(dynamic, static):
    """The opt-in is needed exactly when static + dynamic shared memory exceeds the default 48 KiB."""
    from tilehal.jit.launch import needs_smem_optin

    assert needs_smem_optin(dynamic, static) == (dynamic > 0 and dynamic + static > 48 * 1024)
    assert needs_smem_optin(48 * 1024, 1024) and not needs_smem_optin(48 * 1024, 0)
