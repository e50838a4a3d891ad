"""CUDA paged prefill: compilation, tile list and launch of kernels/paged_prefill.cuh (mma.sync,
FlashAttention-2 style; configs (warps, row blocks[, kv tokens[, stages]])) and
kernels/paged_prefill_wgmma.cuh (sm_90a wgmma with producer warps, FlashAttention-3 style; configs
("wg", consumer warpgroups, kv tokens, stages, producer warps[, "pp"][, "tma"])))."""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path

import tilehal
import torch

from .cuda_decode import dtype_reason
from .pool import KVPool

log = logging.getLogger("kvpool.cuda_prefill")

KERNEL_DIR = Path(__file__).with_name("kernels")
HEAD_DIMS = (64, 128)
BN = 64  # kPrefillBN: default kv tokens per pipeline stage (static_asserted at every compile)
# (warps per CTA, 16-row blocks per warp[, kv tokens per stage]): a CTA owns 16 * warps * row_blocks
# query rows. The n32 variants halve the S tile: at d128 with two row blocks per warp the n64 kernel
# spills 80 (w8x2) / 136 (w4x2) bytes (ptxas -v, NVRTC 13), the n32 ones do not.
CONFIGS = ((8, 1), (4, 1), (4, 2), (8, 2), (8, 2, 32), (4, 2, 32), (8, 2, 32, 3), (4, 2, 32, 3))
# w8x2 was fastest on every measured case (H200, 2026-12-01, docs/benchmarks/kvpool_prefill_run2.json:
# 32K prompt 35.6 ms vs w8x1 44.1; 4K on a 28K prefix 8.6 vs 10.9; 8 x 4K 5.0 vs 6.0) despite
# ptxas spilling ~100 bytes at d128: two 16-row blocks per warp halve the K/V shared-memory reads.
CP_ASYNC_CONFIG = (8, 2)
# wgmma kernels: ("wg", consumer warpgroups of 64 query rows, kv tokens per stage, stages, producer warps[,
# "pp": the two warpgroups take turns on the tensor cores]). Opt-in (KVPOOL_PREFILL_KERNEL): on the
# H200 (2026-12-02 R3, 1 x 32K causal) wg2n64s6p4pp 47.8 ms and wg2n64s4p2 78.0 ms against w8x2's
# 35.3 ms (R1): producer-bound (two producer warps -> four: 78 -> 48 ms). ptxas (NVRTC 13.0):
# 155-168 registers, no spills; registers are allocated per warpgroup, so two producer warps cost
# a whole one, and with four the producer warpgroup hands registers to the consumers (setmaxnreg
# 56 / 224), which the 128-token S tile needs (wg2n128s2p4: not yet run on a GPU).
# "tma" (opt-in, not yet run on a GPU): one producer warp issues TMA box copies of whole pages
# (tma_layout) instead of per-thread 16-byte cp.async with a per-token table lookup and address math,
# K and V on their own barriers. Still a full producer warpgroup (the other three warps leave at once):
# with one producer warp (288 threads) ptxas still caps every thread at 168 registers (allocation per
# warpgroup) and the 128-token S tile spills ~330 bytes at d128; the hand-over gives the consumers 224.
WGMMA_CONFIGS = (("wg", 2, 64, 6, 4, "pp"), ("wg", 2, 64, 4, 2), ("wg", 2, 128, 2, 4),
                 ("wg", 2, 64, 6, 4, "pp", "tma"), ("wg", 2, 128, 3, 4, "pp", "tma"), ("wg", 2, 128, 3, 4, "tma"))
CONFIGS = CONFIGS + WGMMA_CONFIGS
# The default since session 28 (H200, 2026-12-02, bench_prefill in one run with SDPA's flash backend,
# docs/benchmarks/gpu_runs_2026-12-02_s28/r2/kv15): wg2n128s3p4tma 18.6 ms for a 1 x 32K causal prompt against w8x2's
# 35.5 and SDPA flash's 25.4 (1.37x flash); 4K on a 28K prefix 4.3 vs 8.9 ms; 8 x 4K 2.6 vs 5.0 ms; its GPU tests
# (TMA vs the float32 reference, page sizes 8-256, stale NaN slots) passed. Pools the TMA loader cannot read
# (tma_reason) take CP_ASYNC_CONFIG, the fastest cp.async kernel.
DEFAULT_CONFIG = ("wg", 2, 128, 3, 4, "tma")
MAX_GRID_Y = 65535
_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}


def is_wgmma(cfg: tuple) -> bool:
    return cfg[0] == "wg"


def config_bn(cfg: tuple) -> int:
    if is_wgmma(cfg):
        return cfg[2]
    return cfg[2] if len(cfg) > 2 else BN


def config_stages(cfg: tuple) -> int:
    if is_wgmma(cfg):
        return cfg[3]
    return cfg[3] if len(cfg) > 3 else 2


