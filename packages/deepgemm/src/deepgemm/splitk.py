"""Split-K GEMMs (bf16, and fp8 with 1x128 / 128x128 scales) for shapes whose output tiles cannot fill
the GPU (kernels/splitk_sm90.cuh).

With M = 1 .. 128 and N of a few thousand, the persistent kernel has fewer output tiles than SMs
unless it makes them very narrow (16 columns), and narrow tiles re-read A once per tile and keep
wgmma far below its rate: the upstream bf16 test's M = 1 and M = 128 rows measured 0.34-0.85x
cuBLAS that way. Splitting K gives each SM a wide (64..256-column) tile over part of K; the CTA of
a tile that finishes last adds the partial sums in a fixed order (deterministic) and writes D.

`pick_splitk` compares the two plans with the persistent heuristic's cost model (waves x K blocks
x tile cost) plus the split-K reduction (the last CTA reads the other splits' partial tiles from
L2) and returns a config only when split-K is clearly cheaper; the reason is logged at DEBUG.
fp8 uses the same model with 128-element K blocks (the same 128 bytes per row as bf16's 64, and the
same wgmma time per block) and tiles of 64 or 128 columns (one weight-scale block per tile); the
persistent plan it is compared with is the fp8 one (DeepGEMM's fp8 test at M = 1 measured 0.45-0.91x its
cuBLAS baseline on the persistent kernel alone).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import tilehal
import torch
from tilehal import ArgumentError
from tilehal.tma import encode_tiled

from .heuristics import SMEM_SLACK, most_stages, pick_config, tile_cost, warp_specialized_threads, waves
from .utils import ceil_div

log = logging.getLogger("deepgemm")

BLOCK_K = 64  # bf16 elements per 128-byte swizzle row
FP8_BLOCK_K = 128  # fp8 elements per 128-byte swizzle row
MAX_STAGES = 8
MAX_SPLITS = 32
BLOCK_N_CANDIDATES = (64, 128, 256)
FP8_BLOCK_N_CANDIDATES = (64, 128)  # a divisor of 128: one 128x128 weight-scale block per tile (and registers:
# the promoted sum and the K block's partial sum, BLOCK_N / 2 each)
# Cost-model units per byte of partial sums moved through L2 by the reducing CTA, relative to
# tile_cost's units per K block: a 128x128x64 bf16 wgmma block (~0.35 us at 6 TFLOP/s per SM) costs
# 192 x 160 units, and an SM moves ~100 GB/s from L2, so one byte ~ 0.9 units.
REDUCE_COST_PER_BYTE = 0.9
FIXED_CTA_COST = 4.0 * 192 * 160  # prologue + epilogue of one CTA, in K-block units of a 128x128 tile
# Split-K must cost at most this fraction of the persistent plan. Calibrated on the H200 (2026-12-02,
# docs/benchmarks/deepgemm_small_m_h200.json): for M <= 64 (bound by reading B) every plan the model
# put below 0.78 was faster; for M > 64 the model is optimistic (measured/model ~1.35-1.5: the
# 128-row reduction tail is larger, the persistent kernel's narrow tiles better than modelled), so
# 128x4096x7168 (model 0.71, measured 0.96) and 128x7168x16384 (0.81, measured 1.20) stay persistent.
MIN_GAIN_SMALL_M = 0.85
# M > 64 with every split reducing a slice (PAR_REDUCE_MIN_M): H200 2026-12-02 session 26 R1 (docs/benchmarks/
# deepgemm_small_m_sweep_h200_s26_r1.json) 128 x 4096 x 7168 (model 0.71) 28.7 us split-K vs 31.4 persistent; 128 x 7168 x
# 16384 (0.81) 79.2 vs 76.2 and 128 x 7168 x 2048 (0.98) 21.9 vs 15.8 stay persistent. (0.6 with the last-CTA
# reduction, whose 128-row tail made 128 x 4096 x 7168 lose.)
MIN_GAIN = 0.75
# From this M on every split reduces a slice of its tile (kernels/splitk_sm90.cuh REDUCE = 1) instead of the last
# CTA reducing all of it. H200 s26 R1, bf16 M = 128: 128 x 2112 x 7168 21.8 -> 19.4 us, 128 x 576 x 7168 14.2
# -> 11.8, 128 x 256 x 7168 13.2 -> 10.2 (cuBLAS 18.4 / 11.4 / 10.1); at M = 1 (one valid row) it was 3 % slower.
PAR_REDUCE_MIN_M = 65
# From this M on (None: never) a plan of <= 8 splits reduces through the cluster's shared memory instead
# (kernels/splitk_sm90.cuh REDUCE = 2), where the driver holds all its clusters at once (else par_reduce).
CLUSTER_REDUCE_MIN_M: int | None = None
# The measured exceptions to CLUSTER_REDUCE_MIN_M: bf16 plans (block_m, block_n, splits, with C) above
# PAR_REDUCE_MIN_M rows that reduce through the cluster. Each entry names the H200 figure it stands on:
# (128, 64, 2, True): 128 x 4096 x 7168 with C = D (bf16, C_EARLY), session 29 r1 (docs/benchmarks/
# gpu_runs_2026-12-02_s29/r1/lead/out/sweep_4096x7168_acc.log, cuBLAS addmm_ 25.9 us in the same run): par_reduce
# 29.0 us (0.89x), the same plan through the cluster 27.2 us (0.95x); dg18 r1 (gpu_runs_2026-12-02_s29/dg18_r1/
# sweep.log): the cluster default 27.5 us vs par 29.6 (cuBLAS 26.5). (128, 64, 2, False): the same shape without C,
# dg18 r1: par (then the default) 28.9 us / graph 28.9, cluster 27.0 / 27.0 (cuBLAS 26.9 / 26.3). Only N = 3584 ..
# 4096 at M = 96 .. 128 plan (128, 64, 2) (64-wide tiles x 2 splits <= 132 CTAs).
CLUSTER_REDUCE_PLANS: frozenset[tuple[int, int, int, bool]] = frozenset({(128, 64, 2, True), (128, 64, 2, False)})
# fp8: the persistent kernel's narrow small-M tiles are worse than the model says (DeepGEMM's fp8 test, H200
# R2 2026-12-02: every M = 1 row 0.45-0.91x its cuBLAS baseline, 64x16..64x56 tiles with 7-57 KiB of B in
# flight per SM; 128x16 tiles at M = 128 re-read A from L2 once per 2 KiB of B), so split-K is taken as soon
# as the model has it no dearer (M <= 64) or at 0.85 of the persistent plan (M > 64).
# fp8, calibrated on the H200 (2026-12-02, docs/benchmarks/deepgemm_small_m_fp8_h200_r2.json): up to
# FP8_SMALL_M rows split-K beat the persistent kernel 1.6-2.1x where the model put it at <= 0.89 of the persistent
# cost (1 x 7168 x 2048, model 0.93: a wash, 12.0 vs 12.3 us); above, every fp8 split reduces BLOCK_M-row partials
# (~4-5 us per call at M = 64) and won only where the model says <= 0.68 (N = 576: 12.8 vs 13.9 us at M = 64,
# 13.1 vs 15.5 at M = 128); at 0.74-0.93 it lost 3-10 % (64 / 128 x 2112 / 4096 x 7168, 128 x 7168 x 16384).
FP8_MIN_GAIN_SMALL_M = 0.9
FP8_MIN_GAIN = 0.7
FP8_SMALL_M = 32
# Multicast of the A tile (2-CTA clusters along N) is a candidate for M >= MCAST_MIN_M (None: never) with two
# or more n-blocks whose grid, padded to whole clusters, fits one wave; such a plan costs MCAST_COST of the same
# plan without it (A's L2 reads halve). Off: on the H200 (R2, docs/benchmarks/deepgemm_splitk_mcast_h200_r2.json)
# every multicast plan was 1.1-1.9x SLOWER than the same plan without it (bf16 128 x 2112 x 7168: 40.8 us with,
# 21.7 without), as the persistent kernel's multicast was.
MCAST_MIN_M: int | None = None
MCAST_COST = 1.0
# DEEPGEMM_SPLITK_MCAST=1 (opt-in, session 27): multicast plans from M = 64 at this cost factor. The kernel's peer
# release is a plain remote arrival now (the cluster-scope one is what made the persistent kernel's multicast slow,
# s26), and a multicast plan keeps par_reduce where the driver holds all its clusters at once; not timed yet.
OPT_IN_MCAST_MIN_M = 64
OPT_IN_MCAST_COST = 0.85


@dataclass(frozen=True)
class SplitKConfig:
    block_m: int
    block_n: int
    splits: int
    stages: int
    num_sms: int
    multicast: int = 1  # 2: 2-CTA clusters along N sharing the A tile (kernels/splitk_sm90.cuh MCAST)
    fp8: bool = False  # an fp8 plan: each stage also holds BLOCK_M activation scales
    par_reduce: bool = False  # every split reduces a slice of its tile (kernels/splitk_sm90.cuh REDUCE = 1)
    cluster_reduce: bool = False  # a tile's splits are one cluster, reduced through shared memory (REDUCE = 2)
    c_early: bool = False  # with C: split 0 loads C before its main loop and adds it to its partial (C_EARLY)

    @property
    def num_threads(self) -> int:
        return warp_specialized_threads(self.block_m)

    @property
    def smem_bytes(self) -> int:
        ring = smem_bytes(self.block_m, self.block_n, self.stages, self.fp8)
        if self.cluster_reduce and self.splits > 1:  # the fp32 partial tile (padded rows) over the drained ring
            return max(ring, self.block_m * (self.block_n + 8) * 4 + SMEM_SLACK)
        return ring

    @property
    def reduce(self) -> int:
        """The kernel's REDUCE: 0 last CTA, 1 every split a slice (par_reduce), 2 through the cluster."""
        if self.splits <= 1:
            return 0
        return 2 if self.cluster_reduce else 1 if self.par_reduce else 0

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        """(n-blocks, m-blocks, splits); with multicast the n-blocks are a whole number of clusters (an odd
        count gets a phantom CTA)."""
        return ceil_div(ceil_div(n, self.block_n), self.multicast) * self.multicast, ceil_div(m, self.block_m), self.splits


