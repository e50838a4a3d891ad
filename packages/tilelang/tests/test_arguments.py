"""tilelang's runtime entry points, each argument replaced in turn by a bad value (wrong type, NaN, 0,
-1, huge, empty / NaN tensors): the call succeeds or raises a TileStackError naming the argument,
never a raw Python/numpy exception or a hang (issue 16, item 7). Definition-time errors of the
language itself are CompileErrors with file:line (test_errors.py)."""

import numpy as np
import pytest
import tilelang
import tilelang.language as T
from tilehal.testing import probe_arguments


def _func():
    N = T.dynamic("N")

    @T.prim_func
    def add1(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, 8)) as bx:
            for i in T.Parallel(8):
                B[bx * 8 + i] = A[bx * 8 + i] + 1.0

    return add1


_FUNC = _func()

CASES = {
    "compile": lambda: (tilelang.compile, dict(func=_FUNC, out_idx=[1], target="interp", pass_configs=None)),
    "jit": lambda: (tilelang.jit, dict(out_idx=[1], target="interp", pass_configs=None)),
    "cdiv": lambda: (tilelang.cdiv, dict(a=7, b=2)),
    "next_power_of_2": lambda: (tilelang.next_power_of_2, dict(n=7)),
    "kernel call (interp)": lambda: (lambda A: tilelang.compile(_FUNC, out_idx=[1], target="interp")(A),
                                     dict(A=np.ones(5, np.float32))),
    "kernel call (cpu)": lambda: (lambda A, B: tilelang.compile(_FUNC, target="cpu")(A, B),
                                  dict(A=np.ones(5, np.float32), B=np.zeros(5, np.float32))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name):
    fn, kwargs = CASES[name]()
    fn(**kwargs)  # the baseline is valid
    assert probe_arguments(fn, kwargs) == []
