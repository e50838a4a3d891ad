"""Host side of the FP4-weight kernel (kernels/fp4_gemm_sm90.cuh): config, workspace, launch.

The kernel is specialized on the token tile (8 x NT rows of A), the warp layout and the operand
kinds; M, N, K stay runtime arguments. Split-K partial tiles go through one fp32 workspace and a
per-tile arrival counter per device; the kernel leaves the counters at zero, so launches (and CUDA
graph replays) need no memset. The workspace and counters are never freed or moved once handed out
(a captured graph keeps pointing at them); launches on one device are assumed to be stream-ordered
(one stream at a time, as with cuBLAS's own workspace).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import tilehal
import torch
from tilehal import ShapeError

from . import validate
from .utils import ceil_div, get_num_sms

log = logging.getLogger("deepgemm")

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
OPTIONS = ("-std=c++17", "-lineinfo")
MIN_CHUNKS_PER_WARP = 2  # 128-wide K chunks: fewer and the register pipeline has nothing to overlap


@dataclass(frozen=True)
class Fp4Key:
    nt: int  # n8 tiles of tokens per CTA (tokens = 8 nt)
    mt: int  # m16 tiles of weight rows per warp
    wn: int  # warps along N
    wk: int  # warps along K
    act_fp8: bool
    gran: int
    out_bf16: bool
    has_c: bool
    masked: bool

    @property
    def expression(self) -> str:
        def b(x: bool) -> str:
            return "true" if x else "false"

        out = "__nv_bfloat16" if self.out_bf16 else "float"
        return (f"deepgemm::fp4::fp4_gemm_sm90<{self.nt}, {self.mt}, {self.wn}, {self.wk}, {b(self.act_fp8)}, "
                f"{self.gran}, {out}, {b(self.has_c)}, {b(self.masked)}>")

    @property
    def rows(self) -> int:
        return 16 * self.mt * self.wn

    @property
    def tokens(self) -> int:
        return 8 * self.nt

    @property
    def threads(self) -> int:
        return 32 * self.wn * self.wk

    @property
    def smem_bytes(self) -> int:
        return self.wk * self.tokens * self.rows * 4  # the partial tiles of the K-warps


@dataclass(frozen=True)
class Fp4Plan:
    key: Fp4Key
    m_blocks: int
    row_blocks: int
    splits: int
    chunks_per_split: int
    groups: int = 1

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.row_blocks, self.splits, self.m_blocks * self.groups

    @property
    def tiles(self) -> int:
        return self.row_blocks * self.m_blocks * self.groups

    @property
    def workspace_floats(self) -> int:
        return 0 if self.splits == 1 else self.tiles * self.splits * self.key.rows * self.key.tokens


MAX_TOKEN_TILES = 8  # 64 tokens per CTA: 16 n-tiles exceed the register file (spills) with this kernel


def token_tiles(m: int) -> int:
    """n8 tiles of tokens per CTA: the smallest power of two covering m, at most MAX_TOKEN_TILES."""
    nt = 1
    while nt < MAX_TOKEN_TILES and 8 * nt < m:
        nt *= 2
    return nt


def plan(m: int, n: int, k: int, groups: int, act_fp8: bool, gran: int, out_bf16: bool, has_c: bool, masked: bool,
         num_sms: int | None = None, expected_m: int | None = None) -> Fp4Plan:
    """Warp layout and split-K for one problem (m: tokens per group; expected_m: the masked hint)."""
    sms = num_sms or get_num_sms()
    nt = token_tiles(expected_m or m)
    # Few tokens: 4 x 2 warps (64 rows, two K-halves) keep many loads in flight per CTA; more tokens:
    # 8 warps along N so one CTA's activations serve 128 weight rows.
    wn, wk = (4, 2) if nt <= 2 else (8, 1)
    key = Fp4Key(nt=nt, mt=1, wn=wn, wk=wk, act_fp8=act_fp8, gran=gran, out_bf16=out_bf16, has_c=has_c,
                 masked=masked)
    m_blocks = ceil_div(m, key.tokens)
    row_blocks = ceil_div(n, key.rows)
    chunks = k // 128
    tiles = row_blocks * m_blocks * groups
    if masked and expected_m:
        tiles = row_blocks * ceil_div(expected_m, key.tokens) * groups
    # One wave: as many K splits as keep every CTA resident at once (a second, partial wave would cost
    # as much as the first), at least MIN_CHUNKS_PER_WARP chunks per warp.
    resident = (2 if nt <= 4 else 1) * sms  # the kernel's __launch_bounds__ minimum blocks per SM
    most = max(1, chunks // (wk * MIN_CHUNKS_PER_WARP))
    splits = max(1, min(resident // max(1, tiles), most))
    cps = ceil_div(chunks, splits)
    splits = ceil_div(chunks, cps)
    return Fp4Plan(key=key, m_blocks=m_blocks, row_blocks=row_blocks, splits=splits, chunks_per_split=cps,
                   groups=groups)


def kernel_source() -> str:
    return (KERNEL_DIR / "fp4_gemm_sm90.cuh").read_text()


def compile_kernel(key: Fp4Key, extra_options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC-compile one instantiation for sm_90a (no GPU needed; cached on disk by content)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_fp4_gemm_sm90",
                                options=OPTIONS + extra_options, name_expressions=[key.expression])


@functools.lru_cache(maxsize=128)
def _kernel(key: Fp4Key) -> tilehal.Kernel:
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
        # A larger set is a new allocation (zeroed); the old one stays alive for graphs that hold it.
        size = 1 << max(12, (tiles - 1).bit_length())
        if cur is not None:
            _RETIRED.append(cur)
        cur = _COUNTERS[device.index] = torch.zeros(size, dtype=torch.int32, device=device)
    return cur


def _check(a: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None) -> None:
    if a.stride(-1) != 1 or (a.dim() == 2 and a.stride(0) % 8) or (a.dim() == 3 and not a.is_contiguous()):
        raise ShapeError(f"a: expected unit stride along K and a row stride that is a multiple of 8 elements on CUDA "
                         f"(3-D: contiguous), got strides {tuple(a.stride())}")
    if a.data_ptr() % 16:
        raise ShapeError(f"a: expected a 16-byte aligned data pointer on CUDA, got {a.data_ptr():#x}")
    for t, name in ((b, "b"), (sfb, "sfb"), (d, "d")):
        validate.cuda_output(t, name)
    if c is not None:
        validate.cuda_output(c, "c")
    cap = torch.cuda.get_device_capability(a.device)
    if cap[0] != 9:
        raise tilehal.DeviceError(f"deepgemm FP4 kernel: expected an sm_90 (Hopper) GPU, got sm_{cap[0]}{cap[1]}")


def _launch(p: Fp4Plan, a, sfa, b, sfb, d, c, masked_m, m: int, n: int, k: int) -> None:
    ws = _workspace(a.device, p.workspace_floats)
    counters = _counters(a.device, p.tiles)
    if sfa is not None:
        sg = sfa.stride(0) if sfa.dim() == 3 else 0
        sm, sk = sfa.stride(-2), sfa.stride(-1)
    else:
        sg = sm = sk = 0
    lda = a.stride(-2)
    log.debug("fp4 gemm %dx%dx%d (groups %d): %s grid %s, %d chunks per split", m, n, k, p.groups, p.key.expression,
              p.grid, p.chunks_per_split)
    _kernel(p.key).launch(p.grid, p.key.threads,
                          [a, sfa, b, sfb, d, c, ws, counters, masked_m, m, n, k, lda, sg, sm, sk, p.m_blocks,
                           p.chunks_per_split],
                          smem_bytes=p.key.smem_bytes)


def dense(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, gran: int, d: torch.Tensor,
          c: torch.Tensor | None) -> None:
    """a [M, K] (e4m3 + sfa, or bf16), b packed [N, K/2], sfb fp32 [N, K/gran]; d = c + a @ W^T."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return
    sfb = sfb.contiguous()
    _check(a, b, sfb, d, c)
    if c is not None and c.dtype != torch.float32:
        log.debug("c: bf16 accumulation; widening C to fp32 for the FP4 kernel's epilogue")
        c = c.float()
    p = plan(m, n, k, 1, sfa is not None, gran, d.dtype == torch.bfloat16, c is not None, False)
    _launch(p, a, sfa, b, sfb, d, c, None, m, n, k)


def grouped_masked(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, gran: int,
                   d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    """a [G, M_max, K], b packed [G, N, K/2], sfb [G, N, K/gran], d [G, M_max, N]; rows past masked_m unwritten."""
    g, m_max, k = a.shape
    n = b.shape[1]
    if m_max == 0 or n == 0:
        return
    sfb = sfb.contiguous()
    _check(a, b, sfb, d, None)
    p = plan(m_max, n, k, g, sfa is not None, gran, d.dtype == torch.bfloat16, False, True,
             expected_m=min(expected_m, m_max))
    # Every (group, m-block) gets a grid slice; blocks past masked_m[g] return at once.
    p = Fp4Plan(key=p.key, m_blocks=ceil_div(m_max, p.key.tokens), row_blocks=p.row_blocks, splits=p.splits,
                chunks_per_split=p.chunks_per_split, groups=g)
    _launch(p, a, sfa, b, sfb, d, None, masked_m.contiguous(), m_max, n, k)
