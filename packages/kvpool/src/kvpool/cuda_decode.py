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
# Launch constants shared with the kernels; every compile static_asserts that they still agree
# (kernel_checks), so a drifted copy fails to build instead of launching a wrong grid.
THREADS = 128  # kThreads, every decode kernel's CTA
TILE, STAGES = 64, 2  # the SIMT kernel's fixed tile and pipeline depth (kSimtTile, kSimtStages)
MMA_MAX_ITEMS = 512  # kMmaMaxItems: blocks one CTA of the MMA kernel may own
MMA_WARPS, MMA_STEP = 4, 16  # kMmaWarps, kMmaStepTokens: warps per CTA, tokens per warp step
VARIANTS = ("simt", "mma")
HEADERS = {"simt": "paged_decode_simt.cuh", "mma": "paged_decode_mma.cuh"}


@dataclass(frozen=True)
class KernelConfig:
    """Which decode kernel: "simt" (CUDA cores; any block size) or "mma" (tensor cores, per-warp
    pipelines; its tile is fixed at 4 warps x 16 tokens, `stages` is the per-warp cp.async depth)."""

    variant: str = "simt"
    tile: int = TILE
    stages: int = STAGES

    @classmethod
    def parse(cls, text: str | None) -> KernelConfig:
        """"simt", "mma" or "mma:64:STAGES"; the env variable KVPOOL_DECODE_KERNEL uses this
        form. Empty or None: the default (mma, 3 stages). The kernels' former names ("v1" is now
        "simt", "v3" is "mma") are refused with that hint."""
        if not text:
            return DEFAULT_CONFIG
        if text == "simt":
            return cls()
        parts = text.split(":")
        if parts[0] != "mma" or len(parts) not in (1, 3):
            renamed = " (v1 is now 'simt', v3 is 'mma')" if parts[0] in ("v1", "v3") else ""
            raise tilehal.ArgumentError(f"KVPOOL_DECODE_KERNEL: expected 'simt', 'mma' or 'mma:64:STAGES', got {text!r}{renamed}")
        tile, stages = (int(x) for x in parts[1:]) if len(parts) == 3 else (MMA_WARPS * MMA_STEP, 3)
        if tile != MMA_WARPS * MMA_STEP:
            raise tilehal.ArgumentError(f"KVPOOL_DECODE_KERNEL: mma's tile is fixed at {MMA_WARPS * MMA_STEP}, got {text!r}")
        if stages < 2:
            raise tilehal.ArgumentError(f"KVPOOL_DECODE_KERNEL: at least 2 stages, got {text!r}")
        return cls(parts[0], tile, stages)


# mma with 3 stages measured fastest on the H200 (docs/benchmarks/kvpool_decode.json, where it
# is labelled by its old name v3:64:3) and passes every GPU test; simt stays selectable through
# KVPOOL_DECODE_KERNEL and serves block sizes mma cannot. (A SIMT kernel with a staged block
# list measured slower than simt and was removed.)
DEFAULT_CONFIG = KernelConfig("mma", MMA_WARPS * MMA_STEP, 3)


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
    """Dynamic shared memory of one CTA (DecodeSmemSimt / DecodeSmemMma::kBytes; kernel_checks
    asserts they agree)."""
    tile_bytes = cfg.tile * head_dim * dtype.itemsize
    if cfg.variant == "simt":
        return 2 * STAGES * tile_bytes + TILE * group * 4 + STAGES * TILE * 4 + 4 * group * 4
    # mma, per warp: STAGES steps of K and of V, 16 tokens each
    step_bytes = MMA_STEP * head_dim * dtype.itemsize
    return MMA_WARPS * 2 * cfg.stages * step_bytes + 2 * MMA_MAX_ITEMS * 4


def dtype_reason(q: torch.Tensor, pool: KVPool, head_dims: tuple[int, ...]) -> str | None:
    """Why a bf16/fp16 kernel taking `head_dims` cannot serve q over this pool (None: it can);
    shared by the decode and prefill kernels."""
    if pool.dtype not in _CTYPES:
        return f"pool dtype {pool.dtype} (kernel: bf16/fp16)"
    if q.dtype != pool.dtype:
        return f"q dtype {q.dtype} differs from the pool's {pool.dtype}"
    if pool.head_dim not in head_dims:
        return f"head_dim {pool.head_dim} (kernel: {head_dims})"
    return None


