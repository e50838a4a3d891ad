"""Bad programs raise tilelang.CompileError naming the user's file:line and the offending code."""

import inspect

import pytest
import tilelang
import tilelang.language as T
from tilelang import CompileError

THIS_FILE = __file__


def _line_of(fn, needle):
    lines, start = inspect.getsourcelines(fn)
    for i, text in enumerate(lines):
        if needle in text:
            return start + i
    raise AssertionError(needle)


def _check(exc, fn, needle, *words):
    msg = str(exc.value)
    assert f"{THIS_FILE}:{_line_of(fn, needle)}" in msg, msg
    assert needle.strip() in msg, msg
    for w in words:
        assert w in msg, msg
    assert exc.value.loc.lineno == _line_of(fn, needle)


def test_copy_wrong_shape():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64, 64), "float32")):
            with T.Kernel(1) as bx:
                S = T.alloc_shared((32, 32), "float32")
                T.copy(A[0:16, 0:32], S)
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "T.copy(A[0:16, 0:32], S)", "shape mismatch", "(16, 32)", "(32, 32)")


def test_copy_wrong_rank():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64, 64), "float32")):
            with T.Kernel(1) as bx:
                S = T.alloc_shared((32, 32), "float32")
                T.copy(A[0, 0, 0], S)
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "T.copy(A[0, 0, 0], S)", "rank 2", "3 index")


def test_copy_rank_too_small_for_tile():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                S = T.alloc_shared((8, 8), "float32")
                T.copy(A[0], S)
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "T.copy(A[0], S)", "wrong rank")


def test_gemm_shape_mismatch():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64, 64), "float32")):
            with T.Kernel(1) as bx:
                a = T.alloc_shared((32, 16), "float32")
                b = T.alloc_shared((32, 32), "float32")
                c = T.alloc_fragment((32, 32), "float32")
                T.gemm(a, b, c)
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "T.gemm(a, b, c)", "T.gemm: shape mismatch", "32x16")


def test_unknown_T_name():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                T.frobnicate(A)
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "T.frobnicate(A)", "unknown name T.frobnicate")


@pytest.mark.parametrize("construct,needle", [
    ("while", "while A[0] > 0.0:"),
    ("try", "try:"),
])
def test_unsupported_construct(construct, needle):
    def prog_while():  # `while` is supported; `while ... else` is not
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                while A[0] > 0.0:
                    A[0] = A[0] - 1.0
                else:
                    A[1] = 1.0
        return main

    def prog_try():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                try:
                    A[0] = 1.0
                finally:
                    pass
        return main

    prog = prog_while if construct == "while" else prog_try
    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, needle, "unsupported Python construct")


def test_return_rejected():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                return A
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "return A", "unsupported Python construct")


def test_undefined_name():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                A[0] = not_defined_anywhere  # noqa: F821
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "A[0] = not_defined_anywhere", "not defined")


def test_local_out_of_bounds_static():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                s = T.alloc_fragment((16,), "float32")
                for i in T.Parallel(32):
                    s[i] = 0.0
        return main

    with pytest.raises(CompileError) as e:
        prog()
    assert "out of bounds" in str(e.value)
    assert str(e.value.loc).startswith(THIS_FILE)


def test_statement_used_as_expression():
    def prog():
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1) as bx:
                x = T.copy(A, A)
        return main

    with pytest.raises(CompileError) as e:
        prog()
    _check(e, prog, "x = T.copy(A, A)", "statement, not an expression")


def test_compile_error_is_tilehal_compile_error():
    import tilehal

    assert issubclass(CompileError, tilehal.CompileError)


def test_runtime_argument_checks():
    @T.prim_func
    def main(A: T.Tensor((8, 4), "float32"), B: T.Tensor((8, 4), "float32")):
        with T.Kernel(1) as bx:
            for i, j in T.Parallel(8, 4):
                B[i, j] = A[i, j]

    import numpy as np
    import tilehal

    k = tilelang.compile(main, out_idx=[1], target="interp")
    with pytest.raises(tilehal.ShapeError, match=r"A: expected shape \(8, 4\), got \(4, 8\)"):
        k(np.zeros((4, 8), np.float32))
    with pytest.raises(tilehal.ShapeError, match="A: expected dtype float32, got float64"):
        k(np.zeros((8, 4)))
    with pytest.raises(ValueError, match="target"):
        tilelang.compile(main, target="tpu")
    kc = tilelang.compile(main, out_idx=[1], target="cuda")  # builds the cubin without a GPU
    assert "__global__" in kc.get_kernel_source()
    with pytest.raises(tilehal.ShapeError, match="A: expected device cuda, got cpu"):
        kc(np.zeros((8, 4), np.float32))
