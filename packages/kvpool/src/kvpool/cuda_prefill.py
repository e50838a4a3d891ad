"""CUDA paged prefill (kernels/paged_prefill.cuh): compilation, tile list and launch."""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path

import tilehal
import torch

from .pool import KVPool

log = logging.getLogger("kvpool.cuda_prefill")

KERNEL_DIR = Path(__file__).with_name("kernels")
HEAD_DIMS = (64, 128)
BN = 64  # kPrefillBN
WARP_CHOICES = (4, 8)
DEFAULT_WARPS = 8
MAX_GRID_Y = 65535
_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}


def default_warps() -> int:
    """Warps per CTA (16 query rows each): KVPOOL_PREFILL_WARPS, else DEFAULT_WARPS."""
    text = os.environ.get("KVPOOL_PREFILL_WARPS")
    if not text:
        return DEFAULT_WARPS
    if text not in {str(w) for w in WARP_CHOICES}:
        raise ValueError(f"KVPOOL_PREFILL_WARPS: expected one of {WARP_CHOICES}, got {text!r}")
    return int(text)


def kernel_name(dtype: torch.dtype, head_dim: int, warps: int) -> str:
    return f"kvpool::paged_prefill_kernel<{_CTYPES[dtype]}, {head_dim}, {warps}>"


def smem_bytes(dtype: torch.dtype, head_dim: int, warps: int) -> int:
    """Dynamic shared memory of one CTA (mirrors PrefillSmem): Q tile + 2 stages of K and of V."""
    row = head_dim * dtype.itemsize
    return 16 * warps * row + 4 * BN * row


@functools.cache
def compile_prefill(dtype: torch.dtype, head_dim: int, warps: int = DEFAULT_WARPS,
                    arch: str = "sm_90a") -> tilehal.CudaModule:
    return tilehal.compile_cuda('#include "paged_prefill.cuh"\n', arch=arch,
                                name=f"paged_prefill_{head_dim}_{warps}", include_dirs=[str(KERNEL_DIR)],
                                options=["--use_fast_math"], name_expressions=[kernel_name(dtype, head_dim, warps)])


def unsupported_reason(q: torch.Tensor, pool: KVPool) -> str | None:
    """Why the CUDA kernel cannot serve this call (None: it can)."""
    if pool.device.type != "cuda":
        return f"pool on {pool.device}"
    if pool.dtype not in _CTYPES:
        return f"pool dtype {pool.dtype} (kernel: bf16/fp16)"
    if q.dtype != pool.dtype:
        return f"q dtype {q.dtype} differs from the pool's {pool.dtype}"
    if pool.head_dim not in HEAD_DIMS:
        return f"head_dim {pool.head_dim} (kernel: {HEAD_DIMS})"
    return None


def tile_list(cu: list[int], lens: list[int], rows_per_tile: int) -> list[tuple[int, int]]:
    """(sequence, first new-token row) of every query tile, most kv work first."""
    tiles = []
    for b in range(len(lens)):
        n = cu[b + 1] - cu[b]
        prefix = lens[b] - n
        for i0 in range(0, n, rows_per_tile):
            tiles.append((prefix + i0 + min(rows_per_tile, n - i0), b, i0))
    tiles.sort(key=lambda x: -x[0])
    return [(b, i0) for _, b, i0 in tiles]


def paged_prefill_cuda(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, cu: list[int], lens: list[int],
                       scale: float | None, warps: int | None = None) -> torch.Tensor:
    """The kernel's launch; `cu` / `lens` are the host copies paged_prefill validated."""
    total, hq, d = q.shape
    warps = default_warps() if warps is None else warps
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    tiles = tile_list(cu, lens, 16 * warps)
    if not tiles:
        return out
    kern = compile_prefill(pool.dtype, d, warps).get_kernel(kernel_name(pool.dtype, d, warps))
    kc, vc = pool.layer_cache(layer)
    tt = torch.tensor(tiles, dtype=torch.int32).to(q.device, non_blocking=True)
    table = block_table.contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    cuq = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    qc = q.contiguous()
    smem = smem_bytes(pool.dtype, d, warps)
    for start in range(0, len(tiles), MAX_GRID_Y):
        chunk = tt[start:start + MAX_GRID_Y]
        kern.launch((hq, chunk.shape[0]), 32 * warps,
                    [qc, kc, vc, table, table.shape[1], sl, cuq, chunk, out, pool.num_kv_heads,
                     float(scale * math.log2(math.e)), pool.block_size], smem_bytes=smem)
    return out