def smem_bytes(block_m: int, block_n: int, stages: int, fp8: bool = False) -> int:
    stage = (block_m + block_n) * 128 + (block_m * 4 if fp8 else 0)  # A, B (and the fp8 activation scales)
    return stages * stage + 2 * 8 * stages + 16 + SMEM_SLACK


def max_stages(block_m: int, block_n: int, fp8: bool = False) -> int:
    return most_stages(lambda s: smem_bytes(block_m, block_n, s, fp8), MAX_STAGES)


def effective_splits(num_k_blocks: int, splits: int) -> int:
    """Splits that each own at least one K block when K blocks are dealt ceil(KB / splits) at a time."""
    per = ceil_div(num_k_blocks, splits)
    return ceil_div(num_k_blocks, per)


def splitk_cost(m: int, block_m: int, block_n: int, num_k_blocks: int, splits: int) -> float:
    rows = min(m, block_m)
    per = ceil_div(num_k_blocks, splits)
    partial_bytes = rows * block_n * 4
    reduce = REDUCE_COST_PER_BYTE * partial_bytes * splits if splits > 1 else 0.0  # write own + read the others
    return per * (block_m + 64) * (block_n + 32) + reduce + FIXED_CTA_COST


def block_k(kind: str) -> int:
    return FP8_BLOCK_K if kind == "fp8" else BLOCK_K