def unsupported_reason(q: torch.Tensor, pool: KVPool) -> str | None:
    """Why the CUDA kernel cannot serve this call (None: it can)."""
    reason = dtype_reason(q, pool, HEAD_DIMS)
    if reason is not None:
        return reason
    group = q.shape[1] // pool.num_kv_heads
    if group > MAX_GROUP:
        return f"{group} q heads per kv head (kernel: <= {MAX_GROUP})"
    return None


def kernel_names(dtype: torch.dtype, head_dim: int, group: int,
                 cfg: KernelConfig = KernelConfig()) -> tuple[str, str]:
    t = _CTYPES[dtype]
    if cfg.variant == "simt":
        main = f"kvpool::paged_decode_simt_kernel<{t}, {head_dim}, {group}>"
    else:
        main = f"kvpool::paged_decode_mma_kernel<{t}, {head_dim}, {group}, {cfg.stages}>"
    return main, f"kvpool::paged_decode_combine<{t}, {head_dim}>"


def _asserts(pairs: list[tuple[str, int]]) -> str:
    return "".join(f'static_assert({expr} == {value}, "kvpool.cuda_decode: {expr} != {value}");\n'
                   for expr, value in pairs)


def kernel_checks(dtype: torch.dtype, head_dim: int, group: int, cfg: KernelConfig = KernelConfig()) -> str:
    """static_asserts, appended to the compiled source, holding the kernel's constants to this
    module's copies (threads, tile, stages, block-list capacity, shared-memory bytes)."""
    t = _CTYPES[dtype]
    pairs = [("kvpool::kThreads", THREADS)]
    if cfg.variant == "simt":
        pairs += [("kvpool::kSimtTile", TILE), ("kvpool::kSimtStages", STAGES),
                  (f"kvpool::DecodeSmemSimt<{t}, {head_dim}, {group}>::kBytes", smem_bytes(dtype, head_dim, group, cfg))]
    else:
        pairs += [("kvpool::kMmaWarps", MMA_WARPS), ("kvpool::kMmaStepTokens", MMA_STEP),
                  ("kvpool::kMmaMaxItems", MMA_MAX_ITEMS),
                  (f"kvpool::DecodeSmemMma<{t}, {head_dim}, {cfg.stages}>::kBytes",
                   smem_bytes(dtype, head_dim, group, cfg))]
    return _asserts(pairs)


@functools.cache
def compile_decode(dtype: torch.dtype, head_dim: int, group: int, arch: str = "sm_90a",
                   cfg: KernelConfig = KernelConfig(), pdl: bool = False,
                   cluster_merge: bool = False) -> tilehal.CudaModule:
    """Compile (or load from tilehal's cache) the kernels for one (dtype, head_dim, group, config).
    `pdl`: the build that waits for the previous kernel (griddepcontrol, -DKVPOOL_PDL; mma and combine).
    `cluster_merge`: the mma build whose split CTAs merge over distributed shared memory (-DKVPOOL_CLUSTER_MERGE,
    launched as clusters of the splits; KVPOOL_DECODE_COMBINE=cluster)."""
    # tilehal's cache key covers the headers in include_dirs, so an edited kernel recompiles.
    source = f'#include "{HEADERS[cfg.variant]}"\n' + kernel_checks(dtype, head_dim, group, cfg)
    flags = [*(["-DKVPOOL_PDL"] if pdl else []), *(["-DKVPOOL_CLUSTER_MERGE"] if cluster_merge else [])]
    return tilehal.compile_cuda(source, arch=arch,
                                name=f"paged_decode_{cfg.variant}_{head_dim}_{group}{'_pdl' if pdl else ''}"
                                     f"{'_cm' if cluster_merge else ''}",
                                include_dirs=[str(KERNEL_DIR)],
                                options=["--use_fast_math", *flags],
                                name_expressions=list(kernel_names(dtype, head_dim, group, cfg)))


