"""CUDA paged decode: kernel compilation (tilehal.compile_cuda), split choice and launch."""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import tilehal
import torch

from .pool import KVPool

log = logging.getLogger("kvpool.cuda_decode")

KERNEL_DIR = Path(__file__).with_name("kernels")
KERNEL_SOURCE = KERNEL_DIR / "paged_decode.cuh"
THREADS, TILE, STAGES = 128, 64, 2  # v1's fixed tile and pipeline depth
V3_MAX_ITEMS = 512  # kV3MaxItems in paged_decode_v3.cuh
V3_WARPS, V3_STEP = 4, 16  # warps per CTA and tokens per warp step in paged_decode_v3.cuh
VARIANTS = ("v1", "v3")


@dataclass(frozen=True)
class KernelConfig:
    """Which decode kernel: "v1" (CUDA cores; any block size) or "v3" (tensor cores, per-warp
    pipelines; its tile is fixed at 4 warps x 16 tokens, `stages` is the per-warp cp.async depth)."""

    variant: str = "v1"
    tile: int = TILE
    stages: int = STAGES

    @classmethod
    def parse(cls, text: str | None) -> KernelConfig:
        """"v1", "v3" or "v3:64:STAGES"; the env
        variable KVPOOL_DECODE_KERNEL uses this form. Empty or None: the default (v3, 3 stages)."""
        if not text:
            return DEFAULT_CONFIG
        if text == "v1":
            return cls()
        parts = text.split(":")
        if parts[0] != "v3" or len(parts) not in (1, 3):
            raise ValueError(f"KVPOOL_DECODE_KERNEL: expected 'v1', 'v3' or 'v3:64:STAGES', got {text!r}")
        tile, stages = (int(x) for x in parts[1:]) if len(parts) == 3 else (V3_WARPS * V3_STEP, 3)
        if tile != V3_WARPS * V3_STEP:
            raise ValueError(f"KVPOOL_DECODE_KERNEL: v3's tile is fixed at {V3_WARPS * V3_STEP}, got {text!r}")
        if stages < 2:
            raise ValueError(f"KVPOOL_DECODE_KERNEL: at least 2 stages, got {text!r}")
        return cls(parts[0], tile, stages)


# v3 with 3 stages measured fastest on the H200 (docs/benchmarks/kvpool_decode.json) and passes
# every GPU test; v1 stays selectable through KVPOOL_DECODE_KERNEL and serves block sizes v3
# cannot. (A "v2", v1 plus a staged block list, measured slower than v1 and was removed.)
DEFAULT_CONFIG = KernelConfig("v3", V3_WARPS * V3_STEP, 3)


@functools.lru_cache(maxsize=16)
def _parse_env(text: str | None) -> KernelConfig:
    return KernelConfig.parse(text)


def default_config() -> KernelConfig:
    """The kernel KVPOOL_DECODE_KERNEL names, else DEFAULT_CONFIG."""
    return _parse_env(os.environ.get("KVPOOL_DECODE_KERNEL"))


HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8  # q heads per kv head held in registers
_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}


def smem_bytes(dtype: torch.dtype, head_dim: int, group: int, cfg: KernelConfig = KernelConfig()) -> int:
    """Dynamic shared memory of one CTA (mirrors DecodeSmem / DecodeSmemV3)."""
    tile_bytes = cfg.tile * head_dim * dtype.itemsize
    if cfg.variant == "v1":
        return 2 * STAGES * tile_bytes + TILE * group * 4 + STAGES * TILE * 4 + 4 * group * 4
    # v3, per warp: STAGES steps of K and of V, 16 tokens each
    step_bytes = V3_STEP * head_dim * dtype.itemsize
    return V3_WARPS * 2 * cfg.stages * step_bytes + 2 * V3_MAX_ITEMS * 4


def unsupported_reason(q: torch.Tensor, pool: KVPool) -> str | None:
    """Why the CUDA kernel cannot serve this call (None: it can)."""
    if pool.dtype not in _CTYPES:
        return f"pool dtype {pool.dtype} (kernel: bf16/fp16)"
    if q.dtype != pool.dtype:
        return f"q dtype {q.dtype} differs from the pool's {pool.dtype}"
    if pool.head_dim not in HEAD_DIMS:
        return f"head_dim {pool.head_dim} (kernel: {HEAD_DIMS})"
    group = q.shape[1] // pool.num_kv_heads
    if group > MAX_GROUP:
        return f"{group} q heads per kv head (kernel: <= {MAX_GROUP})"
    return None


