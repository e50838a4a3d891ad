"""Language features on both targets against numpy: atomics, vars, macros, loop kinds, reductions, int8 gemm."""

import numpy as np
import pytest
import tilelang
import tilelang.language as T


def run(func, out_idx, target, *inputs):
    return tilelang.compile(func, out_idx=out_idx, target=target)(*inputs)


def test_atomic_add_tile_and_scalar(target):
    @T.prim_func
    def colsum(X: T.Tensor((40, 16), "float32"), S: T.Tensor((16,), "float32"), C: T.Tensor((1,), "int32")):
        with T.Kernel(5) as bx:
            tile = T.alloc_fragment((8, 16), "float32")
            part = T.alloc_fragment((16,), "float32")
            T.copy(X[bx * 8, 0], tile)
            T.reduce_sum(tile, part, dim=0)
            T.atomic_add(S[0:16], part)
            T.atomic_add(C[0], 1)

    x = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    s, c = run(colsum, [1, 2], target, x)
    np.testing.assert_allclose(s, x.sum(0), rtol=1e-5, atol=1e-5)
    assert c[0] == 5


def test_alloc_var_macro_serial_step_and_meta_loop(target):
    @T.macro
    def scale_row(buf, i, factor):
        for j in T.serial(0, 8, 2):
            buf[i, j] = buf[i, j] * factor

    @T.prim_func
    def prog(X: T.Tensor((4, 8), "float32"), Y: T.Tensor((4, 8), "float32"), Z: T.Tensor((1,), "float32")):
        with T.Kernel(1) as bx:
            t = T.alloc_fragment((4, 8), "float32")
            acc = T.alloc_var("float32", init=0.0)
            T.copy(X, t)
            for i in [0, 2]:
                scale_row(t, i, 3.0)
            for i in T.unroll(4):
                acc += t[i, 1]
            for i, j in T.grid(4, 8):
                if j % 2 == 1:
                    t[i, j] = -t[i, j]
                else:
                    t[i, j] = t[i, j] + 0.5
            T.copy(t, Y)
            Z[0] = acc

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    y, z = run(prog, [1, 2], target, x)
    ref = x.copy()
    ref[[0, 2], 0::2] *= 3
    zref = ref[:, 1].sum()
    ref[:, 1::2] *= -1
    ref[:, 0::2] += 0.5
    np.testing.assert_array_equal(y, ref)
    assert z[0] == zref


@pytest.mark.parametrize("kind", ["min", "abssum", "absmax", "max", "sum"])
def test_reductions_keepdim_and_dim0(target, kind):
    fn = getattr(T, f"reduce_{kind}")
    assert fn is not None

    @T.prim_func
    def red(X: T.Tensor((6, 10), "float32"), R1: T.Tensor((6, 1), "float32"), R0: T.Tensor((10,), "float32")):
        with T.Kernel(1) as bx:
            t = T.alloc_fragment((6, 10), "float32")
            r1 = T.alloc_fragment((6, 1), "float32")
            r0 = T.alloc_fragment((10,), "float32")
            T.copy(X, t)
            if kind == "min":
                T.reduce_min(t, r1, dim=1)
                T.reduce_min(t, r0, dim=0)
            elif kind == "abssum":
                T.reduce_abssum(t, r1, dim=1)
                T.reduce_abssum(t, r0, dim=0)
            elif kind == "absmax":
                T.reduce_absmax(t, r1, dim=1)
                T.reduce_absmax(t, r0, dim=0)
            elif kind == "max":
                T.reduce_max(t, r1, dim=-1)
                T.reduce_max(t, r0, dim=0)
            else:
                T.reduce_sum(t, r1, dim=1)
                T.reduce_sum(t, r0, dim=0)
            T.copy(r1, R1)
            T.copy(r0, R0)

    x = np.random.default_rng(1).standard_normal((6, 10)).astype(np.float32)
    r1, r0 = run(red, [1, 2], target, x)
    f = {"min": np.min, "max": np.max, "sum": np.sum, "abssum": lambda a, axis: np.abs(a).sum(axis),
         "absmax": lambda a, axis: np.abs(a).max(axis)}[kind]
    np.testing.assert_allclose(r1[:, 0], f(x, axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r0, f(x, axis=0), rtol=1e-5, atol=1e-6)


def test_int8_gemm_accumulates_in_int32(target):
    @T.prim_func
    def igemm(A: T.Tensor((16, 32), "int8"), B: T.Tensor((32, 8), "int8"), C: T.Tensor((16, 8), "int32")):
        with T.Kernel(1) as bx:
            a = T.alloc_shared((16, 32), "int8")
            b = T.alloc_shared((32, 8), "int8")
            c = T.alloc_fragment((16, 8), "int32")
            T.copy(A, a)
            T.copy(B, b)
            T.gemm(a, b, c, clear_accum=True)
            T.copy(c, C)

    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    b = rng.integers(-128, 128, (32, 8)).astype(np.int8)
    np.testing.assert_array_equal(run(igemm, [2], target, a, b), a.astype(np.int32) @ b.astype(np.int32))


def test_float64_and_transpose_a_gemm(target):
    @T.prim_func
    def g(A: T.Tensor((12, 20), "float64"), B: T.Tensor((12, 9), "float64"), C: T.Tensor((20, 9), "float64")):
        with T.Kernel(1) as bx:
            a = T.alloc_shared((12, 20), "float64")
            b = T.alloc_shared((12, 9), "float64")
            c = T.alloc_fragment((20, 9), "float64")
            T.copy(A, a)
            T.copy(B, b)
            T.clear(c)
            T.gemm(a, b, c, transpose_A=True)
            T.copy(c, C)

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((12, 20)), rng.standard_normal((12, 9))
    np.testing.assert_allclose(run(g, [2], target, a, b), a.T @ b, rtol=1e-12)


def test_cumsum_reverse_and_if_then_else_guard(target):
    @T.prim_func
    def cs(X: T.Tensor((5, 7), "float32"), Y: T.Tensor((5, 7), "float32")):
        with T.Kernel(1) as bx:
            t = T.alloc_fragment((8, 8), "float32")
            for i, j in T.Parallel(8, 8):
                t[i, j] = T.if_then_else(i < 5 and j < 7, X[i, j], 0.0)
            T.cumsum(t, dim=1, reverse=True)
            T.copy(t, Y[0, 0])

    x = np.random.default_rng(4).standard_normal((5, 7)).astype(np.float32)
    ref = np.flip(np.cumsum(np.flip(x, 1), 1), 1)
    np.testing.assert_allclose(run(cs, [1], target, x), ref, rtol=1e-5, atol=1e-6)


def test_swizzle_and_layout_annotations_are_recorded_and_harmless(target):
    from tilelang.layout import make_swizzled_layout

    @T.prim_func
    def copy2(X: T.Tensor((32, 32), "float32"), Y: T.Tensor((32, 32), "float32")):
        with T.Kernel(2, 2, threads=64) as (bx, by):
            s = T.alloc_shared((16, 16), "float32")
            T.annotate_layout({s: make_swizzled_layout(s)})
            T.use_swizzle(panel_size=4)
            T.copy(X[by * 16, bx * 16], s)
            T.copy(s, Y[by * 16, bx * 16])

    kernel_stmt = copy2.body.body[0]
    assert kernel_stmt.attrs["swizzle"] == (4, "row", True)
    assert kernel_stmt.threads == (64,)
    x = np.random.default_rng(5).standard_normal((32, 32)).astype(np.float32)
    np.testing.assert_array_equal(run(copy2, [1], target, x), x)
