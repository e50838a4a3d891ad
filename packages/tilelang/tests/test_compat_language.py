"""Public-TileLang spellings and language pieces added for compatibility (issue 13); every kernel is
checked on both targets against numpy."""

import numpy as np
import pytest
import tilelang
import tilelang.language as T


def test_cast_clamp_serial_spellings(target):
    @tilelang.jit(out_idx=[-1], target=target)
    def f(n, lo, hi):
        @T.prim_func
        def main(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "int32")):
            with T.Kernel(1) as _:
                for i in T.Serial(n):
                    B[i] = T.Cast(T.int32, T.clamp(A[i], lo, hi))
                for i in T.Unroll(2):
                    B[i] = B[i] + 100

        return main

    a = np.linspace(-5, 5, 9, dtype=np.float32)
    want = np.trunc(np.clip(a, -2.5, 3.0)).astype(np.int32)
    want[:2] += 100
    np.testing.assert_array_equal(f(9, -2.5, 3.0)(a), want)


def test_scalar_atomic_add_inside_parallel(target):
    """T.atomic_add(C[i, j], v) per lane (split-K's epilogue), including lanes that hit one element."""

    @tilelang.jit(target=target)
    def f(m, n, split):
        @T.prim_func
        def main(A: T.Tensor((split, m, n), "float32"), C: T.Tensor((m, n), "float32"),
                 R: T.Tensor((m,), "float32")):
            with T.Kernel(split) as bz:
                frag = T.alloc_fragment((m, n), "float32")
                T.copy(A[bz, 0, 0], frag)
                for i, j in T.Parallel(m, n):
                    T.atomic_add(C[i, j], frag[i, j])
                for i, j in T.Parallel(m, n):
                    T.atomic_add(R[i], frag[i, j])  # n lanes per element

        return main

    a = np.random.default_rng(0).standard_normal((3, 4, 8)).astype(np.float32)
    k = f(4, 8, 3)
    c, r = np.zeros((4, 8), np.float32), np.zeros(4, np.float32)
    k(a, c, r)
    np.testing.assert_allclose(c, a.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r, a.sum((0, 2)), rtol=1e-5, atol=1e-5)


def test_slice_with_offset_read_from_a_var(target):
    """X[off + r * b : off + (r + 1) * b] where `off` is a T.alloc_var: the extent is still b."""

    @tilelang.jit(out_idx=[-1], target=target)
    def f(n, b):
        @T.prim_func
        def main(X: T.Tensor((n,), "float32"), S: T.Tensor((2,), "int32"), Y: T.Tensor((b,), "float32")):
            with T.Kernel(1) as r:
                tile = T.alloc_fragment((b,), "float32")
                off = T.alloc_var(T.int32)
                off = 0
                for i in T.serial(2):
                    off += S[i]
                T.copy(X[off + r * b: off + (r + 1) * b], tile)
                T.copy(tile, Y)

        return main

    x = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(f(16, 4)(x, np.array([3, 2], np.int32)), x[5:9])


def test_loop_variable_does_not_shadow_a_dynamic_size(target):
    @tilelang.jit(target=target)
    def rowsum(A, block=4):
        k = T.dynamic("k")
        A: T.Tensor((8, k), "float32")
        Y = T.empty((8,), "float32")
        with T.Kernel(1) as _:
            acc = T.alloc_fragment((8,), "float32")
            T.clear(acc)
            for k in T.serial(T.ceildiv(A.shape[1], block)):  # noqa: B007 - the name clash is the test
                for i in T.Parallel(8):
                    for j in T.serial(block):
                        if k * block + j < A.shape[1]:
                            acc[i] += A[i, k * block + j]
            T.copy(acc, Y)
        return Y

    a = np.random.default_rng(1).standard_normal((8, 10)).astype(np.float32)
    np.testing.assert_allclose(rowsum(a), a.sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Serial", "Unroll", "Vectorized", "Cast", "clamp", "dtype", "const", "empty",
                                  "StridedTensor", "float", "double"])
