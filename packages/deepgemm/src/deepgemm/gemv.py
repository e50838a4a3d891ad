"""bf16 GEMV for M = 1 (kernels/gemv_sm90.cuh): D[1, N] = C + a[1, K] @ B[N, K]^T, one pass over B.

At M = 1 a GEMM is a read of the weights: 7168 x 2048 bf16 is 29 MB, ~7 us at the H200's ~4.2 TB/s.
The split-K tile kernel gets there only through a reduction in L2 and a 64-row wgmma on one valid row;
this kernel streams each row of B with 16-byte loads, one warp per row (several warps per row when N is
too small to keep every SM's loads in flight), and reduces in a fixed order (deterministic).

`plan` returns the warps per row, or None (with the reason at DEBUG) when the call is not a GEMV this
kernel takes: M != 1, B not K-major, K not a multiple of 8, rows of B or the activations not 16-byte
aligned, D or C not contiguous. DEEPGEMM_GEMV=0 / 1 turns it off / on (A/B timing against split-K).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import tilehal
import torch

from . import plans

log = logging.getLogger("deepgemm")

KERNEL_NAME = "gemv_sm90.cuh"
OPTIONS = ("-std=c++17", "-lineinfo")
THREADS = 256  # 8 warps
RESIDENT_WARPS_PER_SM = 32  # 4 CTAs of 8 warps (__launch_bounds__(256, 4))


# On by default: H200 2026-12-02 (session 26 R1, docs/benchmarks/deepgemm_small_m_sweep_h200_s26_r1.json) the GEMV
# kernel beat split-K on 13 of DeepGEMM's 14 M = 1 rows (1.12-1.60x cuBLAS; split-K 0.89-1.10x) and tied the 235 MB one
# (1 x 7168 x 16384: 69.7 vs 69.0 us, both ~4 TB/s with the flush's write-back).
DEFAULT_ON = True


def allowed() -> bool:
    v = os.environ.get("DEEPGEMM_GEMV")
    return DEFAULT_ON if v is None else v != "0"


def warps_per_row(n: int, num_sms: int) -> int:
    """Fewest warps per row (1, 2, 4, 8) that give every SM a full set of resident warps, 8 at most."""
    w = 1
    while w < 8 and n * w < num_sms * RESIDENT_WARPS_PER_SM:
        w *= 2
    return w


@dataclass(frozen=True)
class GemvKey:
    n: int
    k: int
    warps_per_row: int
    out_bf16: bool
    has_c: bool
    c_bf16: bool = False

    @property
    def expression(self) -> str:
        out = "__nv_bfloat16" if self.out_bf16 else "float"
        ct = "__nv_bfloat16" if self.c_bf16 else "float"
        return (f"deepgemm::gemv_sm90<{self.n}, {self.k}, {self.warps_per_row}, {out}, "
                f"{'true' if self.has_c else 'false'}, {ct}>")

    def grid(self) -> int:
        return -(-self.n // (THREADS // 32 // self.warps_per_row))


def why_not(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None) -> str | None:
    """Why this call is not for the GEMV kernel (None: it is). a [M, K], b [N, K] bf16 on the GPU."""
    m, k = a.shape
    if m != 1:
        return f"M = {m}"
    if k % 8:
        return f"K = {k} is not a multiple of 8"
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return f"operands {a.dtype} / {b.dtype}"
    if k > 1 and a.stride(1) != 1:
        return f"a's K stride is {a.stride(1)}"
    if b.stride(1) != 1 and k > 1:
        return "b is MN-major"
    if (b.stride(0) * 2) % 16 or b.data_ptr() % 16 or a.data_ptr() % 16:
        return "b's rows or a are not 16-byte aligned"
    if not d.is_contiguous() or (c is not None and not c.is_contiguous()):
        return "d or c is not contiguous"
    return None


def key_for(n: int, k: int, d: torch.Tensor, c: torch.Tensor | None, num_sms: int) -> GemvKey:
    return GemvKey(n=n, k=k, warps_per_row=warps_per_row(n, num_sms), out_bf16=d.dtype == torch.bfloat16,
                   has_c=c is not None, c_bf16=c is not None and c.dtype == torch.bfloat16)


def kernel_source() -> str:
    return (Path(__file__).resolve().parent / "kernels" / KERNEL_NAME).read_text()


def compile_kernels(keys, extra_options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC-compile GEMV instantiations for sm_90a (no GPU needed; cached on disk by content)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_gemv_sm90",
                                options=OPTIONS + tuple(extra_options), name_expressions=[k.expression for k in keys])


@functools.lru_cache(maxsize=256)
def _kernel(key: GemvKey) -> tilehal.Kernel:
    return compile_kernels([key]).get_kernel(key.expression)


def gemv_bf16(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None, num_sms: int) -> None:
    """d[1, N] = c + a @ b.T for a call `why_not` accepted."""
    n, k = b.shape
    key = key_for(n, k, d, c, num_sms)
    log.debug("bf16 1x%dx%d: GEMV kernel, %d warp(s) per row", n, k, key.warps_per_row)
    kern, grid, args = _kernel(key), (key.grid(), 1, 1), [a, b, tilehal.Arg.i64(b.stride(0)), d, c]
    plans.note_launch(kern, grid, THREADS, args, 0, None)  # the host fast path replays it
    kern.launch(grid, THREADS, args)
