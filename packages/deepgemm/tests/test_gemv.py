"""The M = 1 bf16 GEMV kernel: its plan and refusals (CPU), an NVRTC sm_90a compile of every instantiation
DeepGEMM's M = 1 shapes and the odd shapes below use (CPU, runs in CI), and the kernel against a float64
reference computed here (GPU)."""

import logging

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import gemv
from deepgemm.gemv import GemvKey, warps_per_row

UPSTREAM_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048),
               (256, 7168), (129280, 7168)]
FP32_OUT_NK = {(256, 7168), (129280, 7168)}
ODD_NK = [(1000, 264), (129, 8), (7, 4104), (3, 16)]  # N not a multiple of the CTA's rows; K not of 256


@pytest.mark.parametrize("n", [1, 7, 256, 576, 2112, 4096, 7168, 129280])
def test_warps_per_row_fill_the_sms(n):
    w = warps_per_row(n, 132)
    assert w in (1, 2, 4, 8)
    # the fewest warps per row that reach 32 resident warps per SM, capped at 8
    assert n * w >= 132 * gemv.RESIDENT_WARPS_PER_SM or w == 8
    assert w == 1 or n * (w // 2) < 132 * gemv.RESIDENT_WARPS_PER_SM


def test_key_grid_covers_every_row():
    for n in (1, 7, 8, 9, 1000, 129280):
        key = GemvKey(n, 64, warps_per_row(n, 132), True, False)
        rows_per_cta = 8 // key.warps_per_row
        assert (key.grid() - 1) * rows_per_cta < n <= key.grid() * rows_per_cta


def test_why_not_names_the_reason():
    a = torch.zeros(1, 64, dtype=torch.bfloat16)
    b = torch.zeros(32, 64, dtype=torch.bfloat16)
    d = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert gemv.why_not(a, b, d, None) is None
    assert "M = 2" in gemv.why_not(torch.zeros(2, 64, dtype=torch.bfloat16), b, d, None)
    assert "multiple of 8" in gemv.why_not(a[:, :60], b[:, :60], d, None)
    assert "MN-major" in gemv.why_not(a, torch.zeros(64, 32, dtype=torch.bfloat16).T, d, None)
    assert "16-byte" in gemv.why_not(a, torch.zeros(32, 68, dtype=torch.bfloat16)[:, :64], d, None)
    assert "contiguous" in gemv.why_not(a, b, torch.zeros(1, 64, dtype=torch.bfloat16)[:, ::2], None)


def compile_keys():
    keys = set()
    for n, k in UPSTREAM_NK:
        out_bf16 = (n, k) not in FP32_OUT_NK
        w = warps_per_row(n, 132)
        keys.add(GemvKey(n, k, w, out_bf16, False))
        keys.add(GemvKey(n, k, w, out_bf16, True, c_bf16=out_bf16))  # DeepGEMM's acc rows: C = D
    for n, k in ODD_NK:
        for w in (1, 8):
            keys.add(GemvKey(n, k, w, False, True))
            keys.add(GemvKey(n, k, w, True, True, c_bf16=True))
    return sorted(keys, key=lambda x: x.expression)


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_gemv_kernels_compile_without_spills(h):
    keys = compile_keys()
    assert len(keys) >= 20
    h.check_compiled_batches(gemv.compile_kernels, keys)


# ----------------------------------------------------------------------------- GPU


def _operands(n, k, seed, out=torch.bfloat16, c_dtype=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((1, k), generator=g, device="cuda").bfloat16()
    b = torch.randn((n, k), generator=g, device="cuda").bfloat16()
    c = None if c_dtype is None else torch.randn((1, n), generator=g, device="cuda").to(c_dtype)
    return a, b, torch.empty(1, n, dtype=out, device="cuda"), c


def _want(a, b, c):
    out = a.double() @ b.double().T  # float64 on the GPU: an independent reference
    return out if c is None else out + c.double()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", UPSTREAM_NK)
@pytest.mark.parametrize("acc", [False, True])
def test_gemv_upstream_shapes(n, k, acc, caplog, monkeypatch):
    monkeypatch.setenv("DEEPGEMM_GEMV", "1")
    out = torch.float32 if (n, k) in FP32_OUT_NK else torch.bfloat16
    a, b, d, _ = _operands(n, k, seed=n + k)
    c = torch.randn(1, n, device="cuda").to(out) if acc else None
    want = _want(a, b, c)
    if acc:
        d.copy_(c)
        c = d  # DeepGEMM's accumulation: C is D
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d, c=c)
    assert any("GEMV kernel" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", ODD_NK)
@pytest.mark.parametrize("w", [1, 8])
@pytest.mark.parametrize("out,c_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_gemv_forced_warps_odd_shapes(n, k, w, out, c_dtype):
    a, b, d, c = _operands(n, k, seed=w, out=out, c_dtype=c_dtype)
    key = GemvKey(n, k, w, out == torch.bfloat16, c is not None, c_dtype == torch.bfloat16)
    gemv._kernel(key).launch((key.grid(), 1, 1), gemv.THREADS, [a, b, tilehal.Arg.i64(b.stride(0)), d, c])
    want = _want(a, b, c)
    tol = 1e-2 if out == torch.bfloat16 else 1e-4
    torch.testing.assert_close(d.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.gpu
def test_gemv_strided_rows_and_activation(monkeypatch):
    monkeypatch.setenv("DEEPGEMM_GEMV", "1")
    # b's rows 16-byte aligned but longer than K (a slice of a wider weight); a a row of a larger batch
    big_b = torch.randn(2112, 7168 + 64, device="cuda").bfloat16()
    big_a = torch.randn(4, 7168, device="cuda").bfloat16()
    a, b = big_a[2:3], big_b[:, :7168]
    d = torch.empty(1, 2112, dtype=torch.bfloat16, device="cuda")
    assert gemv.why_not(a, b, d, None) is None
    deepgemm.bf16_gemm_nt(a, b, d)
    assert deepgemm.testing.calc_diff(d, _want(a, b, None)) < 1e-5


@pytest.mark.gpu
def test_gemv_refused_shapes_fall_back(caplog, monkeypatch):
    monkeypatch.setenv("DEEPGEMM_GEMV", "1")
    a, _, d, _ = _operands(576, 7168, seed=1)
    b = torch.randn(7168, 576, device="cuda").bfloat16().T  # MN-major B: the tile kernel reads it in place
    assert "MN-major" in gemv.why_not(a, b, d, None)
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d)
    msgs = [r.getMessage() for r in caplog.records]
    assert not any("GEMV kernel," in t for t in msgs) and any("read in place" in t for t in msgs), msgs
    assert deepgemm.testing.calc_diff(d, _want(a, b, None)) < 1e-5


@pytest.mark.gpu
def test_gemv_deterministic_in_a_graph_and_off_switch(monkeypatch, caplog, h):
    monkeypatch.setenv("DEEPGEMM_GEMV", "1")
    a, b, d, _ = _operands(4096, 7168, seed=4)
    h.check_graph_replay(lambda: deepgemm.bf16_gemm_nt(a, b, d), d, "GEMV graph replay")
    want = d.clone()
    monkeypatch.setenv("DEEPGEMM_GEMV", "0")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d)
    assert any("DEEPGEMM_GEMV is off" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, want.double()) < 1e-5
