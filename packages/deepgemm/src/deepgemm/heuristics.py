"""Pick block sizes, pipeline depth and TMA multicast for one GEMM shape.

The kernels are persistent: `num_sms` CTAs walk the output tiles in waves, and a wave lasts as
long as one tile, however few SMs its last wave keeps busy. So the estimated time of a candidate
tile (BLOCK_M x BLOCK_N) is waves x tile cost, where a tile costs as if it were
(BLOCK_M + TILE_OVERHEAD_M) x (BLOCK_N + TILE_OVERHEAD_N): smaller tiles do more fixed work per
K block (barriers, scale loads, promotion) and move more operand bytes per FLOP. The cheapest
candidate wins; ties go to the fuller last wave, then the larger tile. (DeepGEMM's rule, fewest
waves first, would take a 192-wide tile in 10 waves over a 160-wide one in 11, which is slower.)
fp8 tiles whose promotion overlaps the next K block's wgmma (`overlaps`) cost OVERLAP_COST of the
same tile without it (H200: the overlapped path measured 1.10x faster, same tile, same run).
Stages = as many pipeline buffers as fit in shared memory (at most 8).
With `tma_store`, a BLOCK_M x BLOCK_N bf16 staging tile for the epilogue is reserved first.

Multicast (2-CTA clusters whose CTAs share one operand tile, loaded once from L2 for both) is OFF
by default (`max_multicast=1`): on the H200 every multicast variant measured about 1.5-2x slower
than the same tile without it (see docs/deepgemm.md). With `max_multicast=2` it is used for large
problems (at least `MULTICAST_MIN_M` rows) when the paired dimension has an even
number of blocks, so that no CTA computes a phantom tile: on B (neighbouring m-blocks; dense
GEMMs only, grouped neighbours may belong to different experts) or on A (neighbouring n-blocks),
preferring the operand with the larger tile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

from tilehal import ArgumentError

from .utils import ceil_div, get_num_sms

log = logging.getLogger("deepgemm")

SMEM_CAPACITY = 232448  # bytes of dynamic shared memory one sm_90 CTA may opt into (227 KiB)
SMEM_SLACK = 1024  # manual 1024-byte alignment of the swizzled tiles
MAX_STAGES = 8
TILE_OVERHEAD_M = 64  # see the module docstring: the cost model's per-tile fixed work
TILE_OVERHEAD_N = 32
ODD_WIDTH_PENALTY = 1.15
MULTICAST_MIN_M = 1024  # below this the operands are few and L2 traffic is not what limits
ROW_BYTES = 128  # BLOCK_K is one 128-byte swizzle row: 128 fp8 or 64 bf16 elements
# fp8 tiles that keep a second partial-sum register set (3 x BLOCK_N/2 of the math threads'
# registers), so each K block's promotion overlaps the next block's wgmma: up to 96 wide, and 128
# (which never straddles two weight-scale blocks, so it needs no per-column scale selection). 104..120
# spill a few registers in some K-tail / grouped variants (measured with ptxas -v), and wider tiles
# cannot hold three sets at all.
# The contiguous grouped kernel (expert lookup per tile) spills 12 bytes at 128 with the 40-register
# producer; with a 24-register producer (its math warpgroups get 240) it does not, but on the H200 the
# overlapped path measured 2.5 % / 1.4 % SLOWER there (docs/benchmarks/deepgemm_contig_overlap_ab_h200_*.json),
# so the contiguous kernel keeps the serial promotion.
# The producer-fed tile schedule per grouping (GemmConfig.tile_info overrides), and whether the contiguous kernel
# then overlaps its promotion. H200 s26 R3 (docs/benchmarks/issue19_grouped/bench_grouped_h200_2026-12-02_s26r3.json,
# outputs bit-identical to the serial kernel): contiguous with it + the overlapped promotion 1219 / 1157 / 1037 /
# 1070 TFLOPS against serial 1131 / 1052 / 929 / 1039 at 4x8192x4096x7168 / 8x4096x7168x2048 / the Mixtral gate|up
# and down shapes; masked with it 4-12 % slower than without (its producer then scans masked_m per tile), so off.
TILE_INFO = {"contiguous": True, "masked": False}
CONTIGUOUS_OVERLAP_WITH_TILE_INFO = True
OVERLAP_MAX_STRADDLING_N = 96
OVERLAP_MAX_BLOCK_N = 128
# Cost factor of an fp8 tile whose promotion overlaps the next wgmma: the promotion (BLOCK_N/2 FMAs
# per thread and K block) leaves the warpgroup's critical path. Measured 1.08x .. 1.16x on the H200
# (docs/benchmarks/deepgemm_h200.json, ours_serial_promotion_*), so 0.9 errs on the cautious side.
OVERLAP_COST = 0.9
MIN_STAGED_STAGES = 3  # a staged copy-out tile must leave room for this many pipeline stages
C_TMA_BARRIER_BYTES = 8  # the C_TMA epilogue's mbarrier (kernels/gemm_sm90.cuh c_bar, after the ring's barriers)


@dataclass(frozen=True)
class GemmConfig:
    kind: str  # "fp8" or "bf16"
    block_m: int
    block_n: int
    block_k: int
    stages: int
    multicast: int
    num_waves: int
    last_wave_util: int  # CTAs busy in the last wave
    num_sms: int  # persistent CTAs to launch (before capping by the tile count)
    tma_store: bool = False  # epilogue staged in shared memory and written by TMA
    multicast_on_a: bool = False  # with multicast 2: the cluster shares A (else B)
    allow_overlap: bool = True  # fp8: overlap promotion with the next wgmma where registers allow
    grouping: str = "normal"  # "normal", "contiguous" or "masked"
    staged_store: int = 0  # without TMA store: bytes per element of the staged copy-out tile (2, 4) or 0 (direct)
    contiguous_overlap: bool = False  # fp8 contiguous: the overlapped promotion too (A/B timing; see overlaps())
    swiglu: bool = False  # epilogue writes silu(gate) * up: a BLOCK_M x BLOCK_N/2 output tile (swiglu_config)
    tile_info: bool | None = None  # grouped: producer-fed tile schedule (None: TILE_INFO's default, off with multicast)
    expert_raster: bool = False  # contiguous + tile schedule: expert-major raster (opt-in, not GPU-timed yet)
    expert_band: int = 0  # expert_raster: n-units per band inside an expert (0: the whole row)
    c_tma: bool = False  # bf16 C into bf16 D: C TMA-loaded into the staging tile during the main loop (C_TMA)

    @property
    def use_tile_info(self) -> bool:
        """Whether the grouped kernel gets its tiles from the producer (kernels/gemm_sm90.cuh kTileInfo). With
        multicast only when asked for (tile_info=True) and only for the contiguous kernel's A multicast (opt-in,
        not GPU-timed yet)."""
        if self.grouping == "normal":
            return False
        if self.multicast > 1:
            return self.tile_info is True and self.grouping == "contiguous" and self.multicast_on_a
        if self.tile_info is not None:
            return self.tile_info
        return TILE_INFO[self.grouping] and self.kind == "fp8"  # measured for fp8 only (bf16: not yet timed)

    @property
    def overlap_promotion(self) -> bool:
        """Whether the kernel keeps two fp8 partial-sum sets (derived, so replacing block_n stays valid)."""
        # fp32 staging (C or fp32 D) next to three partial-sum sets spills (ptxas): serial promotion there
        contiguous_ok = self.contiguous_overlap or (self.use_tile_info and CONTIGUOUS_OVERLAP_WITH_TILE_INFO)
        grouping = "normal" if contiguous_ok and self.grouping == "contiguous" else self.grouping
        return self.allow_overlap and self.staged_store != 4 and overlaps(self.kind, self.block_n, grouping)

    @property
    def d_swizzle(self) -> int:
        if self.tma_store:
            return d_swizzle(self.out_block_n)
        return 1 if self.staged_store else 0  # 1: the kernel's staged copy-out epilogue

    @property
    def out_block_n(self) -> int:
        """Output columns of one tile (half the tile with the SwiGLU epilogue)."""
        return self.block_n // 2 if self.swiglu else self.block_n

    @property
    def num_math_warpgroups(self) -> int:
        return self.block_m // 64

    @property
    def num_threads(self) -> int:
        return warp_specialized_threads(self.block_m)

    @property
    def smem_bytes(self) -> int:
        table = EXPERT_TABLE_BYTES if self.expert_raster else 0
        return smem_bytes(self.kind, self.block_m, self.block_n, self.stages, self.epilogue_bytes,
                          self.grouping != "normal") + table

    @property
    def epilogue_bytes(self) -> int:
        return epilogue_bytes(self.block_m, self.out_block_n, self.tma_store, self.staged_store, self.c_tma)


def block_n_candidates(kind: str, grouping: str = "normal") -> tuple[int, ...]:
    """Tile widths the kernels instantiate.

    fp8 keeps two fp32 accumulator sets (the K block's partial sum and the promoted total), BLOCK_N/2
    registers each per thread, so it stops at 192 (2 x 96 of the 232 registers a math thread gets,
    no spills); and one tile may span at most two 128-wide scale blocks of B
    (BLOCK_N <= 128 + gcd(BLOCK_N, 128), which leaves 168..184 out). bf16 keeps one set and goes
    to wgmma's 256. Grouped kernels keep a few more registers live (the expert index and offsets),
    which pushes 192 into spills: they stop at 160.
    """
    if kind == "fp8":
        top = 192 if grouping == "normal" else 160
        return tuple(n for n in range(16, top + 1, 8) if n <= 128 + math.gcd(n, 128))
    return tuple(range(16, 257, 8))


def overlaps(kind: str, block_n: int, grouping: str = "normal") -> bool:
    """fp8 tiles whose promotion can overlap the next K block's wgmma (two partial-sum sets fit)."""
    return (kind == "fp8" and grouping != "contiguous"
            and (block_n <= OVERLAP_MAX_STRADDLING_N or block_n == OVERLAP_MAX_BLOCK_N))


def d_swizzle(block_n: int) -> int:
    """Bytes per row of the epilogue's TMA-store boxes (32/64/128: swizzled, bank-conflict free) or
    0 (one plain box of BLOCK_N columns) when BLOCK_N is not a multiple of 16."""
    for swizzle in (128, 64, 32):
        if block_n % (swizzle // 2) == 0:
            return swizzle
    return 0


def pick_multicast(grouping: str, m: int, n: int, block_m: int, block_n: int, num_sms: int,
                   max_multicast: int = 2) -> tuple[int, bool]:
    """(multicast, on_a): 2-CTA clusters for large problems when the paired block count is even."""
    if max_multicast < 2 or num_sms % 2 or m < MULTICAST_MIN_M:
        return 1, False
    # Each CTA loads half of the shared tile, which must start on an 8-row swizzle atom.
    even_m = ceil_div(m, block_m) % 2 == 0 and grouping == "normal" and block_n % 16 == 0
    even_n = ceil_div(n, block_n) % 2 == 0 and block_m % 16 == 0
    order = ((True, even_n), (False, even_m)) if block_m > block_n else ((False, even_m), (True, even_n))
    for on_a, legal in order:
        if legal:
            return 2, on_a
    return 1, False


def epilogue_passes(block_n: int, c_tma: bool = False) -> int:
    """TMA-store staging passes of a tile (kernels/gemm_sm90.cuh kEpiPasses): 256-wide tiles are staged
    128 columns at a time, which leaves room for a 4th pipeline stage of bf16 128x256 tiles. With `c_tma` the
    staging tile holds the whole C tile (one pass)."""
    return 2 if block_n == 256 and not c_tma else 1


def epilogue_bytes(block_m: int, block_n: int, tma_store: bool, staged_store: int = 0, c_tma: bool = False) -> int:
    """Shared memory of the epilogue's staging tile: bf16 for the TMA store (the whole tile and the C barrier
    with `c_tma`); for the staged copy-out (kernels/gemm_sm90.cuh StagedStore) rows padded by 16 (bf16) / 32
    (fp32) bytes, rounded to 1 KiB."""
    if c_tma:
        return block_m * block_n * 2 + C_TMA_BARRIER_BYTES
    if tma_store:
        return block_m * block_n * 2 // epilogue_passes(block_n)
    if staged_store:
        row = block_n * staged_store + (32 if staged_store == 4 else 16)
        return ceil_div(block_m * row, 1024) * 1024
    return 0


def stage_bytes(kind: str, block_m: int, block_n: int) -> int:
    sfa = block_m * 4 if kind == "fp8" else 0  # one fp32 activation scale per row and K block
    return (block_m + block_n) * ROW_BYTES + sfa


TILE_INFO_BYTES = 16  # per stage, grouped kernels: the producer's tile slot (kernels/gemm_sm90.cuh kTileInfo)
EXPERT_TABLE_BLOCKS = 2048  # expert-major raster: m-blocks its shared-memory table holds (kExpertTableBlocks)
EXPERT_TABLE_BYTES = 2 * EXPERT_TABLE_BLOCKS  # one 16-bit expert id per m-block


def smem_bytes(kind: str, block_m: int, block_n: int, stages: int, epilogue_bytes: int = 0,
               grouped: bool = False) -> int:
    barriers = (2 * 8 + (TILE_INFO_BYTES if grouped else 0)) * stages  # full + empty mbarrier (+ tile slot) per stage
    return stages * stage_bytes(kind, block_m, block_n) + epilogue_bytes + barriers + SMEM_SLACK


def most_stages(smem_of, most: int = MAX_STAGES) -> int:
    """The deepest pipeline, from `most` down to 2 stages, whose shared memory `smem_of(stages)` fits
    one CTA (2 when none does: the caller's tile is then too large for any pipeline)."""
    s = most
    while s > 2 and smem_of(s) > SMEM_CAPACITY:
        s -= 1
    return s


def warp_specialized_threads(block_m: int) -> int:
    """Threads of a warp-specialized sm_90 CTA: one math warpgroup per 64 rows + one TMA producer warpgroup."""
    return 128 * (block_m // 64 + 1)


def max_stages(kind: str, block_m: int, block_n: int, epilogue_bytes: int = 0, grouped: bool = False) -> int:
    return most_stages(lambda s: smem_bytes(kind, block_m, block_n, s, epilogue_bytes, grouped))


def tile_cost(block_m: int, block_n: int, overlap: bool = False) -> float:
    """Relative time of one tile (per unit of K) in the heuristic's cost model. Widths other than 128
    and 256 pay ODD_WIDTH_PENALTY: measured on the H200 (docs/benchmarks/deepgemm_h200.json,
    "variants"), 128-wide fp8 tiles beat 144/160/192-wide ones even in more waves. An fp8 tile with
    overlapped promotion (`overlap`) costs OVERLAP_COST of the same tile without it."""
    penalty = 1.0 if block_n in (128, 256) else ODD_WIDTH_PENALTY
    return (block_m + TILE_OVERHEAD_M) * (block_n + TILE_OVERHEAD_N) * penalty * (OVERLAP_COST if overlap else 1.0)


def waves(num_tiles: int, num_sms: int) -> tuple[int, int]:
    """(waves, CTAs busy in the last wave) for `num_tiles` tiles on `num_sms` persistent CTAs."""
    w = max(1, ceil_div(num_tiles, num_sms))
    return w, num_tiles - (w - 1) * num_sms


def pick_config(
    kind: str,
    m: int,
    n: int,
    k: int,
    num_groups: int = 1,
    grouping: str = "normal",
    num_sms: int | None = None,
    tma_store: bool = False,
    max_multicast: int = 1,
    overlap: bool = True,
    staged_store: int = 0,
    c_tma: bool = False,
) -> GemmConfig:
    """Choose the kernel configuration for D[M, N] (per group) = A[M, K] @ B[N, K]^T.

    `grouping` is "normal", "contiguous" (m = M_sum over all groups, tiles never straddle
    experts) or "masked" (m = expected rows per group, num_groups groups). `overlap=False` keeps
    every fp8 tile on the serial promotion path (for A/B timing). `c_tma` (bf16, normal grouping, with
    `tma_store`): the C_TMA epilogue, whose staging tile holds a whole bf16 C tile.
    """
    if kind not in ("fp8", "bf16"):
        raise ArgumentError(f"kind: expected 'fp8' or 'bf16', got {kind!r}")
    if grouping not in ("normal", "contiguous", "masked"):
        raise ArgumentError(f"grouping: expected 'normal', 'contiguous' or 'masked', got {grouping!r}")
    if tma_store and staged_store:
        raise ArgumentError("staged_store: expected 0 with tma_store=True (one staging tile per epilogue)")
    if c_tma and not (tma_store and kind == "bf16" and grouping == "normal"):
        raise ArgumentError(f"c_tma: expected a bf16 normal GEMM with tma_store=True, got kind={kind!r}, "
                            f"grouping={grouping!r}, tma_store={tma_store}")
    return _pick(kind, m, n, k, num_groups, grouping, num_sms or get_num_sms(), tma_store, max_multicast, overlap,
                 staged_store, c_tma)


@functools.lru_cache(maxsize=4096)  # called on every launch: keep the host path short
def _pick(kind: str, m: int, n: int, k: int, num_groups: int, grouping: str, sms: int, tma_store: bool,
          max_multicast: int, overlap: bool, staged_store: int = 0, c_tma: bool = False) -> GemmConfig:
    if grouping == "contiguous":
        block_ms: tuple[int, ...] = (128,)  # the layout's alignment: one expert per M block
    elif m <= 64:
        block_ms = (64,)
    else:
        block_ms = (128,)  # two math warpgroups: one promotes while the other's wgmma runs
    groups = num_groups if grouping == "masked" else 1

    best = None
    for bm in block_ms:
        for bn in block_n_candidates(kind, grouping):
            if staged_store and smem_bytes(kind, bm, bn, MIN_STAGED_STAGES, epilogue_bytes(bm, bn, False, staged_store),
                                           grouping != "normal") > SMEM_CAPACITY:
                continue  # the staging tile would leave too short a ring (fp32 tiles of 256 columns)
            if c_tma and smem_bytes(kind, bm, bn, MIN_STAGED_STAGES, epilogue_bytes(bm, bn, True, 0, True)) > SMEM_CAPACITY:
                continue
            tiles = ceil_div(m, bm) * ceil_div(n, bn) * groups
            w, util = waves(tiles, sms)
            key = (w * tile_cost(bm, bn, overlap and overlaps(kind, bn, grouping)), -util, -(bm * bn), -bm)
            if best is None or key < best[0]:
                best = (key, bm, bn, w, util)
    _, bm, bn, w, util = best
    block_k = 128 if kind == "fp8" else 64
    epilogue = epilogue_bytes(bm, bn, tma_store, staged_store, c_tma)
    multicast, on_a = pick_multicast(grouping, m, n, bm, bn, sms, max_multicast)
    return GemmConfig(kind=kind, block_m=bm, block_n=bn, block_k=block_k,
                      stages=max_stages(kind, bm, bn, epilogue, grouping != "normal"), multicast=multicast, num_waves=w,
                      last_wave_util=util, num_sms=sms, tma_store=tma_store, multicast_on_a=on_a,
                      allow_overlap=overlap, grouping=grouping, staged_store=staged_store, c_tma=c_tma)


def with_tile(cfg: GemmConfig, m: int, n: int, block_m: int, block_n: int) -> GemmConfig:
    """`cfg` (a dense GEMM's, D[M, N]) with a BLOCK_M x BLOCK_N tile: the deepest ring that fits next to its
    epilogue, and its waves. ArgumentError for a grouped config or where no ring of 2 stages fits."""
    if cfg.grouping != "normal":
        raise ArgumentError(f"with_tile: expected a dense (grouping='normal') config, got grouping={cfg.grouping!r}")
    if block_m % 64 or not 8 <= block_n <= 256 or block_n % 8:
        raise ArgumentError(f"with_tile: expected BLOCK_M a multiple of 64 and BLOCK_N a multiple of 8 in 8..256, got "
                            f"{block_m} x {block_n}")
    w, util = waves(ceil_div(m, block_m) * ceil_div(n, block_n), cfg.num_sms)
    out = dataclasses.replace(cfg, block_m=block_m, block_n=block_n, stages=2, num_waves=w, last_wave_util=util)
    out = dataclasses.replace(out, stages=max_stages(cfg.kind, block_m, block_n, out.epilogue_bytes))
    if out.smem_bytes > SMEM_CAPACITY:
        raise ArgumentError(f"with_tile: {block_m} x {block_n} needs {out.smem_bytes} bytes of shared memory with 2 "
                            f"stages, more than {SMEM_CAPACITY}")
    return out


# Measured exceptions to the cost model's tile for dense bf16 GEMMs with the TMA-store epilogue (with or without a
# C_TMA C): (max M, max K, the model's tile (BLOCK_M, BLOCK_N), its waves, the tile to take), the first that matches
# wins. The model prices main-loop waves only; where the main loop is short (K <= 512: 8 K blocks) and the plan one
# wave, every CTA loads its C tile and stores its D tile at the same moment and nothing overlaps them; two tiles per
# CTA overlap the first tile's store (and the second's C load) with the second's main loop.
# ((128, 512, (128, 256), 1, (128, 128))): 128 x 32768 x 512, H200 session 29 dg18 r1 (docs/benchmarks/
# gpu_runs_2026-12-02_s29/dg18_r1/sweep.log, cuBLAS in the same run): with C = D (C_TMA) 22.1 -> 20.5 us (graph
# 22.1 -> 20.7; cuBLAS addmm_ 20.1), without C 18.7 -> 17.6 us (graph 18.7 -> 17.8; cuBLAS 18.1); 128 x 64 / 128 x 96
# / 64 x 256 were slower than 128 x 128 there. M <= 64 plans 64-row tiles and is not covered.
TILE_RULES: tuple[tuple[int, int, tuple[int, int], int, tuple[int, int]], ...] = (
    (128, 512, (128, 256), 1, (128, 128)),
)


def tile_rule(cfg: GemmConfig, m: int, n: int, k: int) -> GemmConfig:
    """`cfg` (the heuristic's plan for a dense bf16 D[M, N] with the TMA-store epilogue, K) with the tile of the first
    TILE_RULES entry it falls under (M <= max M, K <= max K, the model's tile and waves), else unchanged; the choice
    is logged at DEBUG (once per plan: memoized, it runs on every launch). Other configs (fp8, grouped, staged /
    direct epilogues) are returned as they are."""
    return _tile_rule(cfg, m, n, k, TILE_RULES)


@functools.lru_cache(maxsize=4096)
def _tile_rule(cfg: GemmConfig, m: int, n: int, k: int, rules: tuple) -> GemmConfig:
    if cfg.kind != "bf16" or cfg.grouping != "normal" or not cfg.tma_store or cfg.swiglu:
        return cfg
    for max_m, max_k, tile, waves_, (bm, bn) in rules:
        if m <= max_m and k <= max_k and (cfg.block_m, cfg.block_n) == tile and cfg.num_waves == waves_:
            out = with_tile(cfg, m, n, bm, bn)
            log.debug("bf16 %dx%dx%d%s: %dx%d tiles (measured rule: M <= %d, K <= %d, %dx%d in %d wave) instead of "
                      "%dx%d", m, n, k, " C_TMA" if cfg.c_tma else "", bm, bn, max_m, max_k, *tile, waves_,
                      cfg.block_m, cfg.block_n)
            return out
    return cfg


SWIGLU_BLOCK_N = 128  # tile of the SwiGLU epilogue: 64 gate + 64 up columns (deepgemm.SWIGLU_INTERLEAVE = 64)


def swiglu_config(cfg: GemmConfig, m: int, n: int) -> GemmConfig:
    """`cfg` turned into the SwiGLU-epilogue kernel's: SWIGLU_BLOCK_N-wide tiles (the weight interleave's
    granularity fixes the width), the deepest ring that fits next to the half-width staging tile."""
    if not cfg.tma_store:
        raise ArgumentError("swiglu_config: expected a TMA-store config (the SwiGLU epilogue stages bf16 tiles)")
    bn = SWIGLU_BLOCK_N
    w, util = waves(ceil_div(m, cfg.block_m) * ceil_div(n, bn), cfg.num_sms)
    # tile_info=False: the SwiGLU kernel keeps the schedule its H200 figures were measured with (s26 R1/R2); the
    # producer-fed schedule + overlapped promotion compiles spill-free for it but has not run on the GPU yet.
    return dataclasses.replace(cfg, block_n=bn, swiglu=True, num_waves=w, last_wave_util=util, multicast=1,
                               multicast_on_a=False, tile_info=False,
                               stages=max_stages(cfg.kind, cfg.block_m, bn, epilogue_bytes(cfg.block_m, bn // 2, True),
                                                 grouped=True))


def expert_raster_config(cfg: GemmConfig, band: int = 0) -> GemmConfig:
    """`cfg` (contiguous) with the expert-major raster (kernels/gemm_sm90.cuh DEEPGEMM_EXPERT_RASTER): the
    producer-fed tile schedule, the m-blocks of one expert walked together in bands of `band` n-units (0: the
    whole row), and a ring shortened if the expert table would not fit next to it. Opt-in: not GPU-timed yet."""
    if cfg.grouping != "contiguous":
        raise ArgumentError(f"expert_raster_config: expected a contiguous config, got grouping={cfg.grouping!r}")
    if band < 0:
        raise ArgumentError(f"band: expected >= 0 n-units per band (0: the whole row), got {band}")
    out = dataclasses.replace(cfg, tile_info=True, expert_raster=True, expert_band=band)
    while out.smem_bytes > SMEM_CAPACITY and out.stages > 2:
        out = dataclasses.replace(out, stages=out.stages - 1)
    return out
