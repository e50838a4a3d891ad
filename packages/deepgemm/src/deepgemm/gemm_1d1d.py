"""Host side of the (1, 1, 128) fp8 kernel (kernels/gemm_1d1d_sm90.cuh): 1x128 scales on both operands,
DeepGEMM's weight-gradient recipe, for dense GEMMs and k-grouped (MoE weight-gradient) GEMMs on sm_90a.

M and K are runtime arguments of the kernel, so the groups of a k-grouped GEMM (one launch each, K_g
and the group's first scale row passed in) share one compiled kernel per (N, tile, output dtype).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import tilehal
import torch

from .heuristics import SMEM_SLACK, most_stages, tile_cost, warp_specialized_threads, waves
from .utils import (
    ceil_div,
    degenerate_gemm,
    get_mn_major_tma_aligned_tensor,
    get_num_sms,
    get_tma_aligned_size,
)

log = logging.getLogger("deepgemm")

KERNEL_NAME = "gemm_1d1d_sm90.cuh"
OPTIONS = ("-std=c++17", "-lineinfo")
BLOCK_K = 128
MAX_STAGES = 8
# Multiples of 32, so every stage's scale vector (BLOCK_N fp32) starts 128-byte aligned for TMA; the
# math threads hold two BLOCK_N / 2 register sets (partial + total), which stops at 192.
BLOCK_N_CANDIDATES = (64, 96, 128, 160, 192)


@dataclass(frozen=True)
class Config1D1D:
    block_m: int
    block_n: int
    stages: int
    num_sms: int

    @property
    def num_threads(self) -> int:
        return warp_specialized_threads(self.block_m)

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.block_m, self.block_n, self.stages)


def smem_bytes(block_m: int, block_n: int, stages: int) -> int:
    return stages * ((block_m + block_n) * 128 + (block_m + block_n) * 4) + 2 * 8 * stages + SMEM_SLACK


def max_stages(block_m: int, block_n: int) -> int:
    return most_stages(lambda s: smem_bytes(block_m, block_n, s), MAX_STAGES)


@functools.lru_cache(maxsize=1024)
def pick_1d1d(m: int, n: int, num_sms: int) -> Config1D1D:
    """Tile for D[M, N]: BLOCK_M 64 (M <= 64) or 128; BLOCK_N by the persistent heuristic's
    waves x tile-cost model; then as many stages as fit."""
    bm = 64 if m <= 64 else 128
    best = None
    for bn in BLOCK_N_CANDIDATES:
        w, util = waves(ceil_div(m, bm) * ceil_div(n, bn), num_sms)
        key = (w * tile_cost(bm, bn), -util, -bn)
        if best is None or key < best[0]:
            best = (key, bn)
    return Config1D1D(block_m=bm, block_n=best[1], stages=max_stages(bm, best[1]), num_sms=num_sms)


@dataclass(frozen=True)
class Key1D1D:
    n: int
    block_m: int
    block_n: int
    stages: int
    out_bf16: bool
    has_c: bool

    @property
    def expression(self) -> str:
        out = "__nv_bfloat16" if self.out_bf16 else "float"
        return (f"deepgemm::gemm_1d1d_sm90<{self.n}, {self.block_m}, {self.block_n}, {self.stages}, {out}, "
                f"{'true' if self.has_c else 'false'}>")


def key_1d1d(cfg: Config1D1D, n: int, out_dtype: torch.dtype, has_c: bool) -> Key1D1D:
    return Key1D1D(n=n, block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.stages,
                   out_bf16=out_dtype == torch.bfloat16, has_c=has_c)


def kernel_source() -> str:
    from .cuda_gemm import KERNEL_DIR

    return (KERNEL_DIR / KERNEL_NAME).read_text()


def compile_kernels(keys, extra_options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC-compile 1D1D instantiations for sm_90a (no GPU needed; cached on disk by content)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_gemm_1d1d_sm90",
                                options=OPTIONS + tuple(extra_options), name_expressions=[k.expression for k in keys])


@functools.lru_cache(maxsize=256)
def _kernel(key: Key1D1D) -> tilehal.Kernel:
    return compile_kernels([key]).get_kernel(key.expression)


def _sf_descriptor(sf_mn_major: torch.Tensor, rows_sk: int, cols_mn: int, box: int) -> bytes:
    """sf viewed as the [SK, MN] fp32 matrix it is stored as (MN contiguous, TMA-aligned stride)."""
    from .cuda_gemm import _encode

    ld = get_tma_aligned_size(cols_mn, 4)
    return _encode(sf_mn_major.data_ptr(), torch.float32, (rows_sk, cols_mn), (ld, 1), (1, box), "none")


def _launch(a2d, b2d, dsfa: bytes, dsfb: bytes, d2d, c2d, sf_k_offset: int, cfg: Config1D1D) -> None:
    from .cuda_gemm import _encode

    m, k = a2d.shape
    n = b2d.shape[0]
    key = key_1d1d(cfg, n, d2d.dtype, c2d is not None)
    da = _encode(a2d.data_ptr(), a2d.dtype, tuple(a2d.shape), tuple(a2d.stride()), (cfg.block_m, BLOCK_K), "128B")
    db = _encode(b2d.data_ptr(), b2d.dtype, tuple(b2d.shape), tuple(b2d.stride()), (cfg.block_n, BLOCK_K), "128B")
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    _kernel(key).launch(min(cfg.num_sms, tiles), cfg.num_threads, [da, db, dsfa, dsfb, d2d, c2d, m, k, sf_k_offset],
                        smem_bytes=cfg.smem_bytes)


def _mn_major(sf: torch.Tensor, name: str) -> torch.Tensor:
    from .utils import is_mn_major_tma_aligned

    if not is_mn_major_tma_aligned(sf):
        log.debug("%s %s with strides %s is not MN-major/TMA-aligned; transposing it (pass "
                  "get_mn_major_tma_aligned_tensor(%s) to skip this copy)", name, tuple(sf.shape), sf.stride(), name)
    return get_mn_major_tma_aligned_tensor(sf)


def dense(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor,
          c: torch.Tensor | None) -> None:
    """a [M, K], b [N, K] e4m3 K-major (checked by the caller); sfa [M, SK], sfb [N, SK] fp32; d [M, N]
    bf16/fp32 contiguous; c fp32 [M, N] or None."""
    m, k = a.shape
    n = b.shape[0]
    if degenerate_gemm(m, n, k, d, c):
        return
    cfg = pick_1d1d(m, n, get_num_sms())
    sk = ceil_div(k, BLOCK_K)
    # Both MN-major copies must stay referenced until the launch: a descriptor holds only the address,
    # and a freed copy's memory would be handed to the next allocation (the other copy).
    sfa_t, sfb_t = _mn_major(sfa, "sfa"), _mn_major(sfb, "sfb")
    dsfa = _sf_descriptor(sfa_t, sk, m, cfg.block_m)
    dsfb = _sf_descriptor(sfb_t, sk, n, cfg.block_n)
    _launch(a, b, dsfa, dsfb, d, c, 0, cfg)


def k_grouped(groups, sfa: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> None:
    """groups: [(A_g [M, K_g], B_g [N, K_g], first scale row)], sfa [M, sum SK_g], sfb [N, sum SK_g] fp32;
    d, c fp32 [G, M, N] contiguous (c may be d). One launch per non-empty group, one compiled kernel."""
    g, m, n = d.shape
    total_sk = sfa.shape[1]
    cfg = pick_1d1d(m, n, get_num_sms())
    sfa_t, sfb_t = _mn_major(sfa, "sfa"), _mn_major(sfb, "sfb")
    dsfa = _sf_descriptor(sfa_t, total_sk, m, cfg.block_m)
    dsfb = _sf_descriptor(sfb_t, total_sk, n, cfg.block_n)
    for i, (ag, bg, sf_off) in enumerate(groups):
        if ag.shape[1] == 0:
            if d.data_ptr() != c.data_ptr():
                d[i].copy_(c[i])
            continue
        _launch(ag, bg, dsfa, dsfb, d[i], c[i], sf_off, cfg)
