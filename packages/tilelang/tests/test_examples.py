"""Every example against torch, on both CPU targets. Tolerances: fp32 1e-4 abs-ish, fp16 outputs 2e-2."""

import pytest
import tilelang
import torch


def _build(factory, args, target):
    return tilelang.compile(factory.get_tir(*args), out_idx=factory.out_idx, target=target)


@pytest.mark.parametrize("shape", [(128, 128, 64), (100, 72, 40)])
def test_gemm(example, target, shape):
    m = example("gemm")
    M, N, K = shape
    k = _build(m.matmul, (M, N, K, 64, 64, 32), target)
    a, b = torch.randn(M, K), torch.randn(K, N)
    torch.testing.assert_close(k(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_gemm_numpy_inputs(example, target):
    import numpy as np

    m = example("gemm")
    k = _build(m.matmul, (64, 32, 48, 32, 32, 16), target)
    a = np.random.default_rng(0).standard_normal((64, 48), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((48, 32), dtype=np.float32)
    c = k(a, b)
    assert isinstance(c, np.ndarray)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_gemm_relu(example, target):
    m = example("gemm_relu")
    k = _build(m.matmul_relu, (100, 72, 40), target)
    a, b = torch.randn(100, 40).half(), torch.randn(40, 72).half()
    torch.testing.assert_close(k(a, b).float(), m.reference(a, b).float(), rtol=2e-2, atol=2e-2)


def test_elementwise_add(example, target):
    m = example("elementwise_add")
    k = _build(m.elementwise_add, (70, 130), target)
    a, b = torch.randn(70, 130), torch.randn(70, 130)
    torch.testing.assert_close(k(a, b), a + b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_softmax(example, target, dtype, tol):
    m = example("softmax")
    k = _build(m.softmax, (37, 96, 8, dtype), target)
    x = torch.randn(37, 96).to(getattr(torch, dtype))
    torch.testing.assert_close(k(x).float(), m.reference(x).float(), rtol=tol, atol=tol)


def test_rmsnorm(example, target):
    m = example("rmsnorm")
    k = _build(m.rms_norm, (13, 80), target)
    x, w = torch.randn(13, 80), torch.randn(80)
    torch.testing.assert_close(k(x, w), m.reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len", [128, 100])
def test_flash_attention(example, target, causal, seq_len):
    m = example("flash_attention")
    k = _build(m.flashattn, (1, 2, seq_len, 32, causal), target)
    q, kk, v = (torch.randn(1, seq_len, 2, 32).half() for _ in range(3))
    torch.testing.assert_close(k(q, kk, v).float(), m.reference(q, kk, v, causal).float(), rtol=2e-2, atol=2e-2)


def test_flash_attention_fp32_blocks(example, target):
    m = example("flash_attention")
    k = _build(m.flashattn, (2, 1, 96, 16, True, 32, 32, 1, 128, "float32"), target)
    q, kk, v = (torch.randn(2, 96, 1, 16) for _ in range(3))
    torch.testing.assert_close(k(q, kk, v), m.reference(q, kk, v, True), rtol=1e-4, atol=1e-4)