def persistent_cost(m: int, n: int, k: int, num_sms: int, kind: str = "bf16") -> float:
    cfg = pick_config(kind, m, n, k, num_sms=num_sms, tma_store=True)
    per_block = tile_cost(cfg.block_m, cfg.block_n, cfg.overlap_promotion)
    return cfg.num_waves * ceil_div(k, block_k(kind)) * per_block + FIXED_CTA_COST * cfg.num_waves


def mcast_setting() -> tuple[int | None, float]:
    """(MCAST_MIN_M, MCAST_COST), or with DEEPGEMM_SPLITK_MCAST=1 the opt-in (64, 0.85) where those are not set."""
    if os.environ.get("DEEPGEMM_SPLITK_MCAST", "0") == "1":
        return (OPT_IN_MCAST_MIN_M if MCAST_MIN_M is None else MCAST_MIN_M), min(MCAST_COST, OPT_IN_MCAST_COST)
    return MCAST_MIN_M, MCAST_COST


def pick_splitk(m: int, n: int, k: int, num_sms: int, kind: str = "bf16", has_c: bool = False) -> SplitKConfig | None:
    """The split-K plan for D[M, N] = C + A[M, K] @ B[N, K]^T (`kind` "bf16" or "fp8"; `has_c`: a C is added), or
    None when the persistent kernel is expected to be as fast (the reason is logged at DEBUG)."""
    return _pick(m, n, k, num_sms, kind, *mcast_setting(), has_c=has_c)