def config_name(cfg: tuple) -> str:
    if is_wgmma(cfg):
        return f"wg{cfg[1]}n{cfg[2]}s{cfg[3]}p{cfg[4]}" + ("pp" if wg_pingpong(cfg) else "") + ("tma" if wg_tma(cfg) else "")
    return (f"w{cfg[0]}x{cfg[1]}" + ("" if config_bn(cfg) == BN else f"n{config_bn(cfg)}")
            + ("" if config_stages(cfg) == 2 else f"s{config_stages(cfg)}"))


def wg_pingpong(cfg: tuple) -> bool:
    return is_wgmma(cfg) and "pp" in cfg[5:]


def wg_tma(cfg: tuple) -> bool:
    """Whether a wgmma config loads K/V with TMA (paged_prefill_wgmma.cuh's TMA flag)."""
    return is_wgmma(cfg) and "tma" in cfg[5:]


def threads(cfg: tuple) -> int:
    return 128 * cfg[1] + 32 * cfg[4] if is_wgmma(cfg) else 32 * cfg[0]


def config_from_name(text: str, what: str = "config") -> tuple:
    for cfg in CONFIGS:
        if text == config_name(cfg):
            return cfg
    raise tilehal.ArgumentError(f"{what}: expected one of {[config_name(c) for c in CONFIGS]}, got {text!r}")


def default_config() -> tuple:
    """KVPOOL_PREFILL_KERNEL ("w8x1", "w4x2", "wg2n64s4p2", ...), else DEFAULT_CONFIG."""
    text = os.environ.get("KVPOOL_PREFILL_KERNEL")
    if not text:
        return DEFAULT_CONFIG
    return config_from_name(text, "KVPOOL_PREFILL_KERNEL")


def kernel_name(dtype: torch.dtype, head_dim: int, cfg: tuple) -> str:
    if is_wgmma(cfg):
        flags = f", {str(wg_pingpong(cfg)).lower()}, {str(wg_tma(cfg)).lower()}"
        return f"kvpool::paged_prefill_wgmma_kernel<{_CTYPES[dtype]}, {head_dim}, {cfg[1]}, {cfg[2]}, {cfg[3]}, {cfg[4]}{flags}>"
    st = "" if config_stages(cfg) == 2 else f", {config_stages(cfg)}"
    return f"kvpool::paged_prefill_kernel<{_CTYPES[dtype]}, {head_dim}, {cfg[0]}, {cfg[1]}, {config_bn(cfg)}{st}>"


def rows_per_cta(cfg: tuple) -> int:
    return 64 * cfg[1] if is_wgmma(cfg) else 16 * cfg[0] * cfg[1]


def smem_bytes(dtype: torch.dtype, head_dim: int, cfg: tuple) -> int:
    """Dynamic shared memory of one CTA (PrefillSmem::kBytes / PrefillWgmmaSmem::kBytes, asserted at
    compile time): Q tile + the stages of K and of V (wgmma: + the stages' mbarriers — two, TMA: three,
    plus the tail barrier — and 1 KB to align the tiles to 1024 bytes)."""
    row = head_dim * dtype.itemsize
    if is_wgmma(cfg):
        st = config_stages(cfg)
        bars = 3 * st + 1 if wg_tma(cfg) else 2 * st
        return rows_per_cta(cfg) * row + 2 * st * config_bn(cfg) * row + 8 * bars + 1024
    return rows_per_cta(cfg) * row + 2 * config_stages(cfg) * config_bn(cfg) * row


@functools.cache
def compile_prefill(dtype: torch.dtype, head_dim: int, cfg: tuple = DEFAULT_CONFIG,
                    arch: str = "sm_90a") -> tilehal.CudaModule:
    t, smem = _CTYPES[dtype], smem_bytes(dtype, head_dim, cfg)
    if is_wgmma(cfg):
        tma = str(wg_tma(cfg)).lower()
        check = (f'static_assert(kvpool::PrefillWgmmaSmem<{t}, {head_dim}, {cfg[1]}, {cfg[2]}, {cfg[3]}, {tma}>::kBytes == {smem}, '
                 f'"kvpool.cuda_prefill.smem_bytes");\n')
        return tilehal.compile_cuda('#include "paged_prefill_wgmma.cuh"\n' + check, arch=arch,
                                    name=f"paged_prefill_{head_dim}_{config_name(cfg)}", include_dirs=[str(KERNEL_DIR)],
                                    options=["--use_fast_math"], name_expressions=[kernel_name(dtype, head_dim, cfg)])
    # The host's copies of the kernel's constants, held to the kernel's at compile time.
    checks = (f'static_assert(kvpool::kPrefillBN == {BN}, "kvpool.cuda_prefill.BN");\n'
              f'static_assert(kvpool::PrefillSmem<{t}, {head_dim}, {cfg[0] * cfg[1]}, {config_bn(cfg)}, {config_stages(cfg)}>::kBytes == {smem}, '
              f'"kvpool.cuda_prefill.smem_bytes");\n')
    return tilehal.compile_cuda('#include "paged_prefill.cuh"\n' + checks, arch=arch,
                                name=f"paged_prefill_{head_dim}_{config_name(cfg)}", include_dirs=[str(KERNEL_DIR)],
                                options=["--use_fast_math"], name_expressions=[kernel_name(dtype, head_dim, cfg)])


