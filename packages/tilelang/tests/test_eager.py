"""The eager @tilelang.jit style: T.const / T.dynamic sizes, body annotations, T.empty outputs."""

import numpy as np
import pytest
import tilehal
import tilelang
import tilelang.language as T
import torch
from tilelang.runtime.eager import EagerJIT


def _make_scale(target):
    @tilelang.jit(target=target)
    def scale(X, factor, block=16, dtype=T.float32):
        M, N = T.const("M, N")
        X: T.Tensor((M, N), dtype)
        Y = T.empty((M, N), dtype)
        with T.Kernel(T.ceildiv(N, block), M) as (bx, by):
            for j in T.Parallel(block):
                if bx * block + j < N:
                    Y[by, bx * block + j] = X[by, bx * block + j] * factor
        return Y

    return scale


def test_eager_specializes_per_shape_and_caches(target):
    scale = _make_scale(target)
    assert isinstance(scale, EagerJIT) and scale.tensor_names == ["X"]
    x = torch.randn(3, 40)
    torch.testing.assert_close(scale(x, 2.0), x * 2.0)
    torch.testing.assert_close(scale(x + 1, 2.0), (x + 1) * 2.0)
    assert len(scale._kernels) == 1  # same shape, same meta arguments: one kernel
    y = torch.randn(5, 7)
    torch.testing.assert_close(scale(y, factor=-1.0), -y)
    assert len(scale._kernels) == 2
    pf = scale.get_tir(factor=2.0, M=5, N=7)
    assert [tuple(int(s.value) for s in p.shape) for p in pf.params] == [(5, 7), (5, 7)]


def test_eager_compile_with_sizes_returns_kernel(target):
    scale = _make_scale(target)
    k = scale.compile(M=4, N=33, factor=3.0)
    assert isinstance(k, tilelang.JITKernel)
    x = np.arange(4 * 33, dtype=np.float32).reshape(4, 33)
    np.testing.assert_array_equal(k(x), x * 3)
    with pytest.raises(tilehal.ShapeError):
        k(np.zeros((4, 34), np.float32))


def test_eager_dynamic_sizes_and_several_outputs(target):
    @tilelang.jit(target=target)
    def split_sign(A, block=8):
        n = T.dynamic("n")
        A: T.Tensor((n,), "float32")
        P = T.empty((n,), "float32")
        Q = T.empty((n,), "float32")
        with T.Kernel(T.ceildiv(n, block)) as bx:
            for i in T.Parallel(block):
                if bx * block + i < n:
                    P[bx * block + i] = T.max(A[bx * block + i], 0.0)
                    Q[bx * block + i] = T.min(A[bx * block + i], 0.0)
        return Q, P

    for n in (5, 19):
        a = torch.randn(n)
        q, p = split_sign(a)
        torch.testing.assert_close(p, a.clamp(min=0))
        torch.testing.assert_close(q, a.clamp(max=0))
    assert len(split_sign._kernels) == 1  # symbolic size: one kernel for every n
    assert split_sign.get_tir().dynamic_vars[0].name == "n"


def test_eager_in_place_output_and_meta_shape_logic():
    @tilelang.jit(target="interp")
    def add_into(A, B, trans=False):
        M, N = T.const("M N")
        shape = (N, M) if trans else (M, N)
        A: T.Tensor(shape, "float32")
        B: T.Tensor[shape, T.float32]
        with T.Kernel(1) as _:
            for i, j in T.Parallel(*shape):
                B[i, j] += A[i, j]

    a, b = np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)
    assert add_into(a, b) is None
    np.testing.assert_array_equal(b, a)
    add_into(a, b, trans=True)  # (N, M) = (2, 3): N=2, M=3
    np.testing.assert_array_equal(b, 2 * a)


def test_lazy_style_still_a_factory():
    @tilelang.jit(out_idx=[-1], target="interp")
    def f(n):
        @T.prim_func
        def main(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32")):
            with T.Kernel(1) as _:
                for i in T.Parallel(n):
                    B[i] = A[i] + 1.0

        return main

    assert not isinstance(f, EagerJIT)
    k = f.compile(4)
    np.testing.assert_array_equal(k(np.zeros(4, np.float32)), np.ones(4, np.float32))


def test_eager_errors():
    with pytest.raises(tilelang.CompileError, match="eager @tilelang.jit"):
        T.const("M")

    @tilelang.jit(target="interp")
    def unbound(A):
        M, K = T.const("M, K")
        A: T.Tensor((M,), "float32")
        B = T.empty((K,), "float32")
        with T.Kernel(1) as _:
            B[0] = A[0]
        return B

    with pytest.raises(tilelang.CompileError, match="T.empty: size K"):
        unbound(np.zeros(3, np.float32))

    @tilelang.jit(target="interp")
    def no_tensor_sizes(A):
        M = T.const("M")
        A: T.Tensor((M,), "float32")
        with T.Kernel(1) as _:
            A[0] = 1.0

    with pytest.raises(tilelang.CompileError, match="pass M= to .compile"):
        no_tensor_sizes.compile()

    @tilelang.jit(target="interp")
    def not_returned(A):
        A: T.Tensor((4,), "float32")
        B = T.empty((4,), "float32")
        with T.Kernel(1) as _:
            B[0] = A[0]

    with pytest.raises(tilelang.CompileError, match="not returned"):
        not_returned(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="missing tensor"):
        not_returned.__call__()
    with pytest.raises(ValueError, match="out_idx"):
        tilelang.jit(out_idx=[-1])(not_returned.fn)


def test_lazy_factory_calling_other_empty_is_not_eager():
    import numpy

    @tilelang.jit(out_idx=[-1], target="interp")
    def f(n):
        scratch = numpy.empty(n)  # not T.empty: this factory is lazy
        @T.prim_func
        def main(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32")):
            with T.Kernel(1) as _:
                for i in T.Parallel(n):
                    B[i] = A[i] + float(scratch.size)

        return main

    assert not isinstance(f, EagerJIT)
    np.testing.assert_array_equal(f(3)(np.zeros(3, np.float32)), np.full(3, 3, np.float32))