def test_public_names_exist(name):
    assert name in T.__all__ and hasattr(T, name)


def test_two_kernels_through_an_alloc_global(target):
    """Split + combine: the first T.Kernel writes partial row sums into a T.alloc_global tensor, the second
    reduces them (each kernel its own C block, the workspace allocated per call and not returned)."""

    @tilelang.jit(out_idx=[-1], target=target)
    def rowsum(m, n, split):
        chunk = n // split

        @T.prim_func
        def main(A: T.Tensor((m, n), "float32"), Y: T.Tensor((m,), "float32")):
            part = T.alloc_global((split, m), "float32")
            with T.Kernel(split) as s:
                tile = T.alloc_fragment((m, chunk), "float32")
                acc = T.alloc_fragment((m,), "float32")
                T.copy(A[0, s * chunk], tile)
                T.reduce_sum(tile, acc, dim=1)
                T.copy(acc, part[s, 0])
            with T.Kernel(1) as _:
                parts = T.alloc_fragment((split, m), "float32")
                acc = T.alloc_fragment((m,), "float32")
                T.copy(part, parts)
                T.reduce_sum(parts, acc, dim=0)
                T.copy(acc, Y)

        return main

    k = rowsum(6, 32, 4)
    assert len(k.prim_func.params) == 3 and k.prim_func.workspace[0].name == "part"
    a = np.random.default_rng(2).standard_normal((6, 32)).astype(np.float32)
    for _ in range(2):  # the workspace starts at zero on every call
        np.testing.assert_allclose(k(a), a.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k(a, np.zeros(6, np.float32)), a.sum(1), rtol=1e-5, atol=1e-5)


def test_alloc_global_inside_a_kernel_is_an_error():
    with pytest.raises(tilelang.CompileError, match="outside `with T.Kernel`"):
        @T.prim_func
        def main(A: T.Tensor((4,), "float32")):
            with T.Kernel(1) as _:
                g = T.alloc_global((4,), "float32")
                g[0] = A[0]


def _topk_like(target, pass_configs=None):
    @tilelang.jit(target=target, pass_configs=pass_configs)
    def rowmax(X, blk_m):
        M, N = T.const("M, N")
        X: T.Tensor((M, N), "float32")
        Y = T.empty((M,), "float32")
        with T.Kernel(T.ceildiv(M, blk_m)) as bx:
            tile = T.alloc_fragment((blk_m, N), "float32")
            mx = T.alloc_fragment((blk_m,), "float32")
            T.copy(X[bx * blk_m, 0], tile)
            T.reduce_max(tile, mx, dim=1)
            for i in T.Parallel(blk_m):
                Y[bx * blk_m + i] = mx[i]  # the last block runs past M: those stores must be dropped
        return Y

    return rowmax