def unsupported_reason(q: torch.Tensor, pool: KVPool) -> str | None:
    """Why the CUDA kernel cannot serve this call (None: it can)."""
    if pool.device.type != "cuda":
        return f"pool on {pool.device}"
    return dtype_reason(q, pool, HEAD_DIMS)


def tma_reason(pool: KVPool, cfg: tuple) -> str | None:
    """Why the TMA loader cannot read this pool (None: it can): a box is min(block_size, BN) slots of one
    page and must start 1024-byte aligned in shared memory, and a tile must hold whole boxes."""
    bs, bn = pool.block_size, config_bn(cfg)
    if bs % 8:
        return f"block_size {bs} is not a multiple of 8"
    if bn % bs and bs % bn:
        return f"block_size {bs} neither divides nor is a multiple of the kernel's {bn} kv tokens per stage"
    if pool.num_blocks * bs >= 2**31:
        return f"{pool.num_blocks * bs} slots exceed TMA's int32 coordinates"
    return None


def tma_layout(cache: torch.Tensor, block_n: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(shape, strides, box), outermost first, of the TMA view of one layer's K or V cache
    `[num_blocks, block_size, kv_heads, head_dim]` (contiguous): `[slots, kv_heads * head_dim / 64, 64]`
    with a box of min(block_size, block_n) slots x one 64-channel atom. A box at coordinates (channel 0,
    atom hkv * head_dim / 64 + a, slot phys * block_size + offset) holds those tokens' channels
    [64 a, 64 a + 64) of kv head hkv."""
    nb, bs, h, d = cache.shape
    if not cache.is_contiguous():
        raise tilehal.ShapeError(f"cache: expected a contiguous [num_blocks, block_size, kv_heads, head_dim] tensor, "
                                 f"got strides {cache.stride()}")
    atoms = h * d // 64
    return (nb * bs, atoms, 64), (atoms * 64, 64, 1), (min(bs, block_n), 1, 64)


_DESCS: dict = {}


def tma_descriptors(kc: torch.Tensor, vc: torch.Tensor, block_n: int) -> tuple[bytes, bytes]:
    """The K and V descriptors of a layer (encoded once per buffer and geometry)."""
    out = []
    for c in (kc, vc):
        shape, strides, box = tma_layout(c, block_n)
        key = (c.data_ptr(), c.dtype, shape, box)
        hit = _DESCS.get(key)
        if hit is None:
            if len(_DESCS) > 1024:
                _DESCS.clear()
            from tilehal.tma import encode_tiled

            hit = _DESCS[key] = encode_tiled(c.data_ptr(), c.dtype, shape, strides, box, swizzle="128B")
        out.append(hit)
    return out[0], out[1]


_NO_DESC = bytes(128)


def tile_list(cu: list[int], lens: list[int], rows_per_tile: int) -> list[tuple[int, ...]]:
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
                       scale: float | None, config: tuple | None = None) -> torch.Tensor:
    """The kernel's launch; `cu` / `lens` are the host copies paged_prefill validated."""
    total, hq, d = q.shape
    cfg = default_config() if config is None else config
    if wg_tma(cfg):
        reason = tma_reason(pool, cfg)
        if reason is not None:
            log.debug("paged_prefill: %s cannot load this pool with TMA (%s); using %s", config_name(cfg), reason,
                      config_name(CP_ASYNC_CONFIG))
            cfg = CP_ASYNC_CONFIG
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    tiles = tile_list(cu, lens, rows_per_cta(cfg))
    if not tiles:
        return out
    kern = compile_prefill(pool.dtype, d, cfg).get_kernel(kernel_name(pool.dtype, d, cfg))
    kc, vc = pool.layer_cache(layer)
    tt = torch.tensor(tiles, dtype=torch.int32).to(q.device, non_blocking=True)
    table = block_table.contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    cuq = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    qc = q.contiguous()
    smem = smem_bytes(pool.dtype, d, cfg)
    args = [qc, kc, vc, table, table.shape[1], sl, cuq, None, out, pool.num_kv_heads,
            float(scale * math.log2(math.e)), pool.block_size]
    if is_wgmma(cfg):  # the wgmma kernels' descriptor parameters (zero bytes when they load with cp.async)
        args += list(tma_descriptors(kc, vc, config_bn(cfg))) if wg_tma(cfg) else [_NO_DESC, _NO_DESC]
    for start in range(0, len(tiles), MAX_GRID_Y):
        chunk = tt[start:start + MAX_GRID_Y]
        args[7] = chunk
        kern.launch((hq, chunk.shape[0]), threads(cfg), args, smem_bytes=smem)
    return out