def cluster_rule(kind: str, m: int, block_m: int, block_n: int, splits: int, multicast: int, has_c: bool) -> bool:
    """Whether a plan reduces through the cluster's shared memory: from CLUSTER_REDUCE_MIN_M rows (None: off), or
    a bf16 plan above PAR_REDUCE_MIN_M rows listed in CLUSTER_REDUCE_PLANS (the H200-measured classes)."""
    if multicast != 1 or splits < 2 or splits > 8:
        return False
    if CLUSTER_REDUCE_MIN_M is not None and m >= CLUSTER_REDUCE_MIN_M:
        return True
    return kind == "bf16" and m >= PAR_REDUCE_MIN_M and (block_m, block_n, splits, has_c) in CLUSTER_REDUCE_PLANS


@functools.lru_cache(maxsize=4096)
def _pick(m: int, n: int, k: int, num_sms: int, kind: str = "bf16", mcast_min_m: int | None = None,
          mcast_cost: float = 1.0, has_c: bool = False) -> SplitKConfig | None:
    kb = ceil_div(k, block_k(kind))
    if kb < 2:
        log.debug("split-K not used for %s %dx%dx%d: K has one block", kind, m, n, k)
        return None
    # 64-row tiles also for M > 64: more tiles share the reduction (each tile's last CTA reads the
    # other splits' partials, so the tail shrinks with the tile).
    best = None
    mcasts = (1, 2) if mcast_min_m is not None and m >= mcast_min_m else (1,)
    for block_m in (64,) if m <= 64 else (64, 128):
        m_blocks = ceil_div(m, block_m)
        for bn in FP8_BLOCK_N_CANDIDATES if kind == "fp8" else BLOCK_N_CANDIDATES:
            n_blocks = ceil_div(n, bn)
            for s in range(2, min(kb, MAX_SPLITS) + 1):
                se = effective_splits(kb, s)
                if m_blocks * n_blocks * se > num_sms:
                    break
                for mc in mcasts:
                    padded = m_blocks * ceil_div(n_blocks, mc) * mc
                    if (mc > 1 and n_blocks < 2) or padded * se > num_sms:
                        continue
                    cost = splitk_cost(m, block_m, bn, kb, se) * (mcast_cost if mc > 1 else 1.0)
                    key = (cost, -padded * se, -bn, -block_m, mc)
                    if best is None or key < best[0]:
                        best = (key, block_m, bn, se, mc)
    if best is None:
        widest = FP8_BLOCK_N_CANDIDATES[-1] if kind == "fp8" else BLOCK_N_CANDIDATES[-1]
        log.debug("split-K not used for %s %dx%dx%d: %d tiles already fill %d SMs", kind, m, n, k,
                  ceil_div(m, 64) * ceil_div(n, widest), num_sms)
        return None
    (cost, *_), block_m, bn, se, mc = best
    base = persistent_cost(m, n, k, num_sms, kind)
    if kind == "fp8":
        gain = FP8_MIN_GAIN_SMALL_M if m <= FP8_SMALL_M else FP8_MIN_GAIN
    else:
        gain = MIN_GAIN_SMALL_M if m <= 64 else MIN_GAIN
    if cost > gain * base:
        log.debug("split-K not used for %s %dx%dx%d: estimated %.0f vs persistent %.0f", kind, m, n, k, cost, base)
        return None
    fp8 = kind == "fp8"
    cluster = cluster_rule(kind, m, block_m, bn, se, mc, has_c)
    if cluster:
        log.debug("split-K %s %dx%dx%d: %dx%d tiles x %d splits reduce through the cluster (measured rule)", kind, m,
                  n, k, block_m, bn, se)
    return SplitKConfig(block_m=block_m, block_n=bn, splits=se, stages=max_stages(block_m, bn, fp8), num_sms=num_sms,
                        par_reduce=m >= PAR_REDUCE_MIN_M,  # with multicast: kept where the clusters fit (_launch)
                        cluster_reduce=cluster, multicast=mc, fp8=fp8)