def test_out_of_bounds_global_stores_are_dropped(target):
    rowmax = _topk_like(target)
    x = np.random.default_rng(3).standard_normal((100, 16)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(rowmax(x, 64), x.max(1))
    if target == "cpu":
        src = rowmax.get_kernel_source(blk_m=64, M=100, N=16)
        assert "< 100" in src or "< 100LL" in src  # the bound test on Y's index


def test_safe_memory_pass_config_removes_the_guard():
    guarded = _topk_like("cpu").get_kernel_source(blk_m=64, M=100, N=16)
    bare = _topk_like("cpu", {tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}).get_kernel_source(
        blk_m=64, M=100, N=16)
    assert guarded.count("if (") > bare.count("if (")
    # M = 128: the grid (2 blocks) and the loop (64) prove Y's index < 128, so there is nothing to guard
    proved = _topk_like("cpu").get_kernel_source(blk_m=64, M=128, N=16)
    assert proved.count("if (") == bare.count("if (")


def test_views_on_tensor_storage(target):
    """T.Tensor(shape, dtype, buf.data) and T.reshape: read and write a tensor through another shape."""

    @tilelang.jit(target=target)
    def flat_scale(X, s):
        A, B = T.const("A, B")
        X: T.Tensor((A, B), "float32")
        Y = T.empty((A, B), "float32")
        with T.Kernel(1) as _:
            x_flat = T.Tensor((A * B,), "float32", X.data)
            y_flat = T.reshape(Y, (A * B,))
            tile = T.alloc_fragment((A * B,), "float32")
            T.copy(x_flat, tile)
            for i in T.Parallel(A * B):
                y_flat[i] = tile[i] * s
        return Y

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(flat_scale(x, 2.0), x * 2)
    k = flat_scale.compile(s=2.0, A=3, B=4)
    assert len(k.prim_func.views) == 2
    np.testing.assert_array_equal(k.get_profiler().inputs()[0].shape, (3, 4))  # views are not inputs


def test_view_errors():
    with pytest.raises(tilelang.CompileError, match="element counts differ"):
        @T.prim_func
        def bad(X: T.Tensor((3, 4), "float32")):
            with T.Kernel(1) as _:
                v = T.Tensor((13,), "float32", X.data)
                v[0] = 1.0


def test_im2col_matches_a_direct_convolution(target):
    n, h, w, c, f, ks, s, d, p = 2, 7, 6, 3, 4, 3, 2, 1, 1
    oh, ow = (h + 2 * p - d * (ks - 1) - 1) // s + 1, (w + 2 * p - d * (ks - 1) - 1) // s + 1
    bm, bk = 8, 16
    rows, kdim = n * oh * ow, ks * ks * c

    @tilelang.jit(out_idx=[-1], target=target)
    def conv():
        @T.prim_func
        def main(X: T.Tensor((n, h, w, c), "float32"), Wt: T.Tensor((kdim, f), "float32"),
                 Y: T.Tensor((rows, f), "float32")):
            with T.Kernel(T.ceildiv(rows, bm)) as by:
                cols = T.alloc_shared((bm, bk), "float32")
                wt = T.alloc_shared((bk, f), "float32")
                acc = T.alloc_fragment((bm, f), "float32")
                T.clear(acc)
                for ki in T.serial(T.ceildiv(kdim, bk)):
                    T.im2col(X, cols, by, ki, ks, s, d, p)
                    T.copy(Wt[ki * bk, 0], wt)
                    T.gemm(cols, wt, acc)
                T.copy(acc, Y[by * bm, 0])

        return main

    rng = np.random.default_rng(4)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = rng.standard_normal((ks, ks, c, f)).astype(np.float32)
    xp = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    ref = np.zeros((n, oh, ow, f), np.float64)
    for kh in range(ks):
        for kw in range(ks):
            patch = xp[:, kh * d: kh * d + s * (oh - 1) + 1: s, kw * d: kw * d + s * (ow - 1) + 1: s, :]
            ref += patch @ wt[kh, kw]
    y = conv()(x, wt.reshape(kdim, f))
    np.testing.assert_allclose(y, ref.reshape(rows, f), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mb, nb, wave, group", [(5, 3, 4, 2), (2, 7, 3, 8), (4, 4, 16, 8)])
def test_persistent_visits_every_tile_once(target, mb, nb, wave, group):
    @tilelang.jit(target=target)
    def visit():
        @T.prim_func
        def main(Count: T.Tensor((mb, nb), "int32")):
            with T.Kernel(wave) as block_id:
                for bx, by in T.Persistent([mb, nb], wave, block_id, group):
                    T.atomic_add(Count[bx, by], 1)

        return main

    count = np.zeros((mb, nb), np.int32)
    visit()(count)
    np.testing.assert_array_equal(count, np.ones((mb, nb), np.int32))


def test_carver_driver_num_sms():
    from tilelang.carver.arch import driver

    n = driver.get_num_sms()
    assert isinstance(n, int) and n >= 1


def test_bitwise_operators_on_ir_values(target):
    """Unpacking int4 pairs from uint8 (the dequantize examples' idiom), shifts, xor, ~, and & on conditions."""

    @tilelang.jit(out_idx=[-1], target=target)
    def unpack(n):
        @T.prim_func
        def main(P: T.Tensor((n,), "uint8"), M: T.Tensor((2 * n,), "int32"), Y: T.Tensor((2 * n,), "int32")):
            with T.Kernel(1) as _:
                for i in T.Parallel(2 * n):
                    b = T.Cast(T.int32, P[i // 2])
                    nib = (b >> ((i % 2) * 4)) & 0xF
                    signed = nib - ((nib & 0x8) << 1)  # int4 -> int32 sign extension
                    keep = (M[i] != 0) & (i < 2 * n - 1)
                    Y[i] = T.if_then_else(keep, signed ^ 0, ~signed) | 0

        return main

    rng = np.random.default_rng(5)
    p = rng.integers(0, 256, 16).astype(np.uint8)
    m = rng.integers(0, 2, 32).astype(np.int32)
    lo, hi = (p & 0xF).astype(np.int32), (p >> 4).astype(np.int32)
    nib = np.stack([lo, hi], 1).reshape(-1)
    signed = nib - ((nib & 8) << 1)
    keep = (m != 0) & (np.arange(32) < 31)
    np.testing.assert_array_equal(unpack(16)(p, m), np.where(keep, signed, ~signed))


def test_bitwise_on_floats_is_an_error():
    with pytest.raises(tilelang.CompileError, match="integer operands"):
        @T.prim_func
        def bad(A: T.Tensor((4,), "float32")):
            with T.Kernel(1) as _:
                A[0] = A[1] & A[2]


def test_while_loop_on_an_ir_condition(target):
    """Collatz step counts: a while loop whose trip count depends on the data."""

    @tilelang.jit(out_idx=[-1], target=target)
    def collatz(n):
        @T.prim_func
        def main(X: T.Tensor((n,), "int32"), S: T.Tensor((n,), "int32")):
            with T.Kernel(n) as i:
                x = T.alloc_var(T.int32)
                steps = T.alloc_var(T.int32)
                x = X[i]
                steps = 0
                while x != 1:
                    if (x & 1) == 0:
                        x = x >> 1
                    else:
                        x = 3 * x + 1
                    steps += 1
                S[i] = steps

        return main

    def ref(v):
        s = 0
        while v != 1:
            v = v // 2 if v % 2 == 0 else 3 * v + 1
            s += 1
        return s

    xs = np.array([1, 2, 3, 6, 7, 27, 97], np.int32)
    np.testing.assert_array_equal(collatz(7)(xs), [ref(int(v)) for v in xs])


def test_meta_level_while_and_assert():
    @tilelang.jit(out_idx=[-1], target="interp")
    def powers(n, limit):
        assert n >= 1, "n must be positive"

        @T.prim_func
        def main(Y: T.Tensor((n,), "int32")):
            with T.Kernel(1) as _:
                p = 1
                k = 0
                while p < limit:  # Python values: unrolled while parsing
                    Y[k] = p
                    p *= 2
                    k += 1

        return main

    np.testing.assert_array_equal(powers(4, 9)(), [1, 2, 4, 8])
    with pytest.raises(tilelang.CompileError, match="assertion failed"):
        @T.prim_func
        def bad(Y: T.Tensor((4,), "int32")):
            assert Y.shape[0] == 5
            with T.Kernel(1) as _:
                Y[0] = 1


def test_astype_on_ir_values(target):
    @tilelang.jit(out_idx=[-1], target=target)
    def f(n):
        @T.prim_func
        def main(A: T.Tensor((n,), "uint8"), B: T.Tensor((n,), "float32")):
            with T.Kernel(1) as _:
                for i in T.Parallel(n):
                    B[i] = (A[i] >> 4).astype("int32").astype(T.float32) * 0.5

        return main

    a = np.arange(0, 256, 17, dtype=np.uint8)
    np.testing.assert_array_equal(f(a.size)(a), (a >> 4).astype(np.float32) * 0.5)