def kernel_names(dtype: torch.dtype, head_dim: int, group: int,
                 cfg: KernelConfig = KernelConfig()) -> tuple[str, str]:
    t = _CTYPES[dtype]
    if cfg.variant == "v1":
        main = f"kvpool::paged_decode_kernel<{t}, {head_dim}, {group}>"
    else:
        main = f"kvpool::paged_decode_v3_kernel<{t}, {head_dim}, {group}, {cfg.stages}>"
    return main, f"kvpool::paged_decode_combine<{t}, {head_dim}>"


@functools.cache
def compile_decode(dtype: torch.dtype, head_dim: int, group: int, arch: str = "sm_90a",
                   cfg: KernelConfig = KernelConfig()) -> tilehal.CudaModule:
    """Compile (or load from tilehal's cache) the kernels for one (dtype, head_dim, group, config)."""
    header = {"v1": "paged_decode.cuh", "v3": "paged_decode_v3.cuh"}[cfg.variant]
    # tilehal's cache key covers the headers in include_dirs, so an edited kernel recompiles.
    source = f'#include "{header}"\n'
    return tilehal.compile_cuda(source, arch=arch,
                                name=f"paged_decode_{cfg.variant}_{head_dim}_{group}",
                                include_dirs=[str(KERNEL_DIR)], options=["--use_fast_math"],
                                name_expressions=list(kernel_names(dtype, head_dim, group, cfg)))