# ----------------------------------------------------------------------------- compile / launch

KERNEL_NAME = "splitk_sm90.cuh"
OPTIONS = ("-std=c++17", "-lineinfo")


@dataclass(frozen=True)
class SplitKKey:
    n: int
    k: int
    block_m: int
    block_n: int
    stages: int
    splits: int
    out_bf16: bool
    has_c: bool
    c_bf16: bool = False  # C read as bf16 (else fp32)
    a_mn: bool = False  # A read MN-major in place (stored [K, M])
    b_mn: bool = False  # B read MN-major in place (stored [K, N])
    fp8: bool = False  # e4m3 operands with 1x128 / 128x128 scales (K-major)
    multicast: int = 1  # CTAs per cluster sharing the A tile
    reduce: int = 0  # 0 last CTA, 1 every split reduces a slice (one co-resident wave), 2 cluster shared memory
    c_early: bool = False  # split 0 adds C to its partial sums (kernels/splitk_sm90.cuh C_EARLY)

    @property
    def expression(self) -> str:
        out = "__nv_bfloat16" if self.out_bf16 else "float"
        ct = "__nv_bfloat16" if self.c_bf16 else "float"

        def b(x: bool) -> str:
            return "true" if x else "false"

        return (f"deepgemm::splitk_sm90<{b(self.fp8)}, {self.n}, {self.k}, {self.block_m}, {self.block_n}, {self.stages}, "
                f"{self.splits}, {out}, {b(self.has_c)}, {ct}, {b(self.a_mn)}, {b(self.b_mn)}"
                f"{f', {self.multicast}' if self.multicast > 1 or self.reduce or self.c_early else ''}"
                f"{f', {self.reduce}' if self.reduce or self.c_early else ''}{', true' if self.c_early else ''}>")


def splitk_key(cfg: SplitKConfig, n: int, k: int, out_dtype: torch.dtype, c_dtype: torch.dtype | None,
               a_mn: bool = False, b_mn: bool = False, fp8: bool = False) -> SplitKKey:
    return SplitKKey(n=n, k=k, block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.stages, splits=cfg.splits,
                     out_bf16=out_dtype == torch.bfloat16, has_c=c_dtype is not None,
                     c_bf16=c_dtype == torch.bfloat16, a_mn=a_mn, b_mn=b_mn, fp8=fp8, multicast=cfg.multicast,
                     reduce=cfg.reduce, c_early=cfg.c_early and c_dtype is not None and cfg.splits > 1)


def c_early_allowed(fp8: bool) -> bool:
    """Whether split-K GEMMs with C add it in split 0's partial sums, loaded before the main loop (kernels/
    splitk_sm90.cuh C_EARLY), instead of in the reduction after it. DEEPGEMM_SPLITK_C: "auto" (default: bf16 only;
    on the H200, session 28, 128x4096x7168 acc 30.2 -> 29.4-29.7 us, 128x2112x7168 acc 20.2 -> 19.9, 128x576x7168
    equal; docs/benchmarks/gpu_runs_2026-12-02_s28/), "early" (fp8 too: C enters the accumulator that the fp8
    wgmmas add into, so it loses their accumulation precision: up to 2x test_splitk's fp32-C bound on the H200)
    or "reduce"."""
    mode = os.environ.get("DEEPGEMM_SPLITK_C", "auto")
    if mode not in ("auto", "early", "reduce"):
        raise ArgumentError(f"DEEPGEMM_SPLITK_C: expected 'auto', 'early' or 'reduce', got {mode!r}")
    return mode == "early" or (mode == "auto" and not fp8)


