"""The CPU emulation of the generated CUDA (target cuda_emu) checks asynchronous copies: a cp.async
lands only at the cp_async_wait that retires its group (its destination reads as NaN before), so
a lowering that forgets a wait fails on the CPU instead of racing on the GPU."""

import importlib.util
import re
import sys
from pathlib import Path

import tilelang
import tilelang.backends.cuda.emulate as emulate
import torch


def _public_kernels():
    name = "tilelang_public_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("public_kernels.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _pipelined_gemm():
    # 3-stage cp.async pipeline over K: prologue of 2 prefetches, wait_group<1> in every iteration
    return _public_kernels().matmul.get_tir(64, 64, 128, 64, 64, 32, "float16", "float", 3, 128, False, "none")


def _run(func):
    torch.manual_seed(0)
    a, b, bias = torch.randn(64, 128).half(), torch.randn(128, 64).half(), torch.zeros(64).half()
    got = tilelang.compile(func, out_idx=[-1], target="cuda_emu")(a, b, bias)
    return got.float(), a.float() @ b.float()


def test_pipelined_copies_land_at_their_wait():
    func = _pipelined_gemm()
    # the cp.async form the emulator runs (on sm_90a the cuda target puts these copies on TMA)
    src = tilelang.compile(func, out_idx=[-1], target="cuda",
                           pass_configs={"tl.disable_tma_lower": True}).get_kernel_source()
    assert "cp_async_wait<1>" in src and "cp_async_commit" in src
    got, want = _run(func)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_missing_wait_reads_copies_still_in_flight(monkeypatch):
    real = emulate.generate_cuda

    def without_loop_waits(*args, **kwargs):  # drop the wait of every pipelined iteration
        src, kernels = real(*args, **kwargs)
        dropped = re.sub(r"tilehal::cp_async_wait<[1-9]\d*>\(\);", "", src)
        assert dropped != src
        return dropped, kernels

    monkeypatch.setattr(emulate, "generate_cuda", without_loop_waits)
    got, want = _run(_pipelined_gemm())
    assert torch.isnan(got).any(), "the emulator read a cp.async destination before its wait"