def choose_splits(batch: int, kv_heads: int, tokens_per_seq: int, num_sms: int, ctas_per_sm: int) -> int:
    """Split each sequence's tokens so the grid fills whole waves; at least ~4 tiles per split."""
    slots = num_sms * ctas_per_sm
    base = batch * kv_heads
    max_splits = max(1, min(64, tokens_per_seq // (4 * TILE)))
    best, best_score = 1, -1.0
    for s in range(1, max_splits + 1):
        ctas = base * s
        efficiency = ctas / (math.ceil(ctas / slots) * slots)
        score = efficiency - 0.003 * s  # each split costs a partial write and a merge
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


@functools.lru_cache(maxsize=8)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=256)
def _launch_plan(dtype: torch.dtype, head_dim: int, group: int, cfg: KernelConfig, block_size: int, batch: int,
                 kv_heads: int, items: int, device_index: int, num_splits: int | None):
    """Kernels, shared memory and split count for one call shape, cached: a decode step calls
    this with the same shape every layer, and the Python around a ~100 us kernel matters."""
    if cfg.variant == "v3" and block_size & (block_size - 1):
        log.debug("paged_decode: v3 needs a power-of-two block_size (got %d); running v1", block_size)
        cfg = KernelConfig()
    module = compile_decode(dtype, head_dim, group, cfg=cfg)
    main, combine = (module.get_kernel(n) for n in kernel_names(dtype, head_dim, group, cfg))
    smem = smem_bytes(dtype, head_dim, group, cfg)
    if num_splits is None:
        per_sm = max(1, min(228 * 1024 // (smem + 1024), 2048 // THREADS))
        num_splits = choose_splits(batch, kv_heads, items * block_size, _device_sms(device_index), per_sm)
    if cfg.variant == "v3":  # a CTA's share of blocks must fit the kernel's shared table
        num_splits = max(num_splits, -(-items // V3_MAX_ITEMS))
    return main, combine, smem, num_splits


def paged_decode_cuda(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float | None, block_indices: torch.Tensor | None,
                      num_splits: int | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    B, hq, d = q.shape
    H = pool.num_kv_heads
    group = hq // H
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if B == 0:
        return torch.empty_like(q)
    cfg = default_config() if config is None else config
    q = q.contiguous()
    table = block_table.contiguous()
    kc, vc = pool.layer_cache(layer)
    if block_indices is not None:
        idx = block_indices.contiguous()
        n = idx.shape[-1]
        idx_h_stride = n if idx.ndim == 3 else 0
        idx_b_stride = n * (H if idx.ndim == 3 else 1)
        items = n
    else:
        idx, n, idx_b_stride, idx_h_stride = None, 0, 0, 0
        items = table.shape[1]
    main, combine, smem, num_splits = _launch_plan(pool.dtype, d, group, cfg, pool.block_size, B, H, items,
                                                   q.device.index or 0, num_splits)
    out = torch.empty_like(q)
    if num_splits > 1:
        o_part = torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=q.device)
        ml_part = torch.empty((B, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        o_part = ml_part = None
    main.launch((num_splits, H, B), THREADS,
                [q, kc, vc, table, table.shape[1], seq_lens, idx, idx_b_stride, idx_h_stride, n, out, o_part,
                 ml_part, float(scale * math.log2(math.e)), pool.block_size], smem_bytes=smem)
    if num_splits > 1:
        combine.launch(B * hq, d, [o_part, ml_part, out, num_splits])
    return out


# ----------------------------------------------------------------------------- fp8 (e4m3) pools
FP8_MAX_ITEMS = 512  # kF8MaxItems in paged_decode_fp8.cuh
FP8_CTAS_PER_SM = 4  # ~127 registers x 128 threads and 16 KB of shared memory (D=128, G=4)
_FP8_Q_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}


def fp8_unsupported_reason(q: torch.Tensor, pool: KVPool) -> str | None:
    """Why the fp8 decode kernel cannot serve this call (None: it can)."""
    if not pool.is_fp8:
        return "not an fp8 pool"
    if q.dtype not in _FP8_Q_CTYPES:
        return f"q dtype {q.dtype} (kernel: bf16/fp16/fp32)"
    if pool.head_dim not in HEAD_DIMS:
        return f"head_dim {pool.head_dim} (kernel: {HEAD_DIMS})"
    group = q.shape[1] // pool.num_kv_heads
    if group > MAX_GROUP:
        return f"{group} q heads per kv head (kernel: <= {MAX_GROUP})"
    return None


def fp8_kernel_names(q_dtype: torch.dtype, head_dim: int, group: int) -> tuple[str, str]:
    t = _FP8_Q_CTYPES[q_dtype]
    return (f"kvpool::paged_decode_fp8_kernel<{t}, {head_dim}, {group}>",
            f"kvpool::paged_decode_combine<{t}, {head_dim}>")


@functools.cache
def compile_decode_fp8(q_dtype: torch.dtype, head_dim: int, group: int, arch: str = "sm_90a") -> tilehal.CudaModule:
    return tilehal.compile_cuda('#include "paged_decode_fp8.cuh"\n', arch=arch,
                                name=f"paged_decode_fp8_{head_dim}_{group}", include_dirs=[str(KERNEL_DIR)],
                                options=["--use_fast_math"], name_expressions=list(fp8_kernel_names(q_dtype, head_dim, group)))


def paged_decode_fp8_cuda(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float | None, block_indices: torch.Tensor | None,
                          num_splits: int | None = None) -> torch.Tensor:
    """Decode over an fp8 pool: e4m3 K/V dequantized in registers with their per-(block, head) scales."""
    B, hq, d = q.shape
    H = pool.num_kv_heads
    group = hq // H
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if B == 0:
        return torch.empty_like(q)
    q = q.contiguous()
    table = block_table.contiguous()
    kc, vc = pool.layer_cache(layer)
    ks, vs = pool.layer_scales(layer)
    if block_indices is not None:
        idx = block_indices.contiguous()
        n = idx.shape[-1]
        idx_h_stride = n if idx.ndim == 3 else 0
        idx_b_stride = n * (H if idx.ndim == 3 else 1)
        items = n
    else:
        idx, n, idx_b_stride, idx_h_stride = None, 0, 0, 0
        items = table.shape[1]
    main, combine = (compile_decode_fp8(q.dtype, d, group).get_kernel(x) for x in fp8_kernel_names(q.dtype, d, group))
    if num_splits is None:
        num_splits = choose_splits(B, H, items * pool.block_size, _device_sms(q.device.index or 0), FP8_CTAS_PER_SM)
    num_splits = max(num_splits, -(-items // FP8_MAX_ITEMS), 1)
    out = torch.empty_like(q)
    if num_splits > 1:
        o_part = torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=q.device)
        ml_part = torch.empty((B, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        o_part = ml_part = None
    main.launch((num_splits, H, B), THREADS,
                [q, kc.view(torch.uint8), vc.view(torch.uint8), ks.contiguous(), vs.contiguous(), table, table.shape[1],
                 seq_lens, idx, idx_b_stride, idx_h_stride, n, out, o_part, ml_part,
                 float(scale * math.log2(math.e)), pool.block_size])
    if num_splits > 1:
        combine.launch(B * hq, d, [o_part, ml_part, out, num_splits])
    return out
