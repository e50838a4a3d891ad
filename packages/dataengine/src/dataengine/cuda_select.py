"""GPU block selection: compilation (tilehal.compile_cuda) and launch of kernels/select.cuh.

One launch per call where it applies (quest_select_chunk_kernel: scores, per-chunk top-k, the row's
last CTA merges), else two (Quest scores, then the per-row top-k); no host synchronization, so a
decode step that selects and attends can be captured in a CUDA graph. select.py decides when
these run; the torch reference in select.py is the oracle they are tested against.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from pathlib import Path

import tilehal
import torch

log = logging.getLogger("dataengine.cuda_select")

KERNEL_DIR = Path(__file__).with_name("kernels")
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16  # q heads per kv head held in registers by the score kernel
SCORE_CHUNK = 256  # kScoreChunk: table positions per score CTA
SCORE_THREADS, TOPK_THREADS, FAST_THREADS = 256, 512, 1024  # kScoreThreads, kTopkThreads, kFastThreads (static_asserted)
# The host's copies of the kernels' launch constants, held to the kernels' at compile time.
_CHECKS = (f'static_assert(dataengine::kScoreThreads == {SCORE_THREADS}, "dataengine.cuda_select.SCORE_THREADS");\n'
           f'static_assert(dataengine::kTopkThreads == {TOPK_THREADS}, "dataengine.cuda_select.TOPK_THREADS");\n'
           f'static_assert(dataengine::kScoreChunk == {SCORE_CHUNK}, "dataengine.cuda_select.SCORE_CHUNK");\n'
           f'static_assert(dataengine::kFastThreads == {FAST_THREADS}, "dataengine.cuda_select.FAST_THREADS");\n')
TOPK_STAGE_BYTES = 160 * 1024  # the staged top-k keeps rows of up to 40960 keys in shared memory
_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}
FP8 = torch.float8_e4m3fn
_S_CTYPES = {**_CTYPES, FP8: "__nv_fp8_e4m3"}  # summaries may also be fp8 (rounded outward by their writer)
_S_CTYPES_MMA = {torch.bfloat16: "__nv_bfloat16", FP8: "__nv_fp8_e4m3", torch.uint8: "dataengine::Q4"}
SCORE_KERNELS = ("auto", "simt", "mma")
DEFAULT_SCORE = "auto"  # tensor cores where they apply: 78 vs 91 us (bf16), 57 vs 91 us (fp8) at b8 x 8192 blocks
MMA_HEAD_DIMS = (64, 128)
MMA_MAX_GROUP = 8
_REDUCE = {"max": 0, "sum": 1, "mean": 2}
FAST_ITEMS = (8, 16, 32)  # keys per thread of topk_fast_kernel (1024 threads): rows up to 32768 keys
# the X fast variants (float4 loads, cta_topk's early exit): fastx (1024 threads, FAST_ITEMS) and the
# fewer-thread fast512 / fast256 (keys per thread for rows up to threads x items)
FEW_THREADS_ITEMS = {512: (16, 32), 256: (32,)}
TOPK_KERNELS = {"plain": "dataengine::topk_select_kernel<false>", "staged": "dataengine::topk_select_kernel<true>",
                **{f"fast{i}": f"dataengine::topk_fast_kernel<{i}>" for i in FAST_ITEMS},
                **{f"fastx{i}": f"dataengine::topk_fast_kernel<{i}, {FAST_THREADS}, true>" for i in FAST_ITEMS},
                **{f"fast{i}_{t}": f"dataengine::topk_fast_kernel<{i}, {t}, true>"
                   for t, its in FEW_THREADS_ITEMS.items() for i in its}}
TOPK_KERNEL = TOPK_KERNELS["plain"]


def score_kernel_name(q_dtype: torch.dtype, s_dtype: torch.dtype, head_dim: int, group: int, reduce: str,
                      variant: str = "simt") -> str:
    if variant == "mma":
        return f"dataengine::quest_score_mma_kernel<{_S_CTYPES_MMA[s_dtype]}, {head_dim}, {group}, {_REDUCE[reduce]}>"
    return (f"dataengine::quest_score_kernel<{_CTYPES[q_dtype]}, {_S_CTYPES[s_dtype]}, {head_dim}, {group}, "
            f"{_REDUCE[reduce]}>")


@functools.cache
def compile_score(q_dtype: torch.dtype, s_dtype: torch.dtype, head_dim: int, group: int, reduce: str,
                  arch: str = "sm_90a", variant: str = "simt") -> tilehal.CudaModule:
    """The Quest score kernel for one (q dtype, summary dtype, head_dim, group, reduce, variant)."""
    # No --use_fast_math: bounds must follow IEEE (no flush of subnormals) to match the reference.
    return tilehal.compile_cuda('#include "select.cuh"\n' + _CHECKS, arch=arch,
                                name=f"quest_score_{variant}_{head_dim}_{group}", include_dirs=[str(KERNEL_DIR)],
                                name_expressions=[score_kernel_name(q_dtype, s_dtype, head_dim, group, reduce,
                                                                    variant)])


CHUNK_MAX = 2048  # kChunkMax: table positions per CTA of quest_select_chunk_kernel (8 keys per thread)
CHUNK_THREADS = SCORE_THREADS
RING_STAGES = {FP8: 3, torch.uint8: 4}  # kFp8Stages / kQ4Stages: 16-block tiles in each warp's cp.async ring
RING_VARIANTS = ("on", "off")
DEFAULT_RING = "on"  # H200 (2026-12-02 R1): score 50.4 vs 56.7 us fp8, 49.5 vs 55.8 us int4 at b8 x 128K


def ring_variant() -> str:
    """DATAENGINE_RING_SCORES (default DEFAULT_RING): "on" scores fp8 summaries and int4 rows (head_dim
    128) through per-warp cp.async rings in quest_select_chunk_kernel (fp8: codes straight into an
    f16 MMA, one cvt per two codes, against q scaled by a power of two; an exact bf16 recomputation
    for tiles holding the NaN codes; int4: the streamed kernel's arithmetic); "off": the register
    path of quest_score_mma_kernel (fp8 codes decoded to bf16)."""
    v = os.environ.get("DATAENGINE_RING_SCORES") or DEFAULT_RING
    if v not in RING_VARIANTS:
        raise tilehal.ArgumentError(f"DATAENGINE_RING_SCORES: expected one of {list(RING_VARIANTS)}, got {v!r}")
    return v


RING_GRIDS = ("auto", "chunk", "heads", "records")
# "auto": records for int4 rows, heads for fp8 summaries. H200 (2026-12-02, session 28, b8 x 128K, same run):
# int4 score kernel records 38.1 vs heads 44.0 us (paired groups), fp8 records 45.9 vs heads 45.2 us;
# earlier (R2): heads vs chunk fp8 57.4 vs 58.2 us, int4 58.9 vs 60.3 us
DEFAULT_RING_GRID = "auto"


def ring_grid(s_dtype: torch.dtype | None = None) -> str:
    """DATAENGINE_RING_GRID (default DEFAULT_RING_GRID) for summaries of s_dtype, the two-launch
    path's ring scores: "auto" (records for int4 rows, else heads; without s_dtype: "auto"),
    "chunk" (quest_select_chunk_kernel: a CTA per (chunk, kv head, sequence), its warps splitting
    the chunk) or "heads" (quest_score_heads_kernel: a CTA per (chunk, sequence), warp h = kv head
    h over the whole chunk, so a block's kv-head rows are read together; <= 8 kv heads) or "records"
    (quest_score_records_kernel: the heads grid with one ring per CTA whose stages hold 16 blocks'
    whole records, copied by all threads in record order: a record fetched at once, one barrier per
    tile; with DATAENGINE_RING_OCC=3 for int4 rows with paired groups only)."""
    v = os.environ.get("DATAENGINE_RING_GRID") or DEFAULT_RING_GRID
    if v not in RING_GRIDS:
        raise tilehal.ArgumentError(f"DATAENGINE_RING_GRID: expected one of {list(RING_GRIDS)}, got {v!r}")
    if v == "auto" and s_dtype is not None:
        return "records" if s_dtype == torch.uint8 else "heads"
    return v


RING_Q4_VARIANTS = ("groups", "pairs")
# H200 (session 28, b8 x 128K, same run): int4 score kernel 43.97 vs 46.21 us (heads grid), 38.06 vs
# 39.94 us (records grid); one launch at 8K / 16K: select 16.96 / 20.98 vs 17.70 / 22.02 us (with fastx)
DEFAULT_RING_Q4 = "pairs"
PAIRS_MAX_GROUP = 4  # paired int4 groups: the q heads of a kv head fill half of the m16n8 accumulator


def ring_q4() -> str:
    """DATAENGINE_RING_Q4 (default DEFAULT_RING_Q4), the int4 rows' epilogue in the ring scores:
    "groups" (per 32-channel group: step * A + (lo - 16 step) * sum(q) on every accumulator) or
    "pairs" (<= 4 q heads per kv head: two groups per accumulator, columns 0-3 and 4-7, so the
    per-group epilogue runs half as often: 402 vs 509 instructions per 16-block tile, sm_90a SASS;
    only the order of the float32 sums differs)."""
    v = os.environ.get("DATAENGINE_RING_Q4") or DEFAULT_RING_Q4
    if v not in RING_Q4_VARIANTS:
        raise tilehal.ArgumentError(f"DATAENGINE_RING_Q4: expected one of {list(RING_Q4_VARIANTS)}, got {v!r}")
    return v


RING_FP8_VARIANTS = ("cvt", "h1")
# H200 (session 28, b8 x 128K, same run): fp8 score kernel 44.67 vs 45.18 us; select (fastx) 55.06 vs 56.64 us
DEFAULT_RING_FP8 = "h1"


def ring_fp8() -> str:
    """DATAENGINE_RING_FP8 (default DEFAULT_RING_FP8), fp8 summaries' code widening in the ring scores:
    "cvt" (each code pair shifted into the low half for cvt.rn.f16x2.e4m3x2) or "h1" (the high pairs
    named as the register's upper half in the PTX: ptxas reads them as R.H1, 32 SHF fewer per tile).
    The same conversions either way."""
    v = os.environ.get("DATAENGINE_RING_FP8") or DEFAULT_RING_FP8
    if v not in RING_FP8_VARIANTS:
        raise tilehal.ArgumentError(f"DATAENGINE_RING_FP8: expected one of {list(RING_FP8_VARIANTS)}, got {v!r}")
    return v


def _pairs(s_dtype: torch.dtype, group: int) -> bool:
    """Whether the ring scores take the session-28 tile code (the kernels' PAIRS): int4 rows, the
    paired-groups epilogue (DATAENGINE_RING_Q4=pairs); fp8 summaries, the R.H1 code widening
    (DATAENGINE_RING_FP8=h1)."""
    if s_dtype == FP8:
        return ring_fp8() == "h1"
    if s_dtype != torch.uint8 or ring_q4() != "pairs":
        return False
    if group > PAIRS_MAX_GROUP:
        log.debug("int4 ring scores: %d q heads per kv head > %d; per-group epilogue", group, PAIRS_MAX_GROUP)
        return False
    return True


RING_OCCS = ("2", "3")
DEFAULT_RING_OCC = "2"


def ring_occ() -> int:
    """DATAENGINE_RING_OCC (default DEFAULT_RING_OCC): CTAs per SM quest_score_heads_kernel is built
    and its grid sized for: 2 (the rings' stages: fp8 3, int4 4) or 3 (80 registers, one stage fewer:
    fp8 2, int4 3, so three CTAs fit the shared memory: 24 warps per SM instead of 16; int4 rows only
    with DATAENGINE_RING_Q4=pairs, fp8 summaries only without DATAENGINE_RING_FP8=h1 and on the heads
    grid: the others spill at 80 registers)."""
    v = os.environ.get("DATAENGINE_RING_OCC") or DEFAULT_RING_OCC
    if v not in RING_OCCS:
        raise tilehal.ArgumentError(f"DATAENGINE_RING_OCC: expected one of {list(RING_OCCS)}, got {v!r}")
    return int(v)


def heads_kernel_name(s_dtype: torch.dtype, head_dim: int, group: int, reduce: str, kv_heads: int,
                      pairs: bool = False, occ: int = 2) -> str:
    tail = f", {str(pairs).lower()}, {occ}" if occ != 2 else (", true" if pairs else "")
    return (f"dataengine::quest_score_heads_kernel<{_S_CTYPES_MMA[s_dtype]}, {head_dim}, {group}, {_REDUCE[reduce]}, "
            f"{kv_heads}{tail}>")


@functools.cache
def compile_heads(s_dtype: torch.dtype, head_dim: int, group: int, reduce: str, kv_heads: int,
                  arch: str = "sm_90a", pairs: bool = False, occ: int = 2, pdl: bool = False) -> tilehal.CudaModule:
    """quest_score_heads_kernel for one configuration (`pdl`: the -DDATAENGINE_PDL build)."""
    return tilehal.compile_cuda('#include "select.cuh"\n' + _CHECKS + _CHUNK_CHECKS, arch=arch,
                                name=f"quest_score_heads_{head_dim}_{group}_{kv_heads}{'p' if pairs else ''}"
                                     f"{'o3' if occ == 3 else ''}{'_pdl' if pdl else ''}",
                                include_dirs=[str(KERNEL_DIR)], options=_pdl_options(pdl),
                                name_expressions=[heads_kernel_name(s_dtype, head_dim, group, reduce, kv_heads, pairs,
                                                                    occ)])


def _pdl_options(pdl: bool) -> list[str]:
    """The compile options of a programmatic-dependent-launch build (TILESTACK_PDL=1; the heads / records
    score kernels and the top-k kernels wait for the previous kernel at entry)."""
    return ["-DDATAENGINE_PDL"] if pdl else []


def records_kernel_name(s_dtype: torch.dtype, head_dim: int, group: int, reduce: str, kv_heads: int,
                        pairs: bool = False, occ: int = 2) -> str:
    return (f"dataengine::quest_score_records_kernel<{_S_CTYPES_MMA[s_dtype]}, {head_dim}, {group}, "
            f"{_REDUCE[reduce]}, {kv_heads}, {str(pairs).lower()}, {occ}>")


@functools.cache
def compile_records(s_dtype: torch.dtype, head_dim: int, group: int, reduce: str, kv_heads: int,
                    arch: str = "sm_90a", pairs: bool = False, occ: int = 2, pdl: bool = False) -> tilehal.CudaModule:
    """quest_score_records_kernel for one configuration (`pdl`: the -DDATAENGINE_PDL build)."""
    return tilehal.compile_cuda('#include "select.cuh"\n' + _CHECKS + _CHUNK_CHECKS, arch=arch,
                                name=f"quest_score_records_{head_dim}_{group}_{kv_heads}{'p' if pairs else ''}o{occ}"
                                     f"{'_pdl' if pdl else ''}",
                                include_dirs=[str(KERNEL_DIR)], options=_pdl_options(pdl),
                                name_expressions=[records_kernel_name(s_dtype, head_dim, group, reduce, kv_heads,
                                                                      pairs, occ)])


def records_smem_bytes(s_dtype: torch.dtype, head_dim: int, kv_heads: int, occ: int = 2) -> int:
    """Dynamic shared memory of quest_score_records_kernel: its stages of 16 blocks' records (int4 rows
    of an even number of kv heads: records padded by 16 bytes)."""
    row = (head_dim // 2 + head_dim // 8) if s_dtype == torch.uint8 else head_dim
    pitch = kv_heads * row + (16 if s_dtype == torch.uint8 and kv_heads % 2 == 0 else 0)
    return (RING_STAGES[s_dtype] - (occ == 3)) * 2 * 16 * pitch


def heads_smem_bytes(s_dtype: torch.dtype, head_dim: int, kv_heads: int, occ: int = 2) -> int:
    """Dynamic shared memory of quest_score_heads_kernel: one ring per warp (kv head)."""
    stages = RING_STAGES[s_dtype] - (occ == 3)
    return chunk_smem_bytes(s_dtype, head_dim, False, True) // RING_STAGES[s_dtype] * stages * kv_heads // (
        CHUNK_THREADS // 32)


def heads_chunk(device: torch.device, batch: int, nb: int, occ: int = 2) -> int:
    """Positions per CTA of quest_score_heads_kernel: about one wave (occ CTAs per SM), a multiple
    of 16, at most CHUNK_MAX."""
    slots = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * occ
    chunks = max(1, slots // max(batch, 1))
    per = -(-nb // chunks)
    return max(16, min(CHUNK_MAX, -(-per // 16) * 16))


RING_MAX_BYTES = 1 << 36  # the rings address summaries in 32-bit units of 16 bytes


def _ring(s_dtype: torch.dtype, head_dim: int, nbytes: int = 0) -> bool:
    if ring_variant() == "off" or s_dtype not in RING_STAGES:
        return False
    if nbytes >= RING_MAX_BYTES:
        log.debug("ring scores: %d bytes of summaries exceed 32-bit 16-byte offsets; register path", nbytes)
        return False
    if s_dtype == torch.uint8 and head_dim != 128:
        log.debug("ring scores: int4 rows of head_dim %d are not whole 16-byte chunks; register path", head_dim)
        return False
    return True


def chunk_kernel_name(s_dtype: torch.dtype, head_dim: int, group: int, reduce: str, fused: bool, ring: bool,
                      pairs: bool = False) -> str:
    return (f"dataengine::quest_select_chunk_kernel<{_S_CTYPES_MMA[s_dtype]}, {head_dim}, {group}, {_REDUCE[reduce]}, "
            f"{str(fused).lower()}, {str(ring).lower()}{', true' if pairs else ''}>")


@functools.cache
def compile_chunk(s_dtype: torch.dtype, head_dim: int, group: int, reduce: str, fused: bool, ring: bool,
                  arch: str = "sm_90a", pairs: bool = False) -> tilehal.CudaModule:
    """quest_select_chunk_kernel for one configuration (fused: the whole selection; else the scores)."""
    return tilehal.compile_cuda('#include "select.cuh"\n' + _CHECKS + _CHUNK_CHECKS, arch=arch,
                                name=f"quest_select_chunk_{head_dim}_{group}_{int(fused)}{int(ring)}{'p' if pairs else ''}",
                                include_dirs=[str(KERNEL_DIR)],
                                name_expressions=[chunk_kernel_name(s_dtype, head_dim, group, reduce, fused, ring,
                                                                    pairs)])


_CHUNK_CHECKS = (f'static_assert(dataengine::kChunkMax == {CHUNK_MAX}, "dataengine.cuda_select.CHUNK_MAX");\n'
                 f'static_assert(dataengine::kFp8Stages == {RING_STAGES[FP8]}, "dataengine.cuda_select.RING_STAGES");\n'
                 f'static_assert(dataengine::kQ4Stages == {RING_STAGES[torch.uint8]}, "dataengine.cuda_select.RING_STAGES");\n')


def chunk_smem_bytes(s_dtype: torch.dtype, head_dim: int, fused: bool, ring: bool) -> int:
    """Dynamic shared memory of quest_select_chunk_kernel: the warps' rings (ring), at least the
    top-k histogram (fused)."""
    row = (head_dim // 2 + head_dim // 8) if s_dtype == torch.uint8 else head_dim
    ring_bytes = (CHUNK_THREADS // 32) * RING_STAGES[s_dtype] * 2 * 16 * row if ring else 0
    return max(ring_bytes, 4 * 4096 if fused else 0)


DEFAULT_FUSED = "auto"  # H200 R2 (2026-12-02, b8 x 128K fp8): one launch 62.9 us vs two launches (ring, heads grid) 57.4
# "auto": one launch for rows of at most this many blocks with ring scores (fp8, int4 rows; others: CHUNK_MAX).
# H200 (session 28, same run): at 2048 blocks (32K) two launches are faster (fp8 26.24 vs 27.55 us, int4
# 25.66 vs 28.75 us), at 1024 (16K) a tie (fp8 20.48 vs 20.42, int4 20.75 vs 20.98 us), at 512 (8K) one
# launch (fp8 17.26 vs 17.98 us)
FUSED_AUTO_MAX = 1024


def fused_variant() -> str:
    """DATAENGINE_SELECT_FUSED (default DEFAULT_FUSED): "auto" runs select_blocks in one launch of
    quest_select_chunk_kernel for rows of <= FUSED_AUTO_MAX blocks with ring scores (fp8, int4 rows),
    <= CHUNK_MAX otherwise (one CTA a row, no merge), "1"
    also for longer rows (up to CHUNK_MAX blocks one CTA, longer ones in chunks whose row's last CTA
    merges), both where `fused_reason` allows; "0" never."""
    v = os.environ.get("DATAENGINE_SELECT_FUSED") or DEFAULT_FUSED
    if v not in ("auto", "0", "1"):
        raise tilehal.ArgumentError(f"DATAENGINE_SELECT_FUSED: expected auto, 0 or 1, got {v!r}")
    return v


def fused_chunk(device: torch.device, rows: int, nb: int) -> int:
    """Positions per CTA of the one-launch selection: the whole row when it fits one CTA (no
    merge: the merge's second top-k, ticket and candidate round trip cost more than the
    parallelism a wave of smaller chunks buys, R1: 23.6 us at 8K, 32.5 us at 32K with four chunks
    per row), else about one wave of CTAs (mma_chunk)."""
    if nb <= CHUNK_MAX:
        return max(16, -(-nb // 16) * 16)
    return mma_chunk(device, rows, nb, CHUNK_MAX)


def fused_reason(q: torch.Tensor, kmin: torch.Tensor, width: int, nb: int) -> str | None:
    """Why select_fused cannot serve this call (None: it can)."""
    variant = fused_variant()
    if variant == "0":
        return "DATAENGINE_SELECT_FUSED=0"
    limit = FUSED_AUTO_MAX if _ring(kmin.dtype, q.shape[-1]) else CHUNK_MAX  # bf16: two launches not measured there
    if variant == "auto" and nb > limit:
        return (f"{nb} blocks per row > {limit} (DATAENGINE_SELECT_FUSED=auto: longer rows take two launches, "
                "faster on the H200)")
    if score_variant() == "simt":
        return "DATAENGINE_SCORE_KERNEL=simt"
    reason = mma_reason(q, kmin)
    if reason is not None:
        return reason
    if nb == 0:
        return None
    chunk = fused_chunk(q.device, q.shape[0] * kmin.shape[1], nb)
    n_cand = -(-nb // chunk) * min(width, chunk)
    if n_cand > CHUNK_MAX:
        return f"{n_cand} merge candidates per row (budget {width}, chunks of {chunk}) > {CHUNK_MAX}"
    return None


_TICKETS: dict[tuple, torch.Tensor] = {}


def _tickets(device: torch.device, rows: int) -> torch.Tensor:
    """Per-row tickets of the one-launch selections: zero between launches (the last CTA of a row
    resets its ticket), one buffer per (device, stream) so concurrent streams never share one."""
    return tilehal.stream_buffer(_TICKETS, device, rows, min_numel=256)


def _prepare(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, width: int,
             local: int, num_valid: torch.Tensor | None, seq_lens: torch.Tensor | None, block_size: int | None):
    """The one-launch selections' output (int32 [B, kv_heads, width], unwritten) and inputs, or
    (out, None) when nothing is left to compute (out already final). Inputs: contiguous, 16-byte
    aligned summaries (copied, said at DEBUG, when a view is not), 4-byte aligned q, int32 table,
    and the n_valid mode (0: the table width, 1: num_valid, 2: ceil(seq_lens / block_size)) with
    its tensor."""
    B, Hq, D = q.shape
    H, nb = kmin.shape[1], block_table.shape[1]
    out = torch.empty((B, H, width), dtype=torch.int32, device=q.device)
    if out.numel() == 0 or nb == 0:
        return out.fill_(-1), None
    table = _i32(block_table)
    kmin, kmax = kmin.contiguous(), kmax.contiguous()
    if not _aligned(kmin, kmax):
        log.debug("select: summaries not 16-byte aligned; copying them")
        kmin, kmax = kmin.clone(), kmax.clone()
    q = q.contiguous()
    if q.data_ptr() % 4:
        q = q.clone()
    nv = sl = None
    if num_valid is not None:
        mode, nv = 1, _i32(num_valid.clamp(min=-1, max=nb + local + 1))
    elif seq_lens is not None and block_size is not None:
        mode, sl = 2, _i32(seq_lens)
    else:
        mode = 0
    return out, types.SimpleNamespace(B=B, H=H, D=D, group=Hq // H, nb=nb, q=q, kmin=kmin, kmax=kmax, table=table,
                                      mode=mode, nv=nv, sl=sl)


def select_fused(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, width: int,
                 sink: int, local: int, reduce: str, *, num_valid: torch.Tensor | None = None,
                 seq_lens: torch.Tensor | None = None, block_size: int | None = None) -> torch.Tensor:
    """int32 [B, kv_heads, width]: select_blocks in one launch (fused_reason must be None)."""
    out, a = _prepare(q, kmin, kmax, block_table, width, local, num_valid, seq_lens, block_size)
    if a is None:
        return out
    B, H, D, group, nb, q, kmin, kmax = a.B, a.H, a.D, a.group, a.nb, a.q, a.kmin, a.kmax
    table, mode, nv, sl = a.table, a.mode, a.nv, a.sl
    chunk = fused_chunk(q.device, B * H, nb)
    chunks = -(-nb // chunk)
    wc = min(width, chunk)
    cand = torch.empty((B * H * chunks * wc, 2), dtype=torch.int32, device=q.device)
    ring = _ring(kmin.dtype, D, kmin.numel() * kmin.element_size())
    pairs = ring and _pairs(kmin.dtype, group)
    kern = compile_chunk(kmin.dtype, D, group, reduce, True, ring, pairs=pairs).get_kernel(
        chunk_kernel_name(kmin.dtype, D, group, reduce, True, ring, pairs))
    kern.launch((chunks, H, B), CHUNK_THREADS, [q, kmin, kmax, table, nb, kmin.shape[0], chunk, None, mode, nv, sl,
                                                int(block_size or 1), int(sink), int(local), int(width), cand,
                                                _tickets(q.device, B * H), out],
                smem_bytes=chunk_smem_bytes(kmin.dtype, D, True, ring))
    return out


def score_variant() -> str:
    """DATAENGINE_SCORE_KERNEL (default DEFAULT_SCORE): "auto" (tensor cores where `mma_reason`
    allows), "simt" (CUDA cores; int4 rows still use tensor cores, the only kernel for them) or
    "mma" (tensor cores; an unsupported call is an error, not a fallback)."""
    v = os.environ.get("DATAENGINE_SCORE_KERNEL") or DEFAULT_SCORE
    if v not in SCORE_KERNELS:
        raise tilehal.ArgumentError(f"DATAENGINE_SCORE_KERNEL: expected one of {list(SCORE_KERNELS)}, got {v!r}")
    return v


def mma_reason(q: torch.Tensor, kmin: torch.Tensor) -> str | None:
    """Why the tensor-core score kernel cannot serve this call (None: it can)."""
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} (mma kernel: bf16)"
    if kmin.dtype not in _S_CTYPES_MMA:
        return f"summary dtype {kmin.dtype} (mma kernel: bf16, float8_e4m3fn or int4 rows)"
    if q.shape[-1] not in MMA_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (mma kernel: {MMA_HEAD_DIMS})"
    if q.shape[1] // kmin.shape[1] > MMA_MAX_GROUP:
        return f"{q.shape[1] // kmin.shape[1]} q heads per kv head (mma kernel: <= {MMA_MAX_GROUP})"
    return None


@functools.cache
def compile_topk(arch: str = "sm_90a", pdl: bool = False) -> tilehal.CudaModule:
    return tilehal.compile_cuda('#include "select.cuh"\n' + _CHECKS, arch=arch, name=f"topk_select{'_pdl' if pdl else ''}",
                                include_dirs=[str(KERNEL_DIR)], options=_pdl_options(pdl),
                                name_expressions=list(TOPK_KERNELS.values()))


TOPK_VARIANTS = ("auto", "fast", "plain", "staged", "fastx", "fast512", "fast256")
DEFAULT_TOPK = "auto"
# "auto": the fastx kernel from this many keys per row on, plain below. Measured on the H200
# (2026-12-02, docs/benchmarks/dataengine_select_cuda_kernels.json, 64 rows): plain 9.9 / 11.0 /
# 12.4 / 16.0 / 24.9 us at 512 / 1024 / 2048 / 4096 / 8192 keys, fast 15.0 / 15.2 / 15.0 / 15.4 / 16.0;
# session 28 (same run, 8192 keys): fastx 11.84, fast 13.47, fast512 12.96, fast256 18.08 us; rows of
# 2048 blocks (32K) take two launches with fastx, faster than one (fp8 26.24 vs 27.55 us).
FAST_TOPK_FROM = 2048


def topk_variant() -> str:
    """DATAENGINE_TOPK_KERNEL (default DEFAULT_TOPK): "auto" (fastx from FAST_TOPK_FROM keys per row,
    plain below), "fast" (topk_fast_kernel, rows up to 32768 keys, else "plain"), "plain" (512
    threads, 4 x 8-bit radix passes from L2), "staged" (keys in shared memory; measured no faster
    than plain on the H200: 28.2 vs 24.5 us at 8192 keys), "fastx" (the fast kernel with float4
    loads and cta_topk's early exit: a radix pass whose bin holds exactly the keys still needed ends
    the search) or "fast512" / "fast256" (fastx with 512 threads x 16-32 keys / 256 threads x 32
    keys: fewer warps per barrier; longer rows take the 1024-thread fast kernel)."""
    v = os.environ.get("DATAENGINE_TOPK_KERNEL") or DEFAULT_TOPK
    if v not in TOPK_VARIANTS:
        raise tilehal.ArgumentError(f"DATAENGINE_TOPK_KERNEL: expected one of {list(TOPK_VARIANTS)}, got {v!r}")
    return v


def unsupported_reason(q: torch.Tensor, kmin: torch.Tensor) -> str | None:
    """Why the CUDA score kernel cannot serve this call (None: it can)."""
    if q.device.type != "cuda":
        return f"q on {q.device}"
    if kmin.dtype == torch.uint8:  # int4 rows: tensor cores only
        why = mma_reason(q, kmin)
        return None if why is None else f"int4 summaries need the tensor-core kernel ({why})"
    if q.dtype not in _CTYPES or kmin.dtype not in _S_CTYPES:
        return f"dtypes q={q.dtype} summaries={kmin.dtype} (kernel: q bf16/fp16/fp32, summaries also fp8 e4m3)"
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        return f"head_dim {D} (kernel: {HEAD_DIMS})"
    group = q.shape[1] // kmin.shape[1]
    if group > MAX_GROUP:
        return f"{group} q heads per kv head (kernel: <= {MAX_GROUP})"
    if kmin.device != q.device:
        return f"summaries on {kmin.device}, q on {q.device}"
    return None


def _aligned(*ts: torch.Tensor) -> bool:
    """16-byte loads need 16-byte aligned rows (true for kvpool's summaries; a sliced view may not be)."""
    return all(t.data_ptr() % 16 == 0 for t in ts)


MMA_MAX_CHUNK = 4096  # kMmaMaxChunk
MMA_CTAS_PER_SM = 2  # the score kernels' __launch_bounds__ minimum


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def mma_chunk(device: torch.device, rows: int, nb: int, max_chunk: int = MMA_MAX_CHUNK) -> int:
    """Table positions per CTA of the tensor-core score kernels: about one wave of CTAs (long-lived
    CTAs keep loads in flight), a multiple of 128 (8 warps x 16-block tiles), at most max_chunk."""
    slots = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * MMA_CTAS_PER_SM
    chunks = max(1, slots // max(rows, 1))
    chunk = -(-nb // chunks)
    return max(128, min(max_chunk, -(-chunk // 128) * 128))


def _pick_variant(q: torch.Tensor, kmin: torch.Tensor, variant: str | None) -> str:
    variant = score_variant() if variant is None else variant
    if kmin.dtype == torch.uint8:  # int4 rows: unsupported_reason has checked mma_reason
        return "mma"
    if variant == "simt":
        return "simt"
    reason = mma_reason(q, kmin)
    if reason is None:
        return "mma"
    if variant == "mma":
        raise tilehal.ArgumentError(f"DATAENGINE_SCORE_KERNEL=mma: the tensor-core kernel cannot serve this call ({reason})")
    log.debug("quest scores: CUDA-core kernel (%s)", reason)
    return "simt"


def _i32(t: torch.Tensor) -> torch.Tensor:
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def quest_raw_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                     reduce: str, variant: str | None = None) -> torch.Tensor:
    """float32 [B, kv_heads, max_blocks]: the reduced Quest bound of every table position (holes
    read block 0 as in the reference; ids >= num_blocks give -inf). No sequence-length masking."""
    B, Hq, D = q.shape
    H = kmin.shape[1]
    group = Hq // H
    table = _i32(block_table)
    nb = table.shape[1]
    raw = torch.empty((B, H, nb), dtype=torch.float32, device=q.device)
    if B == 0 or nb == 0:
        return raw
    variant = _pick_variant(q, kmin, variant)
    ring = variant == "mma" and _ring(kmin.dtype, D, kmin.numel() * kmin.element_size())
    if not ring:
        kern = compile_score(q.dtype, kmin.dtype, D, group, reduce, variant=variant).get_kernel(
            score_kernel_name(q.dtype, kmin.dtype, D, group, reduce, variant))
    chunks = -(-nb // SCORE_CHUNK)
    kmin, kmax = kmin.contiguous(), kmax.contiguous()
    if not _aligned(kmin, kmax):  # a copy, said out loud, rather than a misaligned load
        log.debug("quest scores: summaries not 16-byte aligned; copying them")
        kmin, kmax = kmin.clone(), kmax.clone()
    q = q.contiguous()
    if q.data_ptr() % 4:  # the mma kernel reads q as 32-bit words
        q = q.clone()
    pairs = ring and _pairs(kmin.dtype, group)
    grid = ring_grid(kmin.dtype) if ring else None
    if grid in ("heads", "records") and H <= 8:
        occ = ring_occ()
        if occ == 3 and (kmin.dtype == torch.uint8) != pairs:  # 80 registers: these spill
            log.debug("DATAENGINE_RING_OCC=3: %s spill at 80 registers; 2 CTAs per SM",
                      "int4 rows without paired groups" if kmin.dtype == torch.uint8 else "fp8 summaries with h1")
            occ = 2
        if occ == 3 and grid == "records" and kmin.dtype != torch.uint8:  # fp8 records spill at 80 registers
            log.debug("DATAENGINE_RING_OCC=3: fp8 summaries on the records grid spill at 80 registers; 2 CTAs per SM")
            occ = 2
        chunk = heads_chunk(q.device, B, nb, occ)
        pdl = tilehal.pdl_requested()
        if grid == "records":
            kern = compile_records(kmin.dtype, D, group, reduce, H, pairs=pairs, occ=occ, pdl=pdl).get_kernel(
                records_kernel_name(kmin.dtype, D, group, reduce, H, pairs, occ))
            smem = records_smem_bytes(kmin.dtype, D, H, occ)
        else:
            kern = compile_heads(kmin.dtype, D, group, reduce, H, pairs=pairs, occ=occ, pdl=pdl).get_kernel(
                heads_kernel_name(kmin.dtype, D, group, reduce, H, pairs, occ))
            smem = heads_smem_bytes(kmin.dtype, D, H, occ)
        kern.launch((-(-nb // chunk), B), 32 * H, [q, kmin, kmax, table, nb, kmin.shape[0], chunk, raw],
                    smem_bytes=smem, pdl=pdl)
    elif ring:
        chunk = mma_chunk(q.device, B * H, nb, CHUNK_MAX)
        kern = compile_chunk(kmin.dtype, D, group, reduce, False, True, pairs=pairs).get_kernel(
            chunk_kernel_name(kmin.dtype, D, group, reduce, False, True, pairs))
        kern.launch((-(-nb // chunk), H, B), CHUNK_THREADS, [q, kmin, kmax, table, nb, kmin.shape[0], chunk, raw, 0,
                                                             None, None, 1, 0, 0, 0, None, None, None],
                    smem_bytes=chunk_smem_bytes(kmin.dtype, D, False, True))
    elif variant == "mma":
        chunk = mma_chunk(q.device, B * H, nb)
        kern.launch((-(-nb // chunk), H, B), SCORE_THREADS, [q, kmin, kmax, table, nb, kmin.shape[0], raw, chunk])
    else:
        kern.launch((chunks, H, B), SCORE_THREADS, [q, kmin, kmax, table, nb, kmin.shape[0], raw])
    return raw


def topk_rows(scores: torch.Tensor, width: int, rows_per_b: int, sink: int, local: int, *,
              num_valid: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
              block_size: int | None = None, block_table: torch.Tensor | None = None,
              variant: str | None = None) -> torch.Tensor:
    """int32 [*scores.shape[:-1], width]: the reference's `_select` on the GPU.

    n_valid per batch entry: `num_valid`, else ceil(seq_lens / block_size) when block_size is
    given, else the non -1 entries of `block_table` (0 for empty sequences), else all positions.
    """
    N = scores.shape[-1]
    lead = scores.shape[:-1]
    rows = 1
    for s in lead:
        rows *= s
    out = torch.empty((*lead, width), dtype=torch.int32, device=scores.device)
    if rows == 0 or width == 0:
        return out
    s = scores.float().contiguous()
    nv = sl = tb = None
    if num_valid is not None:
        mode, nv = 1, _i32(num_valid.clamp(min=-1, max=N + local + 1))
    elif seq_lens is not None and block_size is not None:
        mode, sl = 2, _i32(seq_lens)
    elif seq_lens is not None and block_table is not None:
        mode, sl, tb = 3, _i32(seq_lens), _i32(block_table)
    else:
        mode = 0
    variant = topk_variant() if variant is None else variant
    if variant == "staged" and N * 4 > TOPK_STAGE_BYTES:
        log.debug("topk: %d keys exceed the staged kernel's shared memory; running the plain kernel", N)
        variant = "plain"
    threads = TOPK_THREADS
    if variant == "auto":
        variant = "fastx" if N >= FAST_TOPK_FROM else "plain"
    if variant in ("fast512", "fast256"):
        t = int(variant[4:])
        items = next((i for i in FEW_THREADS_ITEMS[t] if N <= t * i), None)
        if items is None:
            log.debug("topk: %d keys exceed %s's registers; running the 1024-thread fastx kernel", N, variant)
            variant = "fastx"
        else:
            variant, threads = f"fast{items}_{t}", t
    if variant in ("fast", "fastx"):
        items = next((i for i in FAST_ITEMS if N <= FAST_THREADS * i), None)
        if items is None:
            log.debug("topk: %d keys exceed the fast kernel's registers; running the plain kernel", N)
            variant = "plain"
        else:
            variant, threads = f"{variant}{items}", FAST_THREADS
    if TOPK_KERNELS[variant].endswith(", true>") and s.data_ptr() % 16:
        s = s.clone()  # the X variants' float4 loads need 16-byte aligned rows (N % 4 == 0 checked in the kernel)
    pdl = tilehal.pdl_requested()
    compile_topk(pdl=pdl).get_kernel(TOPK_KERNELS[variant]).launch(
        rows, threads, [s, N, rows_per_b, mode, nv, sl, tb, int(block_size or 1), int(sink), int(local),
                        int(width), out], smem_bytes=N * 4 if variant == "staged" else 0, pdl=pdl)
    return out