def choose_splits(batch: int, kv_heads: int, tokens_per_seq: int, num_sms: int, ctas_per_sm: int,
                  min_tiles: int = 4) -> int:
    """Split each sequence's tokens so the grid fills whole waves; at least ~min_tiles tiles per split."""
    slots = num_sms * ctas_per_sm
    base = batch * kv_heads
    max_splits = max(1, min(64, tokens_per_seq // (min_tiles * TILE)))
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


# Sparse decode (block_indices given, no explicit config or KVPOOL_DECODE_KERNEL): the kernel config
# and the minimum tiles per split for its short rows (None / 4: as dense).
SPARSE_CONFIG: KernelConfig | GatherConfig | None = None  # GatherConfig: the gather kernel
SPARSE_MIN_TILES = 4


@functools.lru_cache(maxsize=256)
def _launch_plan(dtype: torch.dtype, head_dim: int, group: int, cfg: KernelConfig, block_size: int, batch: int,
                 kv_heads: int, items: int, device_index: int, num_splits: int | None, min_tiles: int = 4,
                 pdl: bool = False, cluster_merge: bool = False):
    """Kernels, shared memory and split count for one call shape, cached: a decode step calls
    this with the same shape every layer, and the Python around a ~100 us kernel matters."""
    if cfg.variant == "mma" and block_size & (block_size - 1):
        log.debug("paged_decode: the mma kernel needs a power-of-two block_size (got %d); running simt", block_size)
        cfg = KernelConfig()
    pdl = pdl and cfg.variant == "mma"
    if num_splits is None:
        per_sm = max(1, min(228 * 1024 // (smem_bytes(dtype, head_dim, group, cfg) + 1024), 2048 // THREADS))
        num_splits = choose_splits(batch, kv_heads, items * block_size, _device_sms(device_index), per_sm, min_tiles)
    if cfg.variant == "mma":  # a CTA's share of blocks must fit the kernel's shared table
        num_splits = max(num_splits, -(-items // MMA_MAX_ITEMS))
    if cluster_merge and not (cfg.variant == "mma" and 2 <= num_splits <= CLUSTER_MAX_SPLITS):
        log.debug("paged_decode: KVPOOL_DECODE_COMBINE=cluster needs the mma kernel and 2..%d splits (%s, %d splits); "
                  "the combine launch merges", CLUSTER_MAX_SPLITS, cfg.variant, num_splits)
        cluster_merge = False
    module = compile_decode(dtype, head_dim, group, cfg=cfg, pdl=pdl, cluster_merge=cluster_merge)
    main, combine = (module.get_kernel(n) for n in kernel_names(dtype, head_dim, group, cfg))
    smem = smem_bytes(dtype, head_dim, group, cfg)
    return main, combine, smem, num_splits, cfg.variant, pdl, cluster_merge


COMBINES = ("ticket", "launch", "cluster")
# "launch": split partials merged by paged_decode_combine (a second launch); "ticket": by the
# (sequence, kv head)'s last split CTA inside the mma kernel (combine_if_last), one launch; "cluster" (mma
# kernel, 2..CLUSTER_MAX_SPLITS splits): the splits launched as one thread-block cluster merge over distributed
# shared memory (cluster_merge_and_store), one launch, no partials in global memory.
CLUSTER_MAX_SPLITS = 8  # the portable cluster size
DEFAULT_COMBINE = "launch"


SPARSE_COMBINE: str | None = None  # sparse calls without KVPOOL_DECODE_COMBINE (None: DEFAULT_COMBINE)


def combine_variant(sparse: bool = False) -> str:
    """KVPOOL_DECODE_COMBINE (default DEFAULT_COMBINE; sparse calls SPARSE_COMBINE when set): how the mma kernel's
    split partials merge."""
    v = os.environ.get("KVPOOL_DECODE_COMBINE") or (SPARSE_COMBINE if sparse and SPARSE_COMBINE else DEFAULT_COMBINE)
    if v not in COMBINES:
        raise tilehal.ArgumentError(f"KVPOOL_DECODE_COMBINE: expected one of {list(COMBINES)}, got {v!r}")
    return v


DEFAULT_PREFETCH = "0"  # "1": sparse shares prefetch their K/V lines into L2 first (mma kernel)


def prefetch_enabled() -> bool:
    """KVPOOL_DECODE_PREFETCH (default DEFAULT_PREFETCH): "1" makes the mma kernel request every K/V
    line of a sparse share (<= 2048 tokens) into L2 before its pipeline starts."""
    v = os.environ.get("KVPOOL_DECODE_PREFETCH") or DEFAULT_PREFETCH
    if v not in ("0", "1"):
        raise tilehal.ArgumentError(f"KVPOOL_DECODE_PREFETCH: expected 0 or 1, got {v!r}")
    return v == "1"


_TICKETS: dict[tuple, torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """Per-(sequence, kv head) tickets of the in-kernel combine: zero between launches (the last
    split CTA re-arms its ticket), one buffer per (device, stream)."""
    return tilehal.stream_buffer(_TICKETS, device, n, min_numel=1024)


def _decode_dims(q: torch.Tensor, pool: KVPool, scale: float | None):
    """(B, Hq, D, kv heads, q heads per kv head, softmax scale * log2(e)) of a decode call; the
    kernels take exp2 of scores pre-multiplied by the last (default scale: 1 / sqrt(D))."""
    B, hq, d = q.shape
    H = pool.num_kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return B, hq, d, H, hq // H, float(scale * math.log2(math.e))


def _index_args(block_indices: torch.Tensor | None, table: torch.Tensor, kv_heads: int):
    """The kernels' (block_idx, num_idx, idx_b_stride, idx_h_stride) and the item count per
    sequence: the selected blocks (sparse, [B, n] or [B, kv_heads, n]) or the table's width."""
    if block_indices is None:
        return None, 0, 0, 0, table.shape[1]
    idx = block_indices.contiguous()
    n = idx.shape[-1]
    per_head = idx.ndim == 3
    return idx, n, n * (kv_heads if per_head else 1), n if per_head else 0, n


def _partials(q: torch.Tensor, num_splits: int):
    """Split-K partials (o [B, Hq, splits, D], (m, l) [B, Hq, splits, 2]), or (None, None) for one split."""
    if num_splits <= 1:
        return None, None
    B, hq, d = q.shape
    return (torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=q.device),
            torch.empty((B, hq, num_splits, 2), dtype=torch.float32, device=q.device))


# ----------------------------------------------------------------------------- sparse: gather kernel
GATHER_WARPS, GATHER_STEP = 4, 16  # kGatherWarps, kGatherStepTokens (asserted at compile time)
GATHER_MAX_SPLITS = 64  # past this many CTAs per (sequence, kv head), each CTA loops over rounds


@dataclass(frozen=True)
class GatherConfig:
    """The latency-bound sparse kernel (paged_decode_gather.cuh): each warp resolves and requests all
    `bpw` 16-token steps of its round at once; split partials merged in-kernel ("ticket") or by the
    combine launch ("launch")."""

    bpw: int = 2
    combine: str = "ticket"

    @classmethod
    def parse(cls, text: str | None) -> GatherConfig | None:
        """KVPOOL_DECODE_SPARSE: empty / None / "mma": None (the dense kernels' path); "gather",
        "gather:BPW" or "gather:BPW:COMBINE" with BPW 1 or 2, COMBINE "ticket" or "launch"."""
        if not text or text == "mma":
            return None
        parts = text.split(":")
        ok = parts[0] == "gather" and len(parts) <= 3
        bpw = parts[1] if len(parts) > 1 else "2"
        combine = parts[2] if len(parts) > 2 else "ticket"
        if not ok or bpw not in ("1", "2") or combine not in COMBINES:
            raise tilehal.ArgumentError("KVPOOL_DECODE_SPARSE: expected 'mma', 'gather', 'gather:BPW' or "
                                        f"'gather:BPW:COMBINE' (BPW 1 or 2, COMBINE in {list(COMBINES)}), got {text!r}")
        return cls(int(bpw), combine)


@functools.lru_cache(maxsize=16)
def _parse_sparse_env(text: str | None) -> GatherConfig | None:
    return GatherConfig.parse(text)


def gather_smem_bytes(dtype: torch.dtype, head_dim: int, bpw: int) -> int:
    """DecodeSmemGather::kBytes: each warp's landed K and V steps."""
    return GATHER_WARPS * 2 * bpw * GATHER_STEP * head_dim * dtype.itemsize


def gather_splits(items: int, block_size: int, bpw: int) -> int:
    """CTAs per (sequence, kv head): one round each (GATHER_WARPS x bpw steps of 16 tokens), at most
    GATHER_MAX_SPLITS (then the CTAs loop)."""
    steps = -(-items * block_size // GATHER_STEP)
    return max(1, min(GATHER_MAX_SPLITS, -(-steps // (GATHER_WARPS * bpw))))


def gather_bpw(head_dim: int, bpw: int) -> int:
    """The steps per warp round the kernel runs: d256 takes 1 (its BPW 2 build spills)."""
    if head_dim >= 256 and bpw > 1:
        log.debug("paged_decode: the gather kernel runs d%d with 1 step per warp round (asked %d)", head_dim, bpw)
        return 1
    return bpw


def gather_kernel_names(dtype: torch.dtype, head_dim: int, group: int, bpw: int) -> tuple[str, str]:
    t = _CTYPES[dtype]
    return (f"kvpool::paged_decode_gather_kernel<{t}, {head_dim}, {group}, {bpw}>",
            f"kvpool::paged_decode_combine<{t}, {head_dim}>")


@functools.cache
def compile_gather(dtype: torch.dtype, head_dim: int, group: int, bpw: int, arch: str = "sm_90a") -> tilehal.CudaModule:
    t = _CTYPES[dtype]
    checks = _asserts([("kvpool::kThreads", THREADS), ("kvpool::kGatherWarps", GATHER_WARPS),
                       ("kvpool::kGatherStepTokens", GATHER_STEP),
                       (f"kvpool::DecodeSmemGather<{t}, {head_dim}, {bpw}>::kBytes",
                        gather_smem_bytes(dtype, head_dim, bpw))])
    return tilehal.compile_cuda('#include "paged_decode_gather.cuh"\n' + checks, arch=arch,
                                name=f"paged_decode_gather_{head_dim}_{group}_{bpw}", include_dirs=[str(KERNEL_DIR)],
                                options=["--use_fast_math"],
                                name_expressions=list(gather_kernel_names(dtype, head_dim, group, bpw)))


def sparse_config() -> KernelConfig | GatherConfig | None:
    """The kernel of a sparse call without an explicit config: KVPOOL_DECODE_SPARSE when set, else
    KVPOOL_DECODE_KERNEL's when set, else SPARSE_CONFIG (None: as dense)."""
    env = os.environ.get("KVPOOL_DECODE_SPARSE")
    if env:
        return _parse_sparse_env(env)
    if os.environ.get("KVPOOL_DECODE_KERNEL"):
        return None
    return SPARSE_CONFIG


def _paged_decode_gather(q, pool, kc, vc, table, seq_lens, idx_args, scale_log2, num_splits, gcfg: GatherConfig):
    B, hq, d = q.shape
    H = pool.num_kv_heads
    idx, n, idx_b_stride, idx_h_stride, items = idx_args
    bpw = gather_bpw(d, gcfg.bpw)
    module = compile_gather(pool.dtype, d, hq // H, bpw)
    main, combine = (module.get_kernel(x) for x in gather_kernel_names(pool.dtype, d, hq // H, bpw))
    splits = max(1, num_splits) if num_splits is not None else gather_splits(items, pool.block_size, bpw)
    out = torch.empty_like(q)
    o_part, ml_part = _partials(q, splits)
    fused = splits > 1 and gcfg.combine == "ticket"
    main.launch((splits, H, B), THREADS,
                [q, kc, vc, table, table.shape[1], seq_lens, idx, idx_b_stride, idx_h_stride, n, out, o_part,
                 ml_part, scale_log2, pool.block_size, _tickets(q.device, B * H) if fused else None],
                smem_bytes=gather_smem_bytes(pool.dtype, d, bpw))
    if splits > 1 and not fused:
        combine.launch(B * hq, d, [o_part, ml_part, out, splits])
    return out


def paged_decode_cuda(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float | None, block_indices: torch.Tensor | None,
                      num_splits: int | None = None,
                      config: KernelConfig | GatherConfig | None = None) -> torch.Tensor:
    B, hq, d, H, group, scale_log2 = _decode_dims(q, pool, scale)
    if B == 0:
        return torch.empty_like(q)
    sparse = block_indices is not None
    cfg = config if config is not None else sparse_config() if sparse else None
    if isinstance(cfg, GatherConfig):
        table = block_table.contiguous()
        kc, vc = pool.layer_cache(layer)
        return _paged_decode_gather(q.contiguous(), pool, kc, vc, table, seq_lens,
                                    _index_args(block_indices, table, H), scale_log2, num_splits, cfg)
    if cfg is None:
        cfg = default_config()
    q = q.contiguous()
    table = block_table.contiguous()
    kc, vc = pool.layer_cache(layer)
    idx, n, idx_b_stride, idx_h_stride, items = _index_args(block_indices, table, H)
    comb = combine_variant(sparse)
    main, combine, smem, num_splits, variant, pdl, cluster = _launch_plan(
        pool.dtype, d, group, cfg, pool.block_size, B, H, items, q.device.index or 0, num_splits,
        SPARSE_MIN_TILES if sparse else 4, sparse and tilehal.pdl_requested(), comb == "cluster")
    out = torch.empty_like(q)
    o_part, ml_part = _partials(q, 1 if cluster else num_splits)
    args = [q, kc, vc, table, table.shape[1], seq_lens, idx, idx_b_stride, idx_h_stride, n, out, o_part,
            ml_part, scale_log2, pool.block_size]
    fused = variant == "mma" and num_splits > 1 and (comb == "ticket" or cluster)
    if variant == "mma":
        args += [_tickets(q.device, B * H) if fused and not cluster else None, int(sparse and prefetch_enabled())]
    main.launch((num_splits, H, B), THREADS, args, smem_bytes=smem, pdl=pdl,
                cluster=(num_splits, 1, 1) if cluster else None)
    if num_splits > 1 and not fused:
        combine.launch(B * hq, d, [o_part, ml_part, out, num_splits], pdl=pdl)
    return out


# ----------------------------------------------------------------------------- fp8 (e4m3) pools
FP8_MAX_ITEMS = 512  # kF8MaxItems: blocks one CTA of the fp8 kernel may own (asserted at compile time)
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
    checks = _asserts([("kvpool::kThreads", THREADS), ("kvpool::kF8MaxItems", FP8_MAX_ITEMS)])
    return tilehal.compile_cuda('#include "paged_decode_fp8.cuh"\n' + checks, arch=arch,
                                name=f"paged_decode_fp8_{head_dim}_{group}", include_dirs=[str(KERNEL_DIR)],
                                options=["--use_fast_math"], name_expressions=list(fp8_kernel_names(q_dtype, head_dim, group)))


def paged_decode_fp8_cuda(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float | None, block_indices: torch.Tensor | None,
                          num_splits: int | None = None) -> torch.Tensor:
    """Decode over an fp8 pool: e4m3 K/V dequantized in registers with their per-(block, head) scales."""
    B, hq, d, H, group, scale_log2 = _decode_dims(q, pool, scale)
    if B == 0:
        return torch.empty_like(q)
    q = q.contiguous()
    table = block_table.contiguous()
    kc, vc = pool.layer_cache(layer)
    ks, vs = pool.layer_scales(layer)
    idx, n, idx_b_stride, idx_h_stride, items = _index_args(block_indices, table, H)
    main, combine = (compile_decode_fp8(q.dtype, d, group).get_kernel(x) for x in fp8_kernel_names(q.dtype, d, group))
    if num_splits is None:
        num_splits = choose_splits(B, H, items * pool.block_size, _device_sms(q.device.index or 0), FP8_CTAS_PER_SM)
    num_splits = max(num_splits, -(-items // FP8_MAX_ITEMS), 1)
    out = torch.empty_like(q)
    o_part, ml_part = _partials(q, num_splits)
    main.launch((num_splits, H, B), THREADS,
                [q, kc.view(torch.uint8), vc.view(torch.uint8), ks.contiguous(), vs.contiguous(), table, table.shape[1],
                 seq_lens, idx, idx_b_stride, idx_h_stride, n, out, o_part, ml_part,
                 scale_log2, pool.block_size])
    if num_splits > 1:
        combine.launch(B * hq, d, [o_part, ml_part, out, num_splits])
    return out