def with_c_early(cfg: SplitKConfig, has_c: bool) -> SplitKConfig:
    """`cfg` with C_EARLY where DEEPGEMM_SPLITK_C asks for it (c_early_allowed) and it applies (C, more than one
    split)."""
    if cfg.c_early or not c_early_allowed(cfg.fp8):
        return cfg
    if not has_c or cfg.splits < 2:
        log.debug("split-K C_EARLY not used: %s", "no C" if not has_c else "one split (no reduction)")
        return cfg
    return dataclasses.replace(cfg, c_early=True)


def pick_tiles(m: int, n: int, k: int, num_sms: int, has_c: bool = False) -> SplitKConfig:
    """The kernel's plan for MN-major operands: split-K where `pick_splitk` takes it, else one CTA per
    output tile (splits = 1) with 64-column multiples (an MN-major tile is whole 64-element atoms)."""
    sk = pick_splitk(m, n, k, num_sms, has_c=has_c)
    if sk is not None:
        return sk
    bm = 64 if m <= 64 else 128
    best = None
    for bn in (128, 256):
        w, util = waves(ceil_div(m, bm) * ceil_div(n, bn), num_sms)
        key = (w * tile_cost(bm, bn), -util, -bn)
        if best is None or key < best[0]:
            best = (key, bn)
    return SplitKConfig(block_m=bm, block_n=best[1], splits=1, stages=max_stages(bm, best[1]), num_sms=num_sms)


def kernel_source() -> str:
    return (Path(__file__).resolve().parent / "kernels" / KERNEL_NAME).read_text()


def compile_kernels(keys, extra_options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC-compile split-K instantiations for sm_90a (no GPU needed; cached on disk by content)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_splitk_sm90",
                                options=OPTIONS + tuple(extra_options), name_expressions=[k.expression for k in keys])


@functools.lru_cache(maxsize=256)
def _kernel(key: SplitKKey) -> tilehal.Kernel:
    return compile_kernels([key]).get_kernel(key.expression)


_WORKSPACES: dict = {}


