"""Host side of the FP4-weight kernel (kernels/fp4_gemm_sm90.cuh): config, TMA descriptors, workspace, launch.

The kernel is specialized on the token tile (8 x NT rows of A), the consumer warps (16 weight rows
each), the operand kinds and the ring depth; M, N, K stay runtime arguments. Split-K partial tiles go
through one fp32 workspace and a per-tile arrival counter per device; the kernel leaves the counters
at zero, so launches (and CUDA graph replays) need no memset. The workspace and counters are never
freed or moved once handed out (a captured graph keeps pointing at them); launches on one device are
assumed to be stream-ordered (one stream at a time, as with cuBLAS's own workspace).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import tilehal
import torch
from tilehal import ShapeError

from . import validate
from .utils import ceil_div, get_num_sms, get_tma_aligned_size

log = logging.getLogger("deepgemm")

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
OPTIONS = ("-std=c++17", "-lineinfo", "-default-device")  # -default-device: the kernels' lambdas are device code (NVRTC < 13.5 refuses them otherwise)
MIN_CHUNKS_PER_CTA = 2  # 128-wide K chunks: fewer and the ring has nothing to overlap
MAX_STAGES = 8
MAX_WIDE_SPLITS = 4  # K splits of a tile with more than 16 tokens (its fp32 partial tile is 8-32 KiB)
MAX_TOKEN_TILES = 8  # 64 tokens per CTA (M = 128 runs as two m-blocks; their weights come from L2)
SM_SMEM = 228 * 1024  # shared memory per SM (sm_90), of which 1 KiB per CTA is reserved
_NULL_DESC = bytes(128)


def _cpp(x) -> str:
    """A C++ template argument: bools as true / false, ints and type names as they are."""
    if isinstance(x, bool):
        return "true" if x else "false"
    return str(x)


class _KernelKey:
    """What the kernels' keys share (frozen dataclasses below): the C++ instantiation (KERNEL<template_args()>)
    and the tile: 8 nt tokens (the swap-AB N) by 16 wn weight rows (output columns)."""

    KERNEL = ""
    nt: int
    out_bf16: bool

    def template_args(self) -> tuple:
        raise NotImplementedError

    @property
    def expression(self) -> str:
        return f"deepgemm::fp4::{self.KERNEL}<{', '.join(_cpp(x) for x in self.template_args())}>"

    @property
    def out_type(self) -> str:
        return "__nv_bfloat16" if self.out_bf16 else "float"

    @property
    def rows(self) -> int:
        return 16 * self.wn

    @property
    def tokens(self) -> int:
        return 8 * self.nt


class _RingKey(_KernelKey):
    """The two kernels that stream weights and activations through a TMA ring (mma.sync, wgmma): their shared
    memory is `stages` slots of both, at least the epilogue's fp32 tile."""

    wn: int
    act_fp8: bool
    stages: int

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.nt, self.wn, self.act_fp8, self.stages)


@dataclass(frozen=True)
class _Plan:
    """A launch of one key: grid (row blocks, K splits, m-blocks x groups), chunks (128 K) per split."""

    key: _KernelKey
    m_blocks: int
    row_blocks: int
    splits: int
    chunks_per_split: int
    groups: int = 1

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.row_blocks, self.splits, self.m_blocks * self.groups

    @property
    def tiles_all(self) -> int:
        return self.row_blocks * self.m_blocks * self.groups


@dataclass(frozen=True)
class _ClusterPlan(_Plan):
    """The wgmma and streaming kernels: the K splits of a tile are one thread-block cluster along grid y."""

    @property
    def cluster(self) -> tuple[int, int, int] | None:
        return (1, self.splits, 1) if self.splits > 1 else None


@dataclass(frozen=True)
class Fp4Key(_RingKey):
    KERNEL = "fp4_gemm_sm90"
    nt: int  # n8 tiles of tokens per CTA (tokens = 8 nt)
    wn: int  # consumer warps (16 weight rows each)
    act_fp8: bool
    out_bf16: bool
    has_c: bool
    masked: bool
    stages: int

    def template_args(self) -> tuple:
        return self.nt, self.wn, self.act_fp8, self.out_type, self.has_c, self.masked, self.stages

    @property
    def threads(self) -> int:
        return 32 * (self.wn + 1)  # + the TMA producer warp

    @property
    def min_blocks(self) -> int:
        return min_blocks(self.nt)


def min_blocks(nt: int) -> int:
    """CTAs per SM the kernel is built for (its __launch_bounds__, kMinBlocks): 4 small ones for <= 16 tokens,
    else 1 (the 8-warp, 64-token CTA needs its registers)."""
    return 4 if nt <= 2 else 1


def stage_bytes(nt: int, wn: int, act_fp8: bool) -> int:
    """One ring stage (kernels/fp4_gemm_sm90.cuh Fp4Stage): activations, codes, weight and activation scales."""
    tokens, rows = 8 * nt, 16 * wn
    raw = tokens * 128 * (1 if act_fp8 else 2) + rows * 64 + rows * 16 + (tokens * 4 if act_fp8 else 0)
    return ceil_div(raw, 1024) * 1024


def smem_bytes(nt: int, wn: int, act_fp8: bool, stages: int) -> int:
    ring = max(stages * stage_bytes(nt, wn, act_fp8), 8 * nt * 16 * wn * 4)  # the epilogue tile reuses the ring
    return 1024 + ring + 16 * stages


@dataclass(frozen=True)
class Fp4Plan(_Plan):
    """The mma.sync kernel: split-K partial tiles through a global fp32 workspace and per-tile counters."""

    key: Fp4Key

    @property
    def workspace_floats(self) -> int:
        return 0 if self.splits == 1 else self.tiles_all * self.splits * self.key.rows * self.key.tokens


def max_token_tiles() -> int:
    """MAX_TOKEN_TILES, or DEEPGEMM_FP4_TOKEN_TILES (1..16, a power of two) for A/B timing."""
    v = os.environ.get("DEEPGEMM_FP4_TOKEN_TILES")
    if v is None:
        return MAX_TOKEN_TILES
    if v not in ("1", "2", "4", "8", "16"):
        raise validate.ArgumentError(f"DEEPGEMM_FP4_TOKEN_TILES: expected 1, 2, 4, 8 or 16, got {v!r}")
    return int(v)


def token_tiles(m: int) -> int:
    """n8 tiles of tokens per CTA: the smallest power of two covering m, at most max_token_tiles()."""
    nt, top = 1, max_token_tiles()
    while nt < top and 8 * nt < m:
        nt *= 2
    return nt


