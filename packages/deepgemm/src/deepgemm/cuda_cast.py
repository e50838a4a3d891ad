"""Host side of the fused fp8 casts (kernels/fp8_cast.cuh): one launch per cast on CUDA tensors.

`per_token(x, gran_k, ue8m0, mn_major_sf)` and `per_block(x, ue8m0)` return what
deepgemm.utils.per_token_cast_to_fp8 / per_block_cast_to_fp8 return (bit-identical values), or
None where the fused kernel does not apply (the caller then runs the torch ops; DEBUG says why).
With `mn_major_sf` the per-token scales come back in the layout the GEMM kernels read (MN-major,
the M stride padded to 16 bytes: `is_mn_major_tma_aligned` holds), so fp8_gemm_nt needs no
transpose of sfa per call.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import tilehal
import torch

from .sizes import ceil_div, get_tma_aligned_size

log = logging.getLogger("deepgemm")

KERNEL_FILE = Path(__file__).resolve().parent / "kernels" / "fp8_cast.cuh"
_CTYPE = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}
THREADS = 256


def kernel_source() -> str:
    return KERNEL_FILE.read_text()


def token_expression(dtype: torch.dtype, gran_k: int, vec: bool) -> str:
    return f"deepgemm::per_token_cast<{_CTYPE[dtype]}, {gran_k}, {'true' if vec else 'false'}>"


def block_expression(dtype: torch.dtype, vec: bool) -> str:
    return f"deepgemm::per_block_cast<{_CTYPE[dtype]}, {'true' if vec else 'false'}>"


def silu_expression(dtype: torch.dtype, fp8: bool, vec: bool) -> str:
    return f"deepgemm::silu_mul<{_CTYPE[dtype]}, {'true' if fp8 else 'false'}, {'true' if vec else 'false'}>"


def all_expressions() -> list[str]:
    out = []
    for dt in _CTYPE:
        for vec in (True, False):
            out += [token_expression(dt, g, vec) for g in (32, 64, 128)] + [block_expression(dt, vec)]
            out += [silu_expression(dt, fp8, vec) for fp8 in (False, True)]
    return out


def compile_module(expressions: tuple[str, ...] | None = None, options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC module (sm_90a, cached on disk; no GPU needed) of `expressions` (default: all of them)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_fp8_cast",
                                options=("-std=c++17", *options),
                                name_expressions=list(expressions or all_expressions()))


@functools.lru_cache(maxsize=64)
def _kernel(expr: str) -> tilehal.Kernel:
    return compile_module((expr,)).get_kernel(expr)  # one instantiation per module: a short first compile


def _why_not(x: torch.Tensor, gran_k: int) -> str | None:
    if not x.is_cuda:
        return "not a CUDA tensor"
    if x.dtype not in _CTYPE:
        return f"dtype {x.dtype}"
    if x.dim() not in (2, 3):
        return f"{x.dim()} dimensions"
    if gran_k not in (32, 64, 128):
        return f"gran_k = {gran_k}"
    if x.stride(-1) != 1:
        return "non-unit stride along K"
    if x.dim() == 3 and x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return "groups not evenly strided"
    if x.numel() >= 2**31 or x.shape[-2] * ceil_div(x.shape[-1], 128) >= 2**31:
        return "more than 2^31 elements"
    return None


WARP_COLS = 256  # columns one warp covers (32 lanes x 8 elements)


def _vec(x: torch.Tensor, row_stride: int) -> bool:
    """16-byte vector loads: K, the row stride and the base address on 8-element / 16-byte boundaries."""
    k = x.shape[-1]
    return k % 8 == 0 and row_stride % 8 == 0 and x.data_ptr() % 16 == 0


_TOKEN_PLANS: dict[tuple, tuple] = {}


def per_token(x: torch.Tensor, gran_k: int, ue8m0: bool, mn_major_sf: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    # Per-signature plan (everything but the pointers): the cast runs before every fp8 GemmLinear call.
    key = (x.dtype, x.shape, x.stride(), x.get_device(), x.data_ptr() % 16 == 0, gran_k, ue8m0, mn_major_sf)
    plan = _TOKEN_PLANS.get(key)
    if plan is not None:
        kern, grid, qshape, sf_shape, sf_strides, tail = plan
        q = torch.empty(qshape, dtype=torch.float8_e4m3fn, device=x.device)
        sf = torch.empty_strided(sf_shape, sf_strides, dtype=torch.float32, device=x.device)
        if grid:
            kern.launch(grid, THREADS, (x, q, sf, *tail))
        return q, sf
    out = _per_token_checked(x, gran_k, ue8m0, mn_major_sf)
    if out is None:
        return None
    q, sf, plan = out
    if len(_TOKEN_PLANS) > 1024:
        _TOKEN_PLANS.clear()
    _TOKEN_PLANS[key] = plan
    return q, sf


def _per_token_checked(x: torch.Tensor, gran_k: int, ue8m0: bool, mn_major_sf: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, tuple] | None:
    why = _why_not(x, gran_k)
    if why is None and mn_major_sf and x.dim() != 2:
        why = "MN-major scales are built for 2-D inputs only"
    if why is not None:
        log.debug("per_token_cast_to_fp8: torch ops instead of the fused kernel (%s)", why)
        return None
    *lead, m, k = x.shape
    rows = m * (lead[0] if lead else 1)
    sk = ceil_div(k, gran_k)
    ldx = x.stride(-2) if x.dim() == 2 or x.shape[0] == 1 else x.stride(1)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if mn_major_sf:
        sf = torch.empty_strided((m, sk), (1, get_tma_aligned_size(m, 4)), dtype=torch.float32, device=x.device)
        rs, cs = 1, get_tma_aligned_size(m, 4)
    else:
        sf = torch.empty((*lead, m, sk), dtype=torch.float32, device=x.device)
        rs, cs = sk, 1
    kern = _kernel(token_expression(x.dtype, gran_k, _vec(x, ldx)))
    grid = ceil_div(rows * ceil_div(k, WARP_COLS), THREADS // 32) if rows and k else 0
    tail = (rows, k, tilehal.Arg.i64(ldx), tilehal.Arg.i64(rs), tilehal.Arg.i64(cs), bool(ue8m0))
    if grid:
        kern.launch(grid, THREADS, (x, q, sf, *tail))
    return q, sf, (kern, grid, tuple(q.shape), tuple(sf.shape), tuple(sf.stride()), tail)


def per_block(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    why = _why_not(x, 128)
    if why is not None:
        log.debug("per_block_cast_to_fp8: torch ops instead of the fused kernel (%s)", why)
        return None
    *lead, n, k = x.shape
    g = lead[0] if lead else 1
    sn, sk = ceil_div(n, 128), ceil_div(k, 128)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.empty((*lead, sn, sk), dtype=torch.float32, device=x.device)
    if n == 0 or k == 0 or g == 0:
        return q, sf
    ldx = x.stride(-2)
    ldg = x.stride(0) if x.dim() == 3 else n * ldx
    _kernel(block_expression(x.dtype, _vec(x, ldx) and ldg % 8 == 0)).launch(
        (sk, sn, g), THREADS, (x, q, sf, n, k, tilehal.Arg.i64(ldx), tilehal.Arg.i64(ldg), bool(ue8m0)))
    return q, sf


def silu_mul(x: torch.Tensor, fp8: bool, ue8m0: bool = False, mn_major_sf: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """y = silu(x[:, :f]) * x[:, f:] (fp32 math) for x [M, 2f]: bf16 [M, f], or with `fp8` its per-token
    cast (q [M, f], sf [M, ceil(f/128)]). None where the kernel does not apply (DEBUG says why)."""
    why = _why_not(x, 128)
    if why is None and (x.dim() != 2 or x.shape[-1] % 2):
        why = f"shape {tuple(x.shape)} (expected [M, 2f])"
    if why is not None:
        log.debug("silu_mul: torch ops instead of the fused kernel (%s)", why)
        return None
    m, f = x.shape[0], x.shape[1] // 2
    ldx = x.stride(0)
    sk = ceil_div(f, 128)
    if fp8:
        out = torch.empty((m, f), dtype=torch.float8_e4m3fn, device=x.device)
        if mn_major_sf:
            al = get_tma_aligned_size(m, 4)
            sf = torch.empty_strided((m, sk), (1, al), dtype=torch.float32, device=x.device)
            rs, cs = 1, al
        else:
            sf = torch.empty((m, sk), dtype=torch.float32, device=x.device)
            rs, cs = sk, 1
    else:
        out = torch.empty((m, f), dtype=torch.bfloat16, device=x.device)
        sf, rs, cs = None, 0, 0
    if m and f:
        vec = _vec(x, ldx) and f % 8 == 0
        _kernel(silu_expression(x.dtype, fp8, vec)).launch(
            ceil_div(m * ceil_div(f, WARP_COLS), THREADS // 32), THREADS,
            (x, out, sf, m, f, tilehal.Arg.i64(ldx), tilehal.Arg.i64(rs), tilehal.Arg.i64(cs), bool(ue8m0)))
    return (out, sf) if fp8 else out