def _workspace(device: torch.device, ws_floats: int, num_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial-sum buffer and per-tile counters for the current stream (the counters must start at 0;
    every launch leaves them 0). Kept per stream, so split-K GEMMs on different streams never share them,
    and apart for CUDA-graph capture (a capture does not run the zero fill eagerly)."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream, torch.cuda.is_current_stream_capturing())
    ws, counters = _WORKSPACES.get(key, (None, None))
    if ws is None or ws.numel() < ws_floats:
        ws = torch.empty(max(ws_floats, 1 << 20), dtype=torch.float32, device=device)
    if counters is None or counters.numel() < num_counters:
        counters = torch.zeros(max(num_counters, 1024), dtype=torch.int32, device=device)
    _WORKSPACES[key] = (ws, counters)
    return ws, counters


def is_mn_major(x: torch.Tensor) -> bool:
    """x [rows, K] stored K-first (the transpose of a row-major [K, rows] tensor)."""
    return x.stride(0) == 1 and x.stride(1) != 1


def in_place_ok(x: torch.Tensor, name: str) -> bool:
    """Whether TMA can read x [rows, K] as stored: K-major, or MN-major with a 16-byte aligned K stride."""
    if not is_mn_major(x):
        return True
    why = None
    if (x.stride(1) * x.element_size()) % 16:
        why = f"its K stride {x.stride(1)} is not a multiple of 8 elements (TMA needs 16-byte rows)"
    elif x.data_ptr() % 16:
        why = "its data pointer is not 16-byte aligned"
    if why:
        log.debug("%s: MN-major but not readable in place (%s); copying it K-major", name, why)
    return why is None


_DESC_CACHE: collections.OrderedDict = collections.OrderedDict()


def _encode(ptr: int, dtype: torch.dtype, shape: tuple, strides: tuple, box: tuple, swizzle: str) -> bytes:
    # A descriptor depends only on these values: repeated calls on the same buffers reuse it.
    key = (ptr, dtype, shape, strides, box, swizzle)
    hit = _DESC_CACHE.get(key)
    if hit is None:
        hit = _DESC_CACHE[key] = encode_tiled(ptr, dtype, shape, strides, box, swizzle=swizzle)
        if len(_DESC_CACHE) > 4096:
            _DESC_CACHE.popitem(last=False)
    return hit


def _operand_descriptor(x: torch.Tensor, block_rows: int) -> bytes:
    if is_mn_major(x):  # stored [K, rows]: boxes of 64 K-rows x 64 elements (one 128-byte swizzled atom)
        k, rows = x.shape[1], x.shape[0]
        return _encode(x.data_ptr(), x.dtype, (k, rows), (x.stride(1), 1), (BLOCK_K, 64), "128B")
    box_k = 128 // x.element_size()  # one 128-byte swizzle row: 64 bf16 or 128 fp8
    return _encode(x.data_ptr(), x.dtype, tuple(x.shape), tuple(x.stride()), (block_rows, box_k), "128B")


def dense_bf16(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None, cfg: SplitKConfig) -> None:
    """a [M, K], b [N, K] bf16, each K-major or MN-major (`in_place_ok`, checked by the caller); d [M, N]
    contiguous, c (fp32 or bf16, contiguous, read in its own dtype) or None."""
    m, k = a.shape
    n = b.shape[0]
    a_mn, b_mn = is_mn_major(a), is_mn_major(b)
    if cfg.multicast > 1 and a_mn:
        raise tilehal.ArgumentError("config.multicast: expected 1 with an MN-major A (multicast shares a K-major A tile)")
    if cfg.fp8:
        raise tilehal.ArgumentError("config.fp8: expected False for a bf16 GEMM, got True")
    cfg = with_c_early(cfg, c is not None)
    key = splitk_key(cfg, n, k, d.dtype, None if c is None else c.dtype, a_mn, b_mn)
    _launch(key, cfg, m, n, a, b, _NULL_DESC, [d, c], [None])


@functools.lru_cache(maxsize=16)
def _device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_CLUSTER_FIT: dict = {}


def _clusters_fit(kern: tilehal.Kernel, cfg: SplitKConfig, clusters: int, device: torch.device,
                  dims: tuple[int, int, int] | None = None, unknown: bool = True) -> bool:
    """Whether the driver holds `clusters` clusters of shape `dims` (default (1, 1, cfg.splits): cluster_reduce) of
    this kernel at once (memoized). Where it cannot say: `unknown` (True for cluster_reduce, whose second wave is
    only slower; False for a par_reduce multicast grid, whose waits would hang)."""
    dims = dims or (1, 1, cfg.splits)
    symbol = getattr(kern, "symbol", None)
    if symbol is None:  # not a compiled kernel (a benchmark's recording pass): nothing to ask the driver
        return True
    key = (symbol, dims, cfg.smem_bytes, device.index)
    have = _CLUSTER_FIT.get(key)
    if have is None:
        try:
            have = kern.max_active_clusters(cfg.num_threads, cfg.smem_bytes, dims, device.index)
        except Exception as e:  # noqa: BLE001 - an older driver or binding
            log.debug("split-K: cuOccupancyMaxActiveClusters unavailable (%s)", e)
            have = -1
        _CLUSTER_FIT[key] = have
    return unknown if have < 0 else have >= clusters


_NULL_DESC = bytes(128)  # the bf16 kernels' unused activation-scale descriptor


def _launch(key: SplitKKey, cfg: SplitKConfig, m: int, n: int, a: torch.Tensor, b: torch.Tensor, sfa_desc: bytes,
            out_args: list, scale_args: list) -> None:
    if cfg.multicast not in (1, 2):
        raise tilehal.ArgumentError(f"config.multicast: expected 1 or 2, got {cfg.multicast}")
    grid = cfg.grid(m, n)
    if key.reduce == 2 and (cfg.multicast > 1 or cfg.splits > 8):
        raise tilehal.ArgumentError(f"config.cluster_reduce: expected multicast 1 and at most 8 splits (one portable "
                                    f"cluster per tile), got multicast {cfg.multicast}, {cfg.splits} splits")
    if key.reduce == 1 and grid[0] * grid[1] * grid[2] > _device_sms(a.device):
        raise tilehal.ArgumentError(f"config.par_reduce: expected a grid of at most {_device_sms(a.device)} CTAs "
                                    f"(one per SM: every split waits for the others), got {grid}")
    kern = _kernel(key)
    if key.reduce == 1 and cfg.multicast > 1:
        # Every split waits for the tile's others: all clusters of the grid must be resident at once (the driver's
        # count; unknown counts as no), else the last CTA of each tile reduces (nothing waits).
        clusters = grid[0] * grid[1] * grid[2] // cfg.multicast
        if not _clusters_fit(kern, cfg, clusters, a.device, (cfg.multicast, 1, 1), unknown=False):
            log.debug("split-K: %d clusters of %d CTAs not known to fit at once: the last CTA reduces", clusters,
                      cfg.multicast)
            cfg = dataclasses.replace(cfg, par_reduce=False)
            key = dataclasses.replace(key, reduce=cfg.reduce)
            kern = _kernel(key)
    if key.reduce == 2 and not _clusters_fit(kern, cfg, grid[0] * grid[1], a.device):
        if grid[0] * grid[1] * grid[2] <= _device_sms(a.device):
            log.debug("split-K: %d clusters of %d CTAs do not fit at once: every split reduces a slice instead",
                      grid[0] * grid[1], cfg.splits)
            cfg = dataclasses.replace(cfg, cluster_reduce=False, par_reduce=True)
        else:
            log.debug("split-K: %d clusters of %d CTAs do not fit at once: the last CTA reduces", grid[0] * grid[1],
                      cfg.splits)
            cfg = dataclasses.replace(cfg, cluster_reduce=False, par_reduce=False)
        key = dataclasses.replace(key, reduce=cfg.reduce)
        kern = _kernel(key)
    # Two counters per tile: arrivals, and (par_reduce) slices done.
    ws, counters = _workspace(a.device, cfg.splits * m * n if cfg.splits > 1 else 0, 2 * grid[0] * grid[1])
    da = _operand_descriptor(a, cfg.block_m // cfg.multicast)  # with multicast each CTA loads half of A's tile
    db = _operand_descriptor(b, cfg.block_n)
    cluster = (cfg.multicast, 1, 1) if cfg.multicast > 1 else (1, 1, cfg.splits) if key.reduce == 2 else None
    kern.launch(grid, cfg.num_threads, [da, db, sfa_desc, *out_args, ws, counters, m, *scale_args],
                smem_bytes=cfg.smem_bytes, cluster=cluster)


def dense_fp8(a: torch.Tensor, sfa_t: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor,
              c: torch.Tensor | None, cfg: SplitKConfig) -> None:
    """a [M, K], b [N, K] e4m3, K-major (checked by the caller); sfa_t [M, ceil(K/128)] fp32 MN-major with a
    TMA-aligned column stride (`get_mn_major_tma_aligned_tensor`), sfb [ceil(N/128), ceil(K/128)] fp32
    contiguous; d [M, N] contiguous, c (fp32 or bf16, contiguous) or None. cfg.block_n divides 128."""
    m, k = a.shape
    n = b.shape[0]
    if 128 % cfg.block_n:
        raise tilehal.ArgumentError(f"config.block_n: expected a divisor of 128 for fp8 split-K, got {cfg.block_n}")
    if not cfg.fp8:
        raise tilehal.ArgumentError("config.fp8: expected True for an fp8 GEMM (its stages hold the activation scales "
                                    "too: build it with max_stages(..., fp8=True)), got False")
    cfg = with_c_early(cfg, c is not None)
    key = splitk_key(cfg, n, k, d.dtype, None if c is None else c.dtype, fp8=True)
    sk = sfa_t.shape[1]
    sfa_desc = _encode(sfa_t.data_ptr(), torch.float32, (sk, m), (sfa_t.stride(1), 1), (1, cfg.block_m), "none")
    _launch(key, cfg, m, n, a, b, sfa_desc, [d, c], [sfb])
