"""@tile_kernel loop nests and tensor_contract against numpy/torch."""

import numpy as np
import pytest
import torch
from tilelang import CompileError, tensor_contract, tile_kernel


@pytest.mark.parametrize("target", ["interp", "cpu"])
def test_matmul_loop_nest_becomes_gemm(target):
    @tile_kernel(target=target)
    def matmul(A, B, C):
        for i in range(A.shape[0]):
            for j in range(B.shape[1]):
                for k in range(A.shape[1]):
                    C[i, j] += A[i, k] * B[k, j]

    a, b = torch.randn(70, 50), torch.randn(50, 40)
    c = torch.ones(70, 40)
    matmul(a, b, c)
    torch.testing.assert_close(c, 1 + a @ b, rtol=1e-4, atol=1e-4)
    assert "T.gemm" in matmul.kernel.prim_func.script()


def test_transposed_contraction_detected():
    @tile_kernel(target="cpu")
    def mm_t(A, B, C):
        for i in range(C.shape[0]):
            for j in range(C.shape[1]):
                for k in range(A.shape[0]):
                    C[i, j] += A[k, i] * B[j, k]

    a, b = np.random.rand(30, 20).astype(np.float32), np.random.rand(25, 30).astype(np.float32)
    c = np.zeros((20, 25), np.float32)
    mm_t(a, b, c)
    np.testing.assert_allclose(c, a.T @ b.T, rtol=1e-5, atol=1e-5)
    assert "transpose_A=True, transpose_B=True" in mm_t.kernel.prim_func.script()


@pytest.mark.parametrize("target", ["interp", "cpu"])
def test_elementwise_and_reductions(target):
    @tile_kernel(target=target)
    def axpy(X, Y, Z):
        for i in range(X.shape[0]):
            for j in range(X.shape[1]):
                Z[i, j] = 2.0 * X[i, j] + exp(Y[i, j])  # noqa: F821 - resolved by tile_kernel

    @tile_kernel(target=target)
    def row_max(X, R):
        for i in range(X.shape[0]):
            for j in range(X.shape[1]):
                R[i] = max(R[i], X[i, j])

    @tile_kernel(target=target)
    def col_sum(X, S):
        for i in range(X.shape[0]):
            for j in range(X.shape[1]):
                S[j] += X[i, j]

    x, y = np.random.rand(19, 131).astype(np.float32), np.random.rand(19, 131).astype(np.float32)
    z = np.zeros_like(x)
    axpy(x, y, z)
    np.testing.assert_allclose(z, 2 * x + np.exp(y), rtol=1e-6)
    r = np.full(19, -np.inf, np.float32)
    row_max(x, r)
    np.testing.assert_array_equal(r, x.max(1))
    s = np.zeros(131, np.float32)
    col_sum(x, s)
    np.testing.assert_allclose(s, x.sum(0), rtol=1e-5)


def test_tile_kernel_errors_cite_line():
    @tile_kernel
    def bad(X, Y):
        for i in range(X.shape[0]):
            Y[i] = X[i] if X[i] else 0.0

    with pytest.raises(CompileError, match="unsupported expression") as e:
        bad(np.zeros(4, np.float32), np.zeros(4, np.float32))
    assert e.value.loc.filename == __file__


def test_autotuned_tile_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))

    @tile_kernel(target="cpu", autotune=True)
    def matmul(A, B, C):
        for i in range(A.shape[0]):
            for j in range(B.shape[1]):
                for k in range(A.shape[1]):
                    C[i, j] += A[i, k] * B[k, j]

    a, b = np.random.rand(48, 40).astype(np.float32), np.random.rand(40, 36).astype(np.float32)
    c = np.zeros((48, 36), np.float32)
    matmul(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5)
    assert matmul.kernel.config in [{"block_M": 32, "block_N": 32, "block_K": 32},
                                    {"block_M": 64, "block_N": 64, "block_K": 32},
                                    {"block_M": 64, "block_N": 128, "block_K": 64},
                                    {"block_M": 128, "block_N": 128, "block_K": 32}]


@pytest.mark.parametrize("target", ["interp", "cpu"])
def test_tensor_contract(target):
    a = torch.randn(3, 5, 7)
    b = torch.randn(7, 4)
    out = tensor_contract(a, b, axes=[(-1, 0)], target=target)
    torch.testing.assert_close(out, torch.tensordot(a, b, dims=([2], [0])), rtol=1e-4, atol=1e-4)
    a2, b2 = np.random.rand(6, 3, 5).astype(np.float32), np.random.rand(5, 6, 2).astype(np.float32)
    out2 = tensor_contract(a2, b2, axes=[(0, 1), (2, 0)], target=target)
    np.testing.assert_allclose(out2, np.tensordot(a2, b2, axes=([0, 2], [1, 0])), rtol=1e-5)
    with pytest.raises(ValueError):
        tensor_contract(a, b, axes=[(0, 0)])


def test_tile_kernel_checks_bounds_before_running():
    import tilehal

    @tile_kernel(target="cpu")
    def shifted(X, Y):
        for i in range(X.shape[0]):
            Y[i] = X[i + 1]

    with pytest.raises(tilehal.ShapeError, match=r"X: dim 0 is indexed by i \+ 1 over \[1, 8\] but has size 8"):
        shifted(np.zeros(8, np.float32), np.zeros(8, np.float32))

    @tile_kernel(target="cpu")
    def shifted_ok(X, Y):
        for i in range(Y.shape[0]):
            Y[i] = X[i + 1] - X[i]

    x = np.arange(9, dtype=np.float32) ** 2
    y = np.zeros(8, np.float32)
    shifted_ok(x, y)
    np.testing.assert_array_equal(y, np.diff(x))