def plan(m: int, n: int, k: int, groups: int, act_fp8: bool, out_bf16: bool, has_c: bool, masked: bool,
         num_sms: int | None = None, expected_m: int | None = None) -> Fp4Plan:
    """Warps, ring depth and split-K for one problem (m: tokens per group; expected_m: the masked hint)."""
    sms = num_sms or get_num_sms()
    nt = token_tiles(expected_m or m)
    wn = 4 if nt <= 2 else 8  # few tokens: 64-row CTAs, several per SM; more: one CTA's activations feed 128 rows
    blocks = min_blocks(nt)
    m_blocks = ceil_div(m, 8 * nt)
    row_blocks = ceil_div(n, 16 * wn)
    chunks = k // 128
    tiles = row_blocks * groups * (ceil_div(expected_m, 8 * nt) if masked and expected_m else m_blocks)
    # One wave: as many K splits as keep every CTA resident at once (a partial second wave costs as much
    # as the first), at least MIN_CHUNKS_PER_CTA chunks each.
    resident = blocks * sms
    # Wide token tiles cap the splits: the last CTA of a tile reads every split's [tokens x rows] fp32 part.
    most = chunks // MIN_CHUNKS_PER_CTA if nt <= 2 else min(MAX_WIDE_SPLITS, chunks // MIN_CHUNKS_PER_CTA)
    splits = max(1, min(resident // max(1, tiles), most))
    cps = ceil_div(chunks, splits)
    splits = ceil_div(chunks, cps)
    # Ring: the CTA's whole K range if it fits next to its min_blocks - 1 neighbours, at least 2 stages.
    budget = min(SM_SMEM // blocks - 1024, 227 * 1024)
    stages = min(MAX_STAGES, max(2, cps))
    while stages > 2 and smem_bytes(nt, wn, act_fp8, stages) > budget:
        stages -= 1
    key = Fp4Key(nt=nt, wn=wn, act_fp8=act_fp8, out_bf16=out_bf16, has_c=has_c, masked=masked, stages=stages)
    return Fp4Plan(key=key, m_blocks=m_blocks, row_blocks=row_blocks, splits=splits, chunks_per_split=cps,
                   groups=groups)


MAX_CLUSTER_SPLITS = 8  # the wgmma kernel's K splits are one thread-block cluster (portable size)
WG_MAX_TOKEN_TILES = 16  # 128 tokens: the wgmma N of one CTA (M = 128 decodes its weights once)
WG_FP8_MAX_TOKEN_TILES = 8  # e4m3: accumulators, the chunk's partial sums and the A fragments in 168 registers


@dataclass(frozen=True)
class Fp4WgKey(_RingKey):
    """The wgmma kernels (bf16 or e4m3 activations): NT n8 token tiles = the wgmma N, NWG consumer warpgroups."""

    nt: int
    nwg: int
    out_bf16: bool
    has_c: bool
    masked: bool
    stages: int
    act_fp8: bool = False

    @property
    def KERNEL(self) -> str:  # noqa: N802 (the base's class constant, per activation kind here)
        return "fp4_wgmma_fp8_sm90" if self.act_fp8 else "fp4_wgmma_sm90"

    def template_args(self) -> tuple:
        return self.nt, self.nwg, self.out_type, self.has_c, self.masked, self.stages

    @property
    def wn(self) -> int:
        return 4 * self.nwg

    @property
    def threads(self) -> int:
        return 128 * self.nwg + 32

    @property
    def min_blocks(self) -> int:
        return wgmma_min_blocks(self.nt)


def wgmma_min_blocks(nt: int) -> int:
    """CTAs per SM of the wgmma kernel (its kWgMinBlocks)."""
    return 3 if nt <= 2 else 2 if nt <= 4 else 1


@dataclass(frozen=True)
class Fp4WgPlan(_ClusterPlan):
    key: Fp4WgKey
    blocks: int = 1  # CTAs per SM the ring depth and the split count were planned for

    @property
    def smem_bytes(self) -> int:
        return self.key.smem_bytes


# What DEEPGEMM_FP4_KERNEL=auto (the default) runs: the wgmma kernel from this many tokens on, per activation
# kind (None: never). H200, 2026-12-02 (docs/deepgemm.md): bf16 wgmma is 1.13-1.45x the mma.sync kernel at
# M = 64 / 128 and 0.74-0.92x at M = 1 / 16; e4m3 wgmma is as fast or faster at M >= 16 but promotes per 128 K
# (Hopper's fp8 accumulation inside a chunk: max error 1.3e-4 of max |D| against 1e-4), so it stays opt-in.
AUTO_WGMMA_MIN_M = {"bf16": 17, "e4m3": None}


def use_wgmma(act_fp8: bool, m: int) -> bool:
    """Whether a call with m tokens (per group) takes the wgmma kernel (DEEPGEMM_FP4_KERNEL, else AUTO_WGMMA_MIN_M)."""
    choice = kernel_choice()
    if choice in ("auto", "stream", "small", "dec"):  # dec: grouped calls as auto
        low = AUTO_WGMMA_MIN_M["e4m3" if act_fp8 else "bf16"]
        return low is not None and m >= low
    return choice == "wgmma"


def kernel_choice() -> str:
    """DEEPGEMM_FP4_KERNEL: 'auto' (default: AUTO_WGMMA_MIN_M, the small-M kernel for bf16 activations at
    M <= AUTO_SMALL_MAX_M, the streaming kernel at M <= STREAM_MAX_M), 'mma', 'wgmma' (both activation kinds),
    'stream' (bf16 at any M; e4m3 as auto) or 'small' (bf16 at M <= SMALL_MAX_M; else, and e4m3, as auto): A/B."""
    v = os.environ.get("DEEPGEMM_FP4_KERNEL", "auto")
    if v not in ("auto", "mma", "wgmma", "stream", "small", "dec"):
        raise validate.ArgumentError(f"DEEPGEMM_FP4_KERNEL: expected auto, mma, wgmma, stream, small or dec, got {v!r}")
    return v


def use_stream(act_fp8: bool, m: int) -> bool:
    """Whether a call with m tokens (per group) takes the streaming kernel (bf16 activations only): auto up to
    STREAM_MAX_M tokens, DEEPGEMM_FP4_KERNEL=stream at any M (A/B)."""
    choice = kernel_choice()
    return not act_fp8 and (choice == "stream" or (choice == "auto" and m <= STREAM_MAX_M))


WG_CTA_FIXED_CHUNKS = 3
WG_FEW_TILES = 32  # fewer 128-row x token tiles than this: the wgmma kernel plans 64-row CTAs, two per SM
GPCS = 8  # sm_90 parts: 8 GPCs (the H100 / H200 SXM's 132 SMs: two GPCs of 18, six of 16)


def cluster_capacity(sms: int, blocks: int, size: int) -> int:
    """Clusters of `size` CTAs (`blocks` per SM) resident at once, by a GPC model (a cluster lives on one GPC):
    SMs in pairs (TPCs) spread over GPCS GPCs. The launch checks the driver's figure (_fit_clusters)."""
    tpcs = sms // 2
    per_gpc = [2 * (tpcs // GPCS + (1 if i < tpcs % GPCS else 0)) for i in range(GPCS)]
    return sum(g * blocks // size for g in per_gpc)


def plan_wgmma(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
               num_sms: int | None = None, expected_m: int | None = None, act_fp8: bool = False,
               max_splits: int | None = None) -> Fp4WgPlan:
    """Token tile, warpgroups, cluster split-K and ring depth of a wgmma kernel for one problem (memoized:
    the host path of a decode step should not re-plan every call)."""
    cap = os.environ.get("DEEPGEMM_FP4_WG_MAX_SPLITS") if max_splits is None else str(max_splits)
    return _plan_wgmma(m, n, k, groups, out_bf16, has_c, masked, num_sms or get_num_sms(), expected_m, act_fp8,
                       os.environ.get("DEEPGEMM_FP4_WG_NWG"), cap, os.environ.get("DEEPGEMM_FP4_WG_BLOCKS"))


@functools.lru_cache(maxsize=1024)
def _plan_wgmma(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool, sms: int,
                expected_m: int | None, act_fp8: bool, forced: str | None, cap: str | None,
                forced_blocks: str | None = None) -> Fp4WgPlan:
    nt, mm = 1, expected_m or m
    top = WG_FP8_MAX_TOKEN_TILES if act_fp8 else WG_MAX_TOKEN_TILES
    while nt < top and 8 * nt < mm:
        nt *= 2
    nwg = 2 if nt >= 8 else 1  # wide token tiles: 128 weight rows share one activation tile
    blocks = wgmma_min_blocks(nt)
    tiles_m = groups * (ceil_div(expected_m, 8 * nt) if masked and expected_m else ceil_div(m, 8 * nt))
    if nwg == 2 and not act_fp8 and ceil_div(n, 128) * tiles_m < WG_FEW_TILES:
        # Few 128-row tiles (N = 2112: 17) leave SMs idle: 64-row CTAs, two per SM (a shallower ring each).
        # H200 2026-12-02 R1: 1.24x / 1.42x at 2112 x 7168, M = 64 / 128; within 2 % at N = 4096 / 7168.
        nwg, blocks = 1, 2
    if forced is not None:  # DEEPGEMM_FP4_WG_NWG: A/B timing only
        if forced not in ("1", "2"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_WG_NWG: expected 1 or 2, got {forced!r}")
        nwg, blocks = int(forced), wgmma_min_blocks(nt)
    if forced_blocks is not None:  # DEEPGEMM_FP4_WG_BLOCKS: CTAs per SM to plan for (ring depth, residency); A/B only
        if forced_blocks not in ("1", "2", "3"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_WG_BLOCKS: expected 1, 2 or 3, got {forced_blocks!r}")
        blocks = int(forced_blocks)
    m_blocks = ceil_div(m, 8 * nt)
    row_blocks = ceil_div(n, 64 * nwg)
    chunks = k // 128
    tiles = row_blocks * groups * (ceil_div(expected_m, 8 * nt) if masked and expected_m else m_blocks)
    most = MAX_CLUSTER_SPLITS
    if cap is not None:  # DEEPGEMM_FP4_WG_MAX_SPLITS: A/B timing only
        if cap not in ("1", "2", "3", "4", "5", "6", "7", "8"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_WG_MAX_SPLITS: expected 1..8, got {cap!r}")
        most = int(cap)
    # Split count: every tile is one cluster of `splits` CTAs and a cluster must fit on one GPC, so the cost
    # is (waves of clusters) x (chunks per CTA + a CTA's fixed cost, ~3 chunks: ring fill, epilogue); the
    # fewest splits among the cheapest (less reduction).
    best = None
    for sp in range(1, max(1, min(chunks // MIN_CHUNKS_PER_CTA, most)) + 1):
        cap_sp = cluster_capacity(sms, blocks, sp) if sp > 1 else blocks * sms
        cost = ceil_div(tiles, max(1, cap_sp)) * (ceil_div(chunks, sp) + WG_CTA_FIXED_CHUNKS)
        if best is None or cost < best[0]:
            best = (cost, sp)
    splits = best[1]
    cps = ceil_div(chunks, splits)
    splits = ceil_div(chunks, cps)
    budget = min(SM_SMEM // blocks - 1024, 227 * 1024)
    stages = min(MAX_STAGES, max(2, cps))
    while stages > 2 and smem_bytes(nt, 4 * nwg, act_fp8, stages) > budget:
        stages -= 1
    key = Fp4WgKey(nt=nt, nwg=nwg, out_bf16=out_bf16, has_c=has_c, masked=masked, stages=stages, act_fp8=act_fp8)
    return Fp4WgPlan(key=key, m_blocks=m_blocks, row_blocks=row_blocks, splits=splits, chunks_per_split=cps,
                     groups=groups, blocks=blocks)


# DEEPGEMM_FP4_KERNEL=auto takes the streaming kernel up to this many tokens (bf16 activations): none, since on the
# H200 (2026-12-02 R1) it ran at 0.80-0.93x the mma.sync kernel at M = 1 / 16 (latency-bound at 16 warps per SM,
# like the others); DEEPGEMM_FP4_KERNEL=stream runs it at any M (A/B).
STREAM_MAX_M = 0
STREAM_MAX_TOKEN_TILES = 8  # its widest token tile (64 tokens; more: several m-blocks); =stream reaches it (A/B)
STREAM_SLOTS = {1: 8, 2: 6, 4: 5, 8: 1}  # P per token tiles: 128-wide K chunks a thread holds in registers at once
# (no spill within the kernel's 128 registers under NVRTC 13.0: NT = 2 at 7, 4 at 6, 8 at 2)
STREAM_MAX_CHUNKS = 24  # chunks per CTA whose activations are staged whole ([tokens][chunks x 128] bf16); else a ring
STREAM_WHOLE_BYTES = 48 * 1024  # the most shared memory the whole-range staging may take
STREAM_TARGET_WARPS = 16 * 132  # warps in flight worth streaming the weights at full bandwidth (H200: 16 per SM)


@dataclass(frozen=True)
class Fp4StreamKey(_KernelKey):
    """The streaming kernel (bf16 activations, <= 16 tokens): NT n8 token tiles, WN warps of 16 rows, P slots."""

    KERNEL = "fp4_stream_sm90"
    nt: int
    wn: int
    out_bf16: bool
    has_c: bool
    masked: bool
    slots: int = 8
    ring: bool = False  # activations through a ring of 3 one-chunk buffers (else the whole K range at once)

    def template_args(self) -> tuple:
        return self.nt, self.wn, self.slots, self.out_type, self.has_c, self.masked, self.ring

    @property
    def threads(self) -> int:
        return 32 * self.wn


def stream_min_blocks(wn: int) -> int:
    """CTAs per SM of the streaming kernel (its kStreamMinBlocks: 512 threads of <= 128 registers)."""
    return 16 // wn


@dataclass(frozen=True)
class Fp4StreamPlan(_ClusterPlan):
    key: Fp4StreamKey

    @property
    def smem_bytes(self) -> int:  # the activation tile(s), at least the epilogue's fp32 [tokens][rows] tile
        k = self.key
        return max(k.tokens * (3 if k.ring else self.chunks_per_split) * 256, k.tokens * k.rows * 4)


def plan_stream(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
                num_sms: int | None = None, expected_m: int | None = None,
                max_splits: int | None = None) -> Fp4StreamPlan | None:
    """Token tile, warps and cluster split-K of the streaming kernel (m: tokens per group; more than 64 run as
    several m-blocks)."""
    wn = os.environ.get("DEEPGEMM_FP4_STREAM_WN")  # A/B timing only
    if wn is not None and wn not in ("4", "8"):
        raise validate.ArgumentError(f"DEEPGEMM_FP4_STREAM_WN: expected 4 or 8, got {wn!r}")
    return _plan_stream(m, n, k, groups, out_bf16, has_c, masked, num_sms or get_num_sms(), expected_m,
                        MAX_CLUSTER_SPLITS if max_splits is None else max_splits, int(wn) if wn else None)


@functools.lru_cache(maxsize=1024)
def _plan_stream(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool, sms: int,
                 expected_m: int | None, most: int, forced_wn: int | None) -> Fp4StreamPlan:
    nt, mm = 1, expected_m or m
    while nt < STREAM_MAX_TOKEN_TILES and 8 * nt < mm:
        nt *= 2
    chunks = k // 128
    m_blocks = ceil_div(m, 8 * nt)
    tiles_m = groups * (ceil_div(expected_m, 8 * nt) if masked and expected_m else m_blocks)
    # 128-row CTAs: one activation tile in shared memory serves 128 weight rows (its L2 traffic is 1/128 of
    # the rows'); 64-row ones for narrow N. Splits: enough warps in flight (STREAM_TARGET_WARPS), within one
    # cluster (<= `most`).
    wn = forced_wn or (8 if n > 64 else 4)
    row_blocks = ceil_div(n, 16 * wn)
    tiles = row_blocks * tiles_m
    want = ceil_div(STREAM_TARGET_WARPS * sms // 132, tiles * wn)
    splits = max(1, min(want, most, chunks))
    cps = ceil_div(chunks, splits)
    splits = ceil_div(chunks, cps)
    ring = nt > 2 or cps > STREAM_MAX_CHUNKS or 8 * nt * cps * 256 > STREAM_WHOLE_BYTES
    key = Fp4StreamKey(nt=nt, wn=wn, out_bf16=out_bf16, has_c=has_c, masked=masked, slots=STREAM_SLOTS[nt], ring=ring)
    return Fp4StreamPlan(key=key, m_blocks=m_blocks, row_blocks=row_blocks, splits=splits, chunks_per_split=cps,
                         groups=groups)


# ----------------------------------------------------------------------------- the small-M kernel (bf16, <= 128 tokens)
# DEEPGEMM_FP4_KERNEL=auto takes it up to this many tokens (bf16 activations): its 8-token tile. H200, 2026-12-02
# 16:10 UTC (session 28, docs/benchmarks/deepgemm_fp4_h200_2026-12-02_s28/): at M = 1 its 32-warp build is 1.07x /
# 1.17x / 1.05x the mma.sync default at 7168 x 2048 / 2112 x 7168 / 4096 x 7168 (M = 2..8 run the same instructions);
# at M = 16 the 24-warp build is 0.90-1.05x, at M = 32 0.92-1.06x, at M = 64 slower or falls back (cluster
# residency), so the other kernels keep those.
AUTO_SMALL_MAX_M = 8
SMALL_MAX_M = 128  # DEEPGEMM_FP4_KERNEL=small up to this many tokens (more: the other kernels)
SMALL_MAX_TOKEN_TILES = 8  # its widest token tile (64 tokens; more: several m-blocks)
SMALL_WARPS = 8  # warps per CTA (RW row warps x KW k-warps)
# Per token tiles: (CTAs of SMALL_WARPS per SM the kernel is built for, P: chunks of codes a thread holds in registers
# at once), none spilling under NVRTC 13.0 and 13.5 (32 warps: 64 registers; 24: 80; 16: 128). One slot is refilled
# before the math (two chunks in flight a warp). 8 tokens: 32 warps x 1 slot (H200 R1: 1.05-1.17x the 24-warp,
# 3-slot build, which was 0.97-1.09x the mma.sync kernel); 16: 32 warps spill, 2 slots at 16 warps are slower.
SMALL_BUILD = {1: (4, 1), 2: (3, 2), 4: (2, 2), 8: (2, 1)}
SMALL_FIXED_CHUNKS = 2  # a CTA's fixed cost in chunks of one warp's work (launch, activation copy, reduction)


@dataclass(frozen=True)
class Fp4SmallKey(_KernelKey):
    """The small-M kernel: NT n8 token tiles, RW row warps (16 rows each) x KW k-warps, P register slots, PF the
    L2 prefetch of its weight loads (0 or 256 bytes)."""

    KERNEL = "fp4_small_sm90"
    nt: int
    rw: int
    kw: int
    out_bf16: bool
    has_c: bool
    masked: bool
    slots: int = 2
    pf: int = 0
    minb: int = 2  # CTAs per SM it is built for (__launch_bounds__)

    def template_args(self) -> tuple:
        return self.nt, self.rw, self.kw, self.slots, self.pf, self.minb, self.out_type, self.has_c, self.masked

    @property
    def wn(self) -> int:
        return self.rw

    @property
    def threads(self) -> int:
        return 32 * self.rw * self.kw

    @property
    def min_blocks(self) -> int:
        return self.minb


@dataclass(frozen=True)
class Fp4SmallPlan(_ClusterPlan):
    key: Fp4SmallKey

    @property
    def smem_bytes(self) -> int:  # the activation tile, the k-warps' parts, the epilogue's fp32 [tokens][rows] tile
        k = self.key
        return max(k.tokens * self.chunks_per_split * 256, (k.kw - 1) * k.rw * 32 * k.nt * 16, k.tokens * k.rows * 4)


def use_small(act_fp8: bool, m: int) -> bool:
    """Whether a call with m tokens (per group) takes the small-M kernel (bf16 activations only): auto up to
    AUTO_SMALL_MAX_M tokens, DEEPGEMM_FP4_KERNEL=small up to SMALL_MAX_M."""
    choice = kernel_choice()
    top = SMALL_MAX_M if choice == "small" else AUTO_SMALL_MAX_M if choice == "auto" else 0
    return not act_fp8 and m <= top


def _env_int(name: str, allowed: tuple[int, ...]) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    if v not in tuple(str(x) for x in allowed):
        raise validate.ArgumentError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {v!r}")
    return int(v)


def _small_forced() -> tuple:
    """DEEPGEMM_FP4_SMALL_RW, _SPLITS, _SLOTS, _PF, _MINB (A/B only; None: the planner's choice)."""
    return (_env_int("DEEPGEMM_FP4_SMALL_RW", (1, 2, 4, 8)), _env_int("DEEPGEMM_FP4_SMALL_SPLITS", tuple(range(1, 9))),
            _env_int("DEEPGEMM_FP4_SMALL_SLOTS", tuple(range(1, 7))), _env_int("DEEPGEMM_FP4_SMALL_PF", (0, 256)),
            _env_int("DEEPGEMM_FP4_SMALL_MINB", (2, 3, 4)))


def plan_small(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
               num_sms: int | None = None, expected_m: int | None = None,
               max_splits: int | None = None) -> Fp4SmallPlan | None:
    """Token tile, row warps x k-warps and cluster split-K of the small kernel (m: tokens per group, <= SMALL_MAX_M
    per m-block); None when its activation tile cannot fit (K too long for 8 splits). DEEPGEMM_FP4_SMALL_RW (1, 2,
    4, 8), _SPLITS (1..8), _SLOTS (1..6), _PF (0, 256) and _MINB (2, 3, 4: CTAs per SM) force a choice (A/B only)."""
    forced = _small_forced()
    return _plan_small(m, n, k, groups, out_bf16, has_c, masked, num_sms or get_num_sms(), expected_m,
                       MAX_CLUSTER_SPLITS if max_splits is None else max_splits, forced)


def small_fit() -> str:
    """DEEPGEMM_FP4_SMALL_FIT: how the small kernel's planner counts resident clusters. 'model' (the default): the
    GPC model (cluster_capacity), then the launch steps the split cap down while the driver holds fewer
    (_fit_clusters). 'driver' (opt-in, not yet timed on a GPU): the driver's count of each candidate's clusters
    (cuOccupancyMaxActiveClusters for its kernel, cluster size and shared memory, memoized per device), so the
    cost model only compares candidates whose clusters are all resident at once."""
    v = os.environ.get("DEEPGEMM_FP4_SMALL_FIT", "model")
    if v not in ("model", "driver"):
        raise validate.ArgumentError(f"DEEPGEMM_FP4_SMALL_FIT: expected model or driver, got {v!r}")
    return v


@dataclass(frozen=True)
class _SmallCandidate:
    """One (row warps, K splits) choice of the small kernel's planner, with what its cost needs."""

    key: Fp4SmallKey
    splits: int
    chunks_per_split: int
    tiles: int  # clusters (tiles of 16 rw rows x 8 nt tokens, per m-block and group)
    fit: int  # CTAs per SM the model lets in (min of the build's and the shared memory's)
    smem: int

    @property
    def cost(self) -> tuple[int, int]:
        """Per wave: chunks per warp + a CTA's fixed cost (one warp's work in chunks)."""
        return ceil_div(self.chunks_per_split, self.key.kw) + SMALL_FIXED_CHUNKS, self.key.rw


def _small_candidates(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
                      expected_m: int | None, most: int, forced: tuple) -> list[_SmallCandidate]:
    """Every (row warps, splits) the small kernel's planner weighs, with the key it would launch. Every warp gets
    at least one chunk; candidates whose activation tile does not fit in shared memory are left out."""
    f_rw, f_splits, f_slots, f_pf, f_minb = forced
    nt, mm = 1, expected_m or m
    while nt < SMALL_MAX_TOKEN_TILES and 8 * nt < mm:
        nt *= 2
    chunks = k // 128
    tiles_m = groups * (ceil_div(expected_m, 8 * nt) if masked and expected_m else ceil_div(m, 8 * nt))
    blocks, slots = SMALL_BUILD[nt]
    blocks = f_minb or blocks
    out = []
    for rw in (f_rw,) if f_rw else (8, 4, 2, 1):
        kw = SMALL_WARPS // rw
        tiles = ceil_div(n, 16 * rw) * tiles_m
        seen = set()
        for sp in (f_splits,) if f_splits else range(1, min(most, max(1, chunks // kw)) + 1):
            cps = ceil_div(chunks, sp)
            sp = ceil_div(chunks, cps)
            if sp in seen:
                continue
            seen.add(sp)
            smem = max(8 * nt * cps * 256, (kw - 1) * rw * 32 * nt * 16, 8 * nt * 16 * rw * 4)
            fit = min(blocks, SM_SMEM // (smem + 1024))  # CTAs per SM its shared memory lets in
            if fit == 0:
                continue
            key = Fp4SmallKey(nt=nt, rw=rw, kw=kw, out_bf16=out_bf16, has_c=has_c, masked=masked,
                              slots=min(f_slots or slots, max(1, ceil_div(cps, kw))), pf=f_pf if f_pf is not None else 0,
                              minb=blocks)
            out.append(_SmallCandidate(key=key, splits=sp, chunks_per_split=cps, tiles=tiles, fit=fit, smem=smem))
    return out


def _small_plan_of(c: _SmallCandidate, m: int, n: int, groups: int) -> Fp4SmallPlan:
    return Fp4SmallPlan(key=c.key, m_blocks=ceil_div(m, c.key.tokens), row_blocks=ceil_div(n, c.key.rows),
                        splits=c.splits, chunks_per_split=c.chunks_per_split, groups=groups)


def _choose_small(cands: list[_SmallCandidate], capacity) -> _SmallCandidate | None:
    """The cheapest candidate: waves of clusters (`capacity(c)`: clusters resident at once; None: leave it out) x
    (chunks per warp + the fixed cost), then more rows per CTA (one activation tile serves them), then fewer
    splits."""
    best = None
    for c in cands:
        cap = capacity(c)
        if cap is None:
            continue
        per_wave, rw = c.cost
        rank = (ceil_div(c.tiles, max(1, cap)) * per_wave, -rw, c.splits)
        if best is None or rank < best[0]:
            best = (rank, c)
    return None if best is None else best[1]


def _model_capacity(sms: int):
    return lambda c: cluster_capacity(sms, c.fit, c.splits) if c.splits > 1 else c.fit * sms


def _driver_capacity(sms: int, count):
    """capacity() for _choose_small from `count(key, size, smem)` (the driver's resident clusters of `size` CTAs;
    None where it cannot say: the GPC model's figure for that candidate). A cluster candidate is left out unless
    all its clusters are resident at once (a cluster left for a second wave doubles the time; the launch would
    step it down, _fit_clusters); a 1-CTA "cluster" (no cluster launch) may run in waves."""
    model = _model_capacity(sms)

    def capacity(c: _SmallCandidate) -> int | None:
        have = count(c.key, c.splits, c.smem)
        if have is None:
            return model(c)
        if c.splits > 1 and have < c.tiles:
            return None
        return max(1, have)

    return capacity


@functools.lru_cache(maxsize=1024)
def _plan_small(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool, sms: int,
                expected_m: int | None, most: int, forced: tuple) -> Fp4SmallPlan | None:
    c = _choose_small(_small_candidates(m, n, k, groups, out_bf16, has_c, masked, expected_m, most, forced),
                      _model_capacity(sms))
    return None if c is None else _small_plan_of(c, m, n, groups)


def plan_small_fitted(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
                      count, num_sms: int | None = None, expected_m: int | None = None,
                      forced: tuple | None = None) -> Fp4SmallPlan | None:
    """plan_small with the driver's cluster counts (DEEPGEMM_FP4_SMALL_FIT=driver): `count(key, size, smem)` is
    how many `size`-CTA clusters of that kernel with `smem` bytes of dynamic shared memory are resident at once
    (None: unknown). Every cluster plan it returns has all its clusters resident by `count`; None when no
    candidate fits (the other kernels run). forced: the A/B knobs (default: _small_forced())."""
    forced = _small_forced() if forced is None else forced
    sms = num_sms or get_num_sms()
    cands = _small_candidates(m, n, k, groups, out_bf16, has_c, masked, expected_m, MAX_CLUSTER_SPLITS, forced)
    c = _choose_small(cands, _driver_capacity(sms, count))
    return None if c is None else _small_plan_of(c, m, n, groups)


def small_candidate_keys(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
                         expected_m: int | None = None, forced: tuple | None = None) -> set[Fp4SmallKey]:
    """The kernels DEEPGEMM_FP4_SMALL_FIT=driver compiles to ask the driver about (one per candidate key; the
    kernel cache warm-up and the compile-only tests build them all). forced: the A/B knobs (default:
    _small_forced(), i.e. the environment's)."""
    forced = _small_forced() if forced is None else forced
    return {c.key for c in _small_candidates(m, n, k, groups, out_bf16, has_c, masked, expected_m,
                                             MAX_CLUSTER_SPLITS, forced)}


# The decode-to-shared kernel (kernels/fp4_gemm_sm90.cuh fp4_dec_sm90; DEEPGEMM_FP4_KERNEL=dec, dense calls, bf16 or
# e4m3 activations): DeepGEMM's fp8 tile at decode shapes (tokens = the wgmma M, 64 per math warpgroup; a thin
# slice of BN weight rows over the whole K range per CTA, one CTA per SM, a deep ring), the FP4 weights decoded by
# the math warpgroups into a shared B tile. A/B knobs: DEEPGEMM_FP4_DEC_BN (8..256, a multiple of 8),
# DEEPGEMM_FP4_DEC_WS (2-6: the warp-specialized kernel fp4_decws_sm90, a decoder warpgroup feeding that many decoded-tile
# slots), DEEPGEMM_FP4_DEC_SPLITS (1..8: K splits as one cluster, DSMEM reduction), DEEPGEMM_FP4_DEC_MCAST (2 / 4: clusters of
# that many CTAs along N share the activation tile by TMA multicast; no K splits), DEEPGEMM_FP4_DEC_BLOCKS (2: plan for two CTAs per SM:
# half the ring each, twice the CTAs).
DEC_MAX_STAGES = 8
DEC_MAX_TOKENS = 128  # two math warpgroups; more tokens: several m-blocks
DEC_FP8_MAX_BN = 64  # e4m3: BN / 2 accumulators + BN / 2 partial sums a thread (BN = 128 with 2 warpgroups spills)
DEC_WS_MAX_BN = 56  # the warp-specialized kernel, bf16 (its decoder's units unrolled; 64 with two math warpgroups spills)


@dataclass(frozen=True)
class Fp4DecKey(_KernelKey):
    """fp4_dec_sm90, or with ws > 0 fp4_decws_sm90 (a decoder warpgroup feeding `ws` decoded-tile slots)."""

    bn: int
    nwg: int
    act_fp8: bool
    out_bf16: bool
    has_c: bool
    stages: int
    mcast: int = 1
    ws: int = 0

    @property
    def KERNEL(self) -> str:  # noqa: N802 (the base's class constant)
        return "fp4_decws_sm90" if self.ws else "fp4_dec_sm90"

    def template_args(self) -> tuple:
        last = self.ws if self.ws else self.mcast
        return self.bn, self.nwg, self.act_fp8, self.out_type, self.has_c, self.stages, last

    @property
    def nt(self) -> int:  # n8 token tiles (tokens = 64 nwg)
        return 8 * self.nwg

    @property
    def wn(self) -> int:
        return self.bn // 16

    @property
    def rows(self) -> int:
        return self.bn

    @property
    def threads(self) -> int:
        return 128 * self.nwg + (160 if self.ws else 32)

    @property
    def min_blocks(self) -> int:
        return 1

    @property
    def smem_bytes(self) -> int:
        return dec_smem_bytes(self.bn, self.nwg, self.act_fp8, self.stages, self.ws)


def dec_stage_bytes(bn: int, nwg: int, act_fp8: bool) -> tuple[int, int]:
    """(one ring stage, one decoded tile) of the decode-to-shared kernel (its Fp4DecStage)."""
    tokens = 64 * nwg
    raw = tokens * 128 * (1 if act_fp8 else 2) + bn * 64 + bn * 16 + (tokens * 4 if act_fp8 else 0)
    dec = bn * 128 * (1 if act_fp8 else 2) + (ceil_div(bn * 4, 1024) * 1024 if act_fp8 else 0)
    return ceil_div(raw, 1024) * 1024, dec


def dec_smem_bytes(bn: int, nwg: int, act_fp8: bool, stages: int, ws: int = 0) -> int:
    """Dynamic shared memory of the dec kernel (two decoded tiles) or, ws > 0, of the warp-specialized one (ws slots of a
    tile + 1 KiB, two more barriers each)."""
    st, dec = dec_stage_bytes(bn, nwg, act_fp8)
    if ws:
        return 1024 + max(stages * st + ws * (dec + 1024), 64 * nwg * bn * 4) + 16 * (stages + ws)
    return 1024 + max(stages * st + 2 * dec, 64 * nwg * bn * 4) + 16 * stages


@dataclass(frozen=True)
class Fp4DecPlan(_ClusterPlan):
    key: Fp4DecKey

    @property
    def smem_bytes(self) -> int:
        return self.key.smem_bytes

    @property
    def grid(self) -> tuple[int, int, int]:  # MCAST: a whole number of clusters along N (an odd count: a phantom CTA)
        mc = self.key.mcast
        return ceil_div(self.row_blocks, mc) * mc, self.splits, self.m_blocks * self.groups

    @property
    def cluster(self) -> tuple[int, int, int] | None:
        if self.key.mcast > 1:
            return self.key.mcast, 1, 1
        return (1, self.splits, 1) if self.splits > 1 else None


# The dec planner's default warp-specialized slot count per activation kind where DEEPGEMM_FP4_DEC_WS is unset (None: the
# first kernel, fp4_dec_sm90).
DEC_DEFAULT_WS: dict[str, str | None] = {"bf16": None, "e4m3": None}


def dec_knobs(act_fp8: bool) -> tuple[str | None, ...]:
    """(BN, splits, multicast, CTAs per SM, ws slots) of a dec plan: the DEEPGEMM_FP4_DEC_* variables (ws: else
    DEC_DEFAULT_WS)."""
    env = os.environ.get
    ws = env("DEEPGEMM_FP4_DEC_WS", DEC_DEFAULT_WS["e4m3" if act_fp8 else "bf16"])
    return (env("DEEPGEMM_FP4_DEC_BN"), env("DEEPGEMM_FP4_DEC_SPLITS"), env("DEEPGEMM_FP4_DEC_MCAST"),
            env("DEEPGEMM_FP4_DEC_BLOCKS"), ws)


def plan_dec(m: int, n: int, k: int, out_bf16: bool, has_c: bool, act_fp8: bool,
             num_sms: int | None = None) -> Fp4DecPlan:
    """Token tile, weight rows per CTA (BN), K splits and ring depth of the decode-to-shared kernel (dense)."""
    return _plan_dec(m, n, k, out_bf16, has_c, act_fp8, num_sms or get_num_sms(), *dec_knobs(act_fp8))


@functools.lru_cache(maxsize=1024)
def _plan_dec(m: int, n: int, k: int, out_bf16: bool, has_c: bool, act_fp8: bool, sms: int, forced_bn: str | None,
              forced_splits: str | None, forced_mcast: str | None = None,
              forced_blocks: str | None = None, forced_ws: str | None = None) -> Fp4DecPlan:
    ws = 0
    if forced_ws is not None:  # A/B timing only: the warp-specialized kernel with this many decoded-tile slots
        if forced_ws not in ("0", "2", "3", "4", "6"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_WS: expected 0, 2, 3, 4 or 6, got {forced_ws!r}")
        ws = int(forced_ws)
    mcast = 1
    if forced_mcast is not None:  # A/B timing only
        if forced_mcast not in ("1", "2", "4"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_MCAST: expected 1, 2 or 4, got {forced_mcast!r}")
        mcast = int(forced_mcast)
    blocks = 1
    if forced_blocks is not None:  # A/B timing only
        if forced_blocks not in ("1", "2"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_BLOCKS: expected 1 or 2, got {forced_blocks!r}")
        blocks = int(forced_blocks)
    sms *= blocks  # CTAs resident at once
    nwg = 1 if m <= 64 else 2
    m_blocks = ceil_div(m, 64 * nwg)
    chunks = k // 128
    top = DEC_FP8_MAX_BN if act_fp8 else DEC_WS_MAX_BN if ws else 256
    if forced_splits is not None and forced_splits not in ("1", "2", "3", "4", "5", "6", "7", "8"):  # A/B only
        raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_SPLITS: expected 1..8, got {forced_splits!r}")
    if forced_bn is not None:  # A/B timing only
        if not (forced_bn.isdigit() and 8 <= int(forced_bn) <= 256 and int(forced_bn) % 8 == 0):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_BN: expected a multiple of 8 in 8..256, got {forced_bn!r}")
        bn = int(forced_bn)
        if bn > top:
            raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_BN: expected at most {top} with "
                                         f"{'e4m3 activations' if act_fp8 else 'DEEPGEMM_FP4_DEC_WS'}, got {bn}")
        # K splits (one cluster) that fill the SMs with these slices, unless forced too
        tiles = ceil_div(n, bn) * m_blocks
        fill = max(1, min(MAX_CLUSTER_SPLITS, chunks // 2, sms // tiles)) if mcast == 1 else 1
        splits = int(forced_splits) if forced_splits else fill
    else:
        splits = int(forced_splits) if forced_splits else 1
        # one wave: the thinnest slice of N (a multiple of 8) whose CTAs all fit on the SMs at once (multicast: whose
        # clusters fit, by the GPC model; the launch asks the driver and widens the slice if it holds fewer)
        ctas = sms if mcast == 1 else min(sms, cluster_capacity(sms // blocks, blocks, mcast) * mcast)
        bn = min(top, max(8, ceil_div(ceil_div(n * m_blocks * splits, ctas), 8) * 8))
    cps = ceil_div(chunks, min(splits, chunks))
    splits = ceil_div(chunks, cps)
    if mcast > 1 and splits > 1:
        raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_MCAST: expected 1 with K splits ({splits}), got {mcast}")
    if mcast > 1 and ws:
        raise validate.ArgumentError(f"DEEPGEMM_FP4_DEC_MCAST: expected 1 with DEEPGEMM_FP4_DEC_WS={ws}, got {mcast}")
    stages = min(DEC_MAX_STAGES, max(2, cps))
    while stages > 2 and dec_smem_bytes(bn, nwg, act_fp8, stages, ws) > min(227 * 1024, SM_SMEM // blocks - 1024):
        stages -= 1
    key = Fp4DecKey(bn=bn, nwg=nwg, act_fp8=act_fp8, out_bf16=out_bf16, has_c=has_c, stages=stages, mcast=mcast,
                    ws=ws)
    return Fp4DecPlan(key=key, m_blocks=m_blocks, row_blocks=ceil_div(n, bn), splits=splits, chunks_per_split=cps)


def _launch_dec(p: Fp4DecPlan, a, sfa, b, sfb, d, c, m: int, n: int, k: int) -> None:
    key = p.key
    from .cuda_gemm import _encode as encode_tiled  # cached per (pointer, shape, box)
    from .cuda_gemm import _sfa_layout

    db = encode_tiled(b.data_ptr(), torch.uint8, (n, k // 2), (k // 2, 1), (key.bn, 64), "64B")
    dsfb = encode_tiled(sfb.data_ptr(), torch.float32, (n, k // 32), (k // 32, 1), (key.bn, 4), "none")
    rows_a = key.tokens // key.mcast  # MCAST: each CTA of a cluster loads its share of the token rows
    if key.act_fp8:
        da = encode_tiled(a.data_ptr(), torch.uint8, (m, k), (a.stride(0), 1), (rows_a, 128), "128B")
        sfa_t = _sfa_layout(sfa)
        dsfa = encode_tiled(sfa_t.data_ptr(), torch.float32, (k // 128, m), (get_tma_aligned_size(m, 4), 1),
                            (1, key.tokens), "none")
    else:
        da = encode_tiled(a.data_ptr(), torch.bfloat16, (m, k), (a.stride(0), 1), (rows_a, 64), "128B")
        dsfa = _NULL_DESC
    log.debug("fp4 dec gemm %dx%dx%d: %s grid %s cluster %s, %d chunks per split", m, n, k, key.expression, p.grid,
              p.cluster, p.chunks_per_split)
    _kernel(key).launch(p.grid, key.threads, [db, dsfb, da, dsfa, d, c, m, n, k, p.m_blocks, p.chunks_per_split],
                        smem_bytes=key.smem_bytes, cluster=p.cluster)


# DEEPGEMM_FP4_KERNEL=auto takes the dec kernel (dense calls) from this many tokens on, per activation kind (None: never);
# DEEPGEMM_FP4_AUTO_DEC_MIN_M="bf16=N,e4m3=N" (N or none) overrides it for A/B timing of a policy before it flips.
AUTO_DEC_MIN_M: dict[str, int | None] = {"bf16": None, "e4m3": None}


def auto_dec_min_m(act_fp8: bool) -> int | None:
    """The smallest M at which auto takes the dec kernel for this activation kind (AUTO_DEC_MIN_M or its env)."""
    kind = "e4m3" if act_fp8 else "bf16"
    v = os.environ.get("DEEPGEMM_FP4_AUTO_DEC_MIN_M")
    if v is None:
        return AUTO_DEC_MIN_M[kind]
    table = dict(AUTO_DEC_MIN_M)
    for part in filter(None, v.split(",")):
        name, _, val = part.partition("=")
        if name not in table or not (val.isdigit() or val == "none"):
            raise validate.ArgumentError(f"DEEPGEMM_FP4_AUTO_DEC_MIN_M: expected 'bf16=N,e4m3=N' (N a count or none), "
                                         f"got {v!r}")
        table[name] = None if val == "none" else int(val)
    return table[kind]


def use_dec(act_fp8: bool, m: int) -> bool:
    """Whether a dense call with m tokens takes the dec kernel: DEEPGEMM_FP4_KERNEL=dec, or auto from auto_dec_min_m."""
    choice = kernel_choice()
    if choice == "dec":
        return True
    low = auto_dec_min_m(act_fp8) if choice == "auto" else None
    return low is not None and m >= low


def _try_dec(a, sfa, b, sfb, d, c, m: int, n: int, k: int) -> bool:
    """Run the decode-to-shared kernel if use_dec says so (dense calls only); whether it ran."""
    if not use_dec(sfa is not None, m):
        return False

    sms = get_num_sms()
    forced_bn, forced_splits, mcast, blocks, ws = dec_knobs(sfa is not None)

    def replan(most=None):
        splits = forced_splits if most is None else str(most)
        return _plan_dec(m, n, k, d.dtype == torch.bfloat16, c is not None, sfa is not None, sms, forced_bn, splits,
                         mcast, blocks, ws)

    p = _fit_clusters(replan(), a.device, replan)
    dev = a.device.index if a.device.index is not None else 0
    while p.key.mcast > 1 and p.key.bn + 8 <= (DEC_FP8_MAX_BN if sfa is not None else 256):
        clusters = p.grid[0] // p.key.mcast * p.grid[2]
        have = _max_active_clusters_x(p.key, p.key.mcast, dev, p.smem_bytes)
        if have is None or have >= clusters:
            break
        log.debug("fp4 dec: %d clusters of %d CTAs, the device holds %d at once: a wider slice", clusters, p.key.mcast,
                  have)
        p = _plan_dec(m, n, k, d.dtype == torch.bfloat16, c is not None, sfa is not None, sms, str(p.key.bn + 8), "1",
                      mcast, blocks)
    _launch_dec(p, a, sfa, b, sfb, d, c, m, n, k)
    return True


@functools.lru_cache(maxsize=256)
def _max_active_clusters_x(key: Fp4DecKey, size: int, device_index: int, smem: int) -> int | None:
    """The driver's count of resident clusters of `size` CTAs along grid x (the dec kernel's multicast clusters)."""
    try:
        return _kernel(key).max_active_clusters(key.threads, smem, (size, 1, 1), device_index)
    except Exception as e:  # noqa: BLE001 - an older driver or binding: the GPC model's plan stands
        log.debug("fp4: cuOccupancyMaxActiveClusters unavailable for %s (%s); keeping the modelled slice", key.expression,
                  e)
        return None


def kernel_source() -> str:
    """kernels/fp4_gemm_sm90.cuh, or the file DEEPGEMM_FP4_KERNEL_SOURCE names (A/B timing of a kernel change
    against the previous header in one run; every instantiation compiles from it)."""
    alt = os.environ.get("DEEPGEMM_FP4_KERNEL_SOURCE")
    if alt:
        log.debug("fp4: kernels from %s (DEEPGEMM_FP4_KERNEL_SOURCE)", alt)
        return Path(alt).read_text()
    return (KERNEL_DIR / "fp4_gemm_sm90.cuh").read_text()


def compile_kernel(key: Fp4Key | Fp4WgKey | Fp4StreamKey, extra_options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC-compile one instantiation for sm_90a (no GPU needed; cached on disk by content)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_fp4_gemm_sm90",
                                options=OPTIONS + extra_options, name_expressions=[key.expression])


def _kernel(key: Fp4Key | Fp4WgKey | Fp4StreamKey) -> tilehal.Kernel:
    return _kernel_from(key, os.environ.get("DEEPGEMM_FP4_KERNEL_SOURCE"))


@functools.lru_cache(maxsize=128)
def _kernel_from(key: Fp4Key | Fp4WgKey | Fp4StreamKey, source: str | None) -> tilehal.Kernel:
    return compile_kernel(key).get_kernel(key.expression)


_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}
_COUNTERS: dict[int, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counter sets, kept alive for graphs that captured them


def _workspace(device: torch.device, floats: int) -> torch.Tensor | None:
    if floats == 0:
        return None
    size = 1 << max(20, (floats - 1).bit_length())  # power-of-two classes, never freed (graph safety)
    key = (device.index, size)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = torch.empty(size, dtype=torch.float32, device=device)
    return ws


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    cur = _COUNTERS.get(device.index)
    if cur is None or cur.numel() < tiles:
        size = 1 << max(12, (tiles - 1).bit_length())
        if cur is not None:
            _RETIRED.append(cur)
        cur = _COUNTERS[device.index] = torch.zeros(size, dtype=torch.int32, device=device)
    return cur


def _check(a: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None) -> None:
    validate.cuda_operand(a, "a")  # TMA: unit stride along K, 16-byte rows and base
    for t, name in ((b, "b"), (sfb, "sfb"), (d, "d")):
        validate.cuda_output(t, name)
    if c is not None:
        validate.cuda_output(c, "c")
    if a.dim() == 3 and not a.is_contiguous():
        raise ShapeError(f"a: expected a contiguous [G, M_max, K] tensor on CUDA, got strides {tuple(a.stride())}")
    cap = torch.cuda.get_device_capability(a.device)
    if cap[0] != 9:
        raise tilehal.DeviceError(f"deepgemm FP4 kernel: expected an sm_90 (Hopper) GPU, got sm_{cap[0]}{cap[1]}")


def _scales_32(sfb: torch.Tensor, gran: int) -> torch.Tensor:
    if gran == 32:
        return sfb.contiguous()
    # The kernel reads one fp32 scale per 32 weights; 1 x 128 scales are repeated once per call.
    log.debug("sfb: 1 x %d weight scales expanded to 1 x 32 for the FP4 kernel (cast with gran_k=32 to skip this)",
              gran)
    return sfb.repeat_interleave(gran // 32, dim=-1).contiguous()


def _launch(p: Fp4Plan, a, sfa, b, sfb, d, c, masked_m, m: int, n: int, k: int) -> None:
    key = p.key
    g = p.groups
    a2 = a.reshape(-1, k) if a.dim() == 3 else a
    rows_a = a2.shape[0]
    from .cuda_gemm import _encode as encode_tiled  # cached per (pointer, shape, box)
    from .cuda_gemm import _sfa_layout

    if key.act_fp8:
        da = encode_tiled(a2.data_ptr(), torch.uint8, (rows_a, k), (a2.stride(0), 1), (key.tokens, 128), "128B")
        sfa_t = _sfa_layout(sfa)
        sk = k // 128
        dsfa = encode_tiled(sfa_t.data_ptr(), torch.float32, (g * sk, m), (get_tma_aligned_size(m, 4), 1),
                            (1, key.tokens), "none")
    else:
        da = encode_tiled(a2.data_ptr(), torch.bfloat16, (rows_a, k), (a2.stride(0), 1), (key.tokens, 64), "128B")
        dsfa = _NULL_DESC
    db = encode_tiled(b.data_ptr(), torch.uint8, (g * n, k // 2), (k // 2, 1), (key.rows, 64), "64B")
    dsfb = encode_tiled(sfb.data_ptr(), torch.float32, (g * n, k // 32), (k // 32, 1), (key.rows, 4), "none")
    ws = _workspace(a.device, p.workspace_floats)
    counters = _counters(a.device, p.tiles_all)
    log.debug("fp4 gemm %dx%dx%d (groups %d): %s grid %s, %d chunks per split", m, n, k, g, key.expression, p.grid,
              p.chunks_per_split)
    _kernel(key).launch(p.grid, key.threads, [db, dsfb, da, dsfa, d, c, ws, counters, masked_m, m, n, k, p.m_blocks,
                                              p.chunks_per_split], smem_bytes=key.smem_bytes)


def _max_active_clusters(key: Fp4WgKey | Fp4StreamKey | Fp4SmallKey, size: int, device_index: int, smem: int) -> int | None:
    """The driver's count of `size`-CTA clusters of this kernel (with `smem` bytes of dynamic shared memory)
    resident at once (None if it cannot say)."""
    return _max_active_clusters_from(key, size, device_index, smem, os.environ.get("DEEPGEMM_FP4_KERNEL_SOURCE"))


@functools.lru_cache(maxsize=256)
def _max_active_clusters_from(key: Fp4WgKey | Fp4StreamKey | Fp4SmallKey, size: int, device_index: int, smem: int,
                              source: str | None) -> int | None:
    try:
        return _kernel(key).max_active_clusters(key.threads, smem, (1, size, 1), device_index)
    except Exception as e:  # noqa: BLE001 - an older driver or binding: the GPC model's plan stands
        log.debug("fp4: cuOccupancyMaxActiveClusters unavailable for %s (%s); keeping the modelled split count",
                  key.expression, e)
        return None


@functools.lru_cache(maxsize=1024)
def _plan_small_driver(m: int, n: int, k: int, groups: int, out_bf16: bool, has_c: bool, masked: bool,
                       expected_m: int | None, device_index: int, forced: tuple,
                       source: str | None) -> Fp4SmallPlan | None:
    """DEEPGEMM_FP4_SMALL_FIT=driver's plan on one device (memoized: a decode step's host path does not re-ask)."""
    def count(key, size, smem):
        return _max_active_clusters(key, size, device_index, smem)

    p = plan_small_fitted(m, n, k, groups, out_bf16, has_c, masked, count, expected_m=expected_m, forced=forced)
    log.debug("fp4 small (driver cluster counts): %s", p)
    return p


def _fit_clusters(p, device: torch.device, replan):
    """Fewer splits while the driver says the plan's clusters would not all be resident at once (a cluster
    left for a second wave doubles the time)."""
    while p.splits > 1:
        have = _max_active_clusters(p.key, p.splits, device.index if device.index is not None else 0,
                                    p.smem_bytes)
        if have is None or have >= p.tiles_all:
            return p
        log.debug("fp4 wgmma: %d clusters of %d CTAs, the device holds %d at once: fewer splits", p.tiles_all,
                  p.splits, have)
        p = replan(p.splits - 1)
        if p is None:  # the small kernel: no plan with fewer splits (its activation tile would not fit)
            return None
    return p


def _launch_wgmma(p: Fp4WgPlan, a, sfa, b, sfb, d, c, masked_m, m: int, n: int, k: int) -> None:
    key = p.key
    g = p.groups
    a2 = a.reshape(-1, k) if a.dim() == 3 else a
    from .cuda_gemm import _encode as encode_tiled  # cached per (pointer, shape, box)
    from .cuda_gemm import _sfa_layout

    db = encode_tiled(b.data_ptr(), torch.uint8, (g * n, k // 2), (k // 2, 1), (key.rows, 64), "64B")
    dsfb = encode_tiled(sfb.data_ptr(), torch.float32, (g * n, k // 32), (k // 32, 1), (key.rows, 4), "none")
    if key.act_fp8:
        da = encode_tiled(a2.data_ptr(), torch.uint8, (a2.shape[0], k), (a2.stride(0), 1), (key.tokens, 128), "128B")
        sfa_t = _sfa_layout(sfa)
        dsfa = encode_tiled(sfa_t.data_ptr(), torch.float32, (g * (k // 128), m), (get_tma_aligned_size(m, 4), 1),
                            (1, key.tokens), "none")
        descs = [db, dsfb, da, dsfa]
    else:
        da = encode_tiled(a2.data_ptr(), torch.bfloat16, (a2.shape[0], k), (a2.stride(0), 1), (key.tokens, 64),
                          "128B")
        descs = [db, dsfb, da]
    log.debug("fp4 wgmma gemm %dx%dx%d (groups %d): %s grid %s cluster %s, %d chunks per split", m, n, k, g,
              key.expression, p.grid, p.cluster, p.chunks_per_split)
    _kernel(key).launch(p.grid, key.threads, [*descs, d, c, masked_m, m, n, k, p.m_blocks, p.chunks_per_split],
                        smem_bytes=key.smem_bytes, cluster=p.cluster)


def _launch_stream(p: Fp4StreamPlan, a, b, sfb, d, c, masked_m, m: int, n: int, k: int) -> None:
    key = p.key
    a2 = a.reshape(-1, k) if a.dim() == 3 else a
    log.debug("fp4 stream gemm %dx%dx%d (groups %d): %s grid %s cluster %s, %d chunks per split", m, n, k, p.groups,
              key.expression, p.grid, p.cluster, p.chunks_per_split)
    _kernel(key).launch(p.grid, key.threads, [b, sfb, a2, d, c, masked_m, m, n, k, a2.stride(0), p.m_blocks,
                                              p.chunks_per_split], smem_bytes=p.smem_bytes, cluster=p.cluster)


def _launch_small(p: Fp4SmallPlan, a, b, sfb, d, c, masked_m, m: int, n: int, k: int) -> None:
    key = p.key
    a2 = a.reshape(-1, k) if a.dim() == 3 else a
    log.debug("fp4 small gemm %dx%dx%d (groups %d): %s grid %s cluster %s, %d chunks per split", m, n, k, p.groups,
              key.expression, p.grid, p.cluster, p.chunks_per_split)
    _kernel(key).launch(p.grid, key.threads, [b, sfb, a2, d, c, masked_m, m, n, k, a2.stride(0), p.m_blocks,
                                              p.chunks_per_split], smem_bytes=p.smem_bytes, cluster=p.cluster)


def _try_small(a, sfa, b, sfb, d, c, masked_m, m: int, n: int, k: int, groups: int, expected_m: int | None) -> bool:
    """Run the small-M kernel if the policy and its limits allow; whether it ran."""
    if not use_small(sfa is not None, expected_m or m):
        return False

    def replan(most=None):
        return plan_small(m, n, k, groups, d.dtype == torch.bfloat16, c is not None, masked_m is not None,
                          expected_m=expected_m, max_splits=most)

    if sfb.numel() >= 1 << 32:  # the kernel indexes the scales with 32 bits
        log.debug("fp4 small: %d weight scales (>= 2^32); the other kernels", sfb.numel())
        return False
    if small_fit() == "driver":
        p = _plan_small_driver(m, n, k, groups, d.dtype == torch.bfloat16, c is not None, masked_m is not None,
                               expected_m, a.device.index if a.device.index is not None else 0, _small_forced(),
                               os.environ.get("DEEPGEMM_FP4_KERNEL_SOURCE"))
        if p is None:
            log.debug("fp4 small: no plan whose clusters the driver holds at once (K = %d); the other kernels", k)
            return False
    else:
        p = replan()
    if p is None:
        log.debug("fp4 small: K = %d too long for its activation tile in %d splits; the other kernels", k,
                  MAX_CLUSTER_SPLITS)
        return False
    p = _fit_clusters(p, a.device, replan)
    if p is None:
        return False
    _launch_small(p, a, b, sfb, d, c, masked_m, m, n, k)
    return True


def _try_stream(a, sfa, b, sfb, d, c, masked_m, m: int, n: int, k: int, groups: int, expected_m: int | None) -> bool:
    """Run the streaming kernel if the policy and its limits allow; whether it ran."""
    if not use_stream(sfa is not None, expected_m or m):
        return False

    def replan(most=None):
        return plan_stream(m, n, k, groups, d.dtype == torch.bfloat16, c is not None, masked_m is not None,
                           expected_m=expected_m, max_splits=most)

    _launch_stream(_fit_clusters(replan(), a.device, replan), a, b, sfb, d, c, masked_m, m, n, k)
    return True


def dense(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, gran: int, d: torch.Tensor,
          c: torch.Tensor | None) -> None:
    """a [M, K] (e4m3 + sfa, or bf16), b packed [N, K/2], sfb fp32 [N, K/gran]; d = c + a @ W^T."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return
    sfb = _scales_32(sfb, gran)
    _check(a, b, sfb, d, c)
    if c is not None and c.dtype != torch.float32:
        log.debug("c: bf16 accumulation; widening C to fp32 for the FP4 kernel's epilogue")
        c = c.float()
    if _try_dec(a, sfa, b, sfb, d, c, m, n, k):
        return
    if _try_small(a, sfa, b, sfb, d, c, None, m, n, k, 1, None):
        return
    if _try_stream(a, sfa, b, sfb, d, c, None, m, n, k, 1, None):
        return
    if use_wgmma(sfa is not None, m):
        def replan(most=None):
            return plan_wgmma(m, n, k, 1, d.dtype == torch.bfloat16, c is not None, False, act_fp8=sfa is not None,
                              max_splits=most)

        pw = _fit_clusters(replan(), a.device, replan)
        _launch_wgmma(pw, a, sfa, b, sfb, d, c, None, m, n, k)
        return
    log.debug("fp4 gemm: the mma.sync kernel (DEEPGEMM_FP4_KERNEL=%s, %s activations)", kernel_choice(),
              "e4m3" if sfa is not None else "bf16")
    p = plan(m, n, k, 1, sfa is not None, d.dtype == torch.bfloat16, c is not None, False)
    _launch(p, a, sfa, b, sfb, d, c, None, m, n, k)


def grouped_masked(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, gran: int,
                   d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    """a [G, M_max, K], b packed [G, N, K/2], sfb [G, N, K/gran], d [G, M_max, N]; rows past masked_m unwritten."""
    g, m_max, k = a.shape
    n = b.shape[1]
    if m_max == 0 or n == 0:
        return
    if kernel_choice() == "dec":
        log.debug("fp4 grouped: the decode-to-shared kernel takes dense calls only; grouped as auto")
    sfb = _scales_32(sfb, gran)
    _check(a, b, sfb, d, None)
    if _try_small(a, sfa, b, sfb, d, None, masked_m.contiguous(), m_max, n, k, g, min(expected_m, m_max)):
        return
    if _try_stream(a, sfa, b, sfb, d, None, masked_m.contiguous(), m_max, n, k, g, min(expected_m, m_max)):
        return
    if use_wgmma(sfa is not None, min(expected_m, m_max)):
        def replan(most=None):
            return plan_wgmma(m_max, n, k, g, d.dtype == torch.bfloat16, False, True,
                              expected_m=min(expected_m, m_max), act_fp8=sfa is not None, max_splits=most)

        pw = _fit_clusters(replan(), a.device, replan)
        _launch_wgmma(pw, a, sfa, b, sfb, d, None, masked_m.contiguous(), m_max, n, k)
        return
    p = plan(m_max, n, k, g, sfa is not None, d.dtype == torch.bfloat16, False, True,
             expected_m=min(expected_m, m_max))
    # Every (group, m-block) gets a grid slice; blocks past masked_m[g] return at once.
    p = Fp4Plan(key=p.key, m_blocks=ceil_div(m_max, p.key.tokens), row_blocks=p.row_blocks, splits=p.splits,
                chunks_per_split=p.chunks_per_split, groups=g)
    _launch(p, a, sfa, b, sfb, d, None, masked_m.contiguous(), m_max, n, k)
