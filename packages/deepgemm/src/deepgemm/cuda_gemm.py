"""Host side of the sm_90a kernels: pick a config, JIT-compile the instantiation, build TMA descriptors, launch.

Every kernel is specialized on (N, K, block sizes, stages, grouping, number of groups, output
dtype, whether C is added); M stays a runtime argument so MoE batches of any size share a kernel.
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
from tilehal import ArgumentError, ShapeError
from tilehal.tma import encode_tiled

from . import gemv, plans, splitk, validate
from .heuristics import (
    EXPERT_TABLE_BLOCKS,
    GemmConfig,
    epilogue_passes,
    expert_raster_config,
    pick_config,
    swiglu_config,
    tile_rule,
)
from .utils import (
    ceil_div,
    degenerate_gemm,
    get_mn_major_tma_aligned_tensor,
    get_num_sms,
    get_tma_aligned_size,
    is_mn_major_tma_aligned,
)

log = logging.getLogger("deepgemm")

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
KIND_IDS = {"normal": 0, "contiguous": 1, "masked": 2}
_NULL_DESC = bytes(128)  # stands in for the unused activation-scale descriptor of bf16 kernels
OPTIONS = ("-std=c++17", "-lineinfo")


@dataclass(frozen=True)
class KernelKey:
    """Everything a kernel instantiation is specialized on."""

    n: int
    k: int
    block_m: int
    block_n: int
    stages: int
    grouping: str
    num_groups: int
    fp8: bool
    out_bf16: bool
    has_c: bool
    tma_store: bool = False
    d_swizzle: int = 0  # bytes per row of the epilogue's swizzled TMA-store boxes (0: plain rows)
    multicast: int = 1  # CTAs per cluster sharing one operand tile
    multicast_on_a: bool = False
    overlap_promotion: bool = False  # fp8: two partial-sum sets, promotion overlaps the next wgmma
    bias: bool = False  # `c` holds an fp32 bias [N], added in the TMA-store epilogue
    c_bf16: bool = False  # `c` is bf16 (bf16 accumulation), read in place by the staged copy-out epilogue
    swiglu: bool = False  # epilogue writes silu(gate) * up (B interleaved in blocks of BLOCK_N / 2)
    tile_info: bool = False  # grouped: producer-fed tile schedule (-DDEEPGEMM_TILE_INFO=1; not in the name)
    expert_raster: bool = False  # contiguous: expert-major raster (-DDEEPGEMM_EXPERT_RASTER=1; not in the name)
    expert_band: int = 0  # its n-units per band (-DDEEPGEMM_EXPERT_BAND; 0: the whole row)
    c_tma: bool = False  # bf16 C TMA-loaded into the staging tile, added in registers, TMA-stored (C_TMA)

    @property
    def expression(self) -> str:
        out = "__nv_bfloat16" if self.out_bf16 else "float"

        def b(x: bool) -> str:
            return "true" if x else "false"

        return (f"deepgemm::gemm_sm90<{self.n}, {self.k}, {self.block_m}, {self.block_n}, {self.stages}, "
                f"{KIND_IDS[self.grouping]}, {self.num_groups}, {b(self.fp8)}, {out}, {b(self.has_c)}, "
                f"{b(self.tma_store)}, {self.d_swizzle}, {self.multicast}, {b(self.multicast_on_a)}, "
                f"{b(self.overlap_promotion)}{self._tail()}>")

    def _tail(self) -> str:
        # The defaulted template parameters (BIAS, C_BF16, SWIGLU, C_TMA): spelled only up to the last one set, so
        # every other kernel keeps its name.
        flags = [self.bias, self.c_bf16, self.swiglu, self.c_tma]
        while flags and not flags[-1]:
            flags.pop()
        return "".join(", true" if f else ", false" for f in flags)


def kernel_source() -> str:
    # Inlined (not #included) so that the compile cache key covers the kernel's own text.
    return (KERNEL_DIR / "gemm_sm90.cuh").read_text()


def kernel_options(key: KernelKey) -> tuple[str, ...]:
    """The -D switches of kernels/gemm_sm90.cuh that `key` compiles with (the parts of the key not in its name)."""
    opts = ("-DDEEPGEMM_TILE_INFO=1",) if key.tile_info else ()
    if key.expert_raster:
        opts += ("-DDEEPGEMM_EXPERT_RASTER=1", f"-DDEEPGEMM_EXPERT_BAND={key.expert_band}")
    return opts


def compile_kernel(key: KernelKey, extra_options: tuple[str, ...] = ()) -> tilehal.CudaModule:
    """NVRTC-compile one instantiation for sm_90a (no GPU needed; cached on disk by content)."""
    return tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_gemm_sm90",
                                options=OPTIONS + kernel_options(key) + extra_options, name_expressions=[key.expression])


@functools.lru_cache(maxsize=256)
def _kernel(key: KernelKey, extra_options: tuple[str, ...] = ()) -> tilehal.Kernel:
    return compile_kernel(key, extra_options).get_kernel(key.expression)


def kernel_key(cfg: GemmConfig, n: int, k: int, grouping: str, num_groups: int, out_dtype: torch.dtype,
               has_c: bool, bias: bool = False, c_bf16: bool = False) -> KernelKey:
    return KernelKey(n=n, k=k, block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.stages, grouping=grouping,
                     num_groups=num_groups, fp8=cfg.kind == "fp8", out_bf16=out_dtype == torch.bfloat16,
                     has_c=has_c, tma_store=cfg.tma_store, d_swizzle=cfg.d_swizzle, multicast=cfg.multicast,
                     multicast_on_a=cfg.multicast_on_a, overlap_promotion=cfg.overlap_promotion, bias=bias,
                     c_bf16=c_bf16, swiglu=cfg.swiglu, tile_info=cfg.use_tile_info,
                     expert_raster=cfg.expert_raster and grouping == "contiguous", expert_band=cfg.expert_band,
                     c_tma=cfg.c_tma)


def use_tma_store(d: torch.Tensor, n: int, has_c: bool, grouping: str) -> bool:
    """The TMA-store epilogue writes whole (clipped) bf16 tiles; say why when it cannot be used."""
    why = None
    if os.environ.get("DEEPGEMM_EPILOGUE", "tma") == "direct":
        why = "DEEPGEMM_EPILOGUE=direct"
    elif d.dtype != torch.bfloat16:
        why = f"output dtype {d.dtype} (staging tile sized for bf16)"
    elif has_c:
        why = "C is accumulated"
    elif grouping == "masked" and not masked_tma_store():
        why = "masked groups must not write rows past masked_m (DEEPGEMM_MASKED_EPILOGUE=tma: TMA store for whole blocks)"
    elif n % 8:
        why = f"N = {n} is not a multiple of 8 (TMA needs 16-byte rows)"
    if why:
        log.debug("no TMA-store epilogue: %s", why)
    return why is None


def masked_tma_store() -> bool:
    """DEEPGEMM_MASKED_EPILOGUE=tma (opt-in, not GPU-timed yet): the masked kernels write m-blocks wholly inside
    masked_m by TMA store and copy a group's last, partial block out of the same staging tile row by row (default
    `staged`: every block through the staged copy-out)."""
    return os.environ.get("DEEPGEMM_MASKED_EPILOGUE", "staged") == "tma"


def staged_store(d_dtype: torch.dtype, n: int, has_c: bool, tma_store: bool) -> int:
    """Without the TMA store: bytes per element of the staged copy-out tile (4 when C is added or D is fp32,
    else 2), or 0 for stores straight from the accumulators (N not a multiple of the 16-byte segment)."""
    if tma_store:
        return 0
    vec = 16 // (4 if d_dtype == torch.float32 else 2)
    if os.environ.get("DEEPGEMM_EPILOGUE", "tma") == "direct" or n % vec:
        log.debug("direct-store epilogue: %s", "DEEPGEMM_EPILOGUE=direct" if n % vec == 0 else
                  f"N = {n} is not a multiple of {vec} (16-byte row segments)")
        return 0
    return 4 if has_c or d_dtype == torch.float32 else 2


def c_epilogue_tma() -> bool:
    """Whether a bf16 C added to a bf16 D on the persistent kernel goes through the C_TMA epilogue (C TMA-loaded into
    the staging tile while the main loop runs, added in registers, TMA-stored; kernels/gemm_sm90.cuh) instead of the
    staged fp32 copy-out. DEEPGEMM_C_EPILOGUE: "tma" (default since session 28: on the H200 M = 4096 C = D rows went
    0.77-0.97x -> 0.85-1.06x cuBLAS, geo-mean 0.84x -> 0.93x; M = 128 7168x2048 17.8 -> 16.5 us, the other rows
    within 2 %; docs/benchmarks/gpu_runs_2026-12-02_s28/) or "staged"."""
    mode = os.environ.get("DEEPGEMM_C_EPILOGUE", "tma")
    if mode not in ("tma", "staged"):
        raise ArgumentError(f"DEEPGEMM_C_EPILOGUE: expected 'tma' or 'staged', got {mode!r}")
    return mode == "tma"


def c_tma_why_not(d: torch.Tensor, c: torch.Tensor | None, n: int, fp8: bool) -> str | None:
    """Why the C_TMA epilogue cannot serve this call (None: it can)."""
    if c is None:
        return "no C"
    if fp8:
        return "fp8 (the C descriptor uses the activation-scale slot)"
    if c.dtype != torch.bfloat16 or d.dtype != torch.bfloat16:
        return f"C {c.dtype} / D {d.dtype} (expected bf16 / bf16)"
    if n % 8:
        return f"N = {n} is not a multiple of 8 (TMA needs 16-byte rows)"
    if os.environ.get("DEEPGEMM_EPILOGUE", "tma") == "direct":
        return "DEEPGEMM_EPILOGUE=direct"
    return None


def epilogue(d: torch.Tensor, n: int, has_c: bool, grouping: str) -> dict:
    """pick_config's epilogue keywords for this output."""
    tma = use_tma_store(d, n, has_c, grouping)
    return {"tma_store": tma, "staged_store": staged_store(d.dtype, n, has_c, tma)}


_DESC_CACHE: collections.OrderedDict = collections.OrderedDict()


def _encode(ptr: int, dtype: torch.dtype, shape: tuple, strides: tuple, box: tuple, swizzle: str) -> bytes:
    # A descriptor depends only on these values, so repeated calls on the same buffers reuse it.
    key = (ptr, dtype, shape, strides, box, swizzle)
    hit = _DESC_CACHE.get(key)
    if hit is None:
        hit = encode_tiled(ptr, dtype, shape, strides, box, swizzle=swizzle)
        _DESC_CACHE[key] = hit
        if len(_DESC_CACHE) > 4096:
            _DESC_CACHE.popitem(last=False)
    plans.note_encode(hit, key)
    return hit


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _sfa_layout(sfa: torch.Tensor) -> torch.Tensor:
    if is_mn_major_tma_aligned(sfa):
        return sfa
    log.debug("sfa %s with strides %s is not MN-major/TMA-aligned; transposing it (pass "
              "get_mn_major_tma_aligned_tensor(sfa) to skip this copy)", tuple(sfa.shape), sfa.stride())
    return get_mn_major_tma_aligned_tensor(sfa)


def _descriptors(a2d: torch.Tensor, b2d: torch.Tensor, sfa_t: torch.Tensor | None, cfg: GemmConfig,
                 sfa_rows: int, sfa_cols: int) -> tuple[bytes, bytes, bytes]:
    """TMA descriptors: A [rows, K] and B [rows, K] in 128-byte swizzled boxes; activation scales
    as a [sfa_rows, sfa_cols] fp32 matrix (rows = (group x) K blocks, cols = M) read BLOCK_M at a time."""
    box_k = cfg.block_k
    # With multicast each CTA of a cluster loads half of the shared operand's tile.
    box_m = cfg.block_m // (2 if cfg.multicast > 1 and cfg.multicast_on_a else 1)
    box_n = cfg.block_n // (2 if cfg.multicast > 1 and not cfg.multicast_on_a else 1)
    da = _encode(a2d.data_ptr(), a2d.dtype, tuple(a2d.shape), tuple(a2d.stride()), (box_m, box_k), "128B")
    db = _encode(b2d.data_ptr(), b2d.dtype, tuple(b2d.shape), tuple(b2d.stride()), (box_n, box_k), "128B")
    if sfa_t is None:
        return da, db, _NULL_DESC
    ld = get_tma_aligned_size(sfa_cols, 4)
    dsf = _encode(sfa_t.data_ptr(), torch.float32, (sfa_rows, sfa_cols), (ld, 1), (1, cfg.block_m), "none")
    return da, db, dsf


def _d_descriptor(d2d: torch.Tensor, cfg: GemmConfig) -> bytes:
    """The TMA-store descriptor of D (with cfg.c_tma also C's: the same boxes are loaded into the staging tile)."""
    if not cfg.tma_store:
        return _NULL_DESC
    sw = cfg.d_swizzle
    box_n = sw // d2d.element_size() if sw else cfg.out_block_n // epilogue_passes(cfg.out_block_n, cfg.c_tma)
    return _encode(d2d.data_ptr(), d2d.dtype, tuple(d2d.shape), tuple(d2d.stride()), (cfg.block_m, box_n),
                   f"{sw}B" if sw else "none")


def _check_cuda(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None) -> None:
    validate.cuda_operand(a, "a")
    validate.cuda_operand(b, "b")
    validate.cuda_output(d, "d")
    if c is not None:
        validate.cuda_output(c, "c")
    if b.dim() == 3 and not b.is_contiguous():
        raise ShapeError(f"b: expected a contiguous [G, N, K] tensor on CUDA, got strides {tuple(b.stride())}")
    if a.dim() == 3 and not a.is_contiguous():
        raise ShapeError(f"a: expected a contiguous [G, M_max, K] tensor on CUDA, got strides {tuple(a.stride())}")
    _capability_check(a.device)


def _capability_check(device: torch.device) -> None:
    cap = _capability(device.index)
    if cap[0] != 9:
        raise tilehal.DeviceError(f"deepgemm CUDA kernels: expected an sm_90 (Hopper) GPU, got sm_{cap[0]}{cap[1]}")


def grid_size(cfg: GemmConfig, tiles: int) -> int:
    """Persistent CTAs: at most one per SM and per tile, a whole number of clusters."""
    mc = cfg.multicast
    return max(mc, min(cfg.num_sms, ceil_div(tiles, mc) * mc) // mc * mc)


_CLUSTER_CAP: dict[tuple, int] = {}


def resident_cluster_ctas(kern, cfg: GemmConfig) -> int | None:
    """CTAs of `cfg.multicast`-wide clusters of `kern` that the driver can keep resident at once
    (cuOccupancyMaxActiveClusters x cluster size; None where it cannot say). A persistent grid of more clusters
    than that runs its last clusters only after others have finished their whole share of tiles: with 132 SMs
    in GPCs of uneven size, 66 two-CTA clusters of a 227 KiB-smem kernel need not all fit."""
    key = (id(kern), cfg.num_threads, cfg.smem_bytes, cfg.multicast)  # kernels live in _kernel's cache
    hit = _CLUSTER_CAP.get(key)
    if hit is None:
        try:
            hit = kern.max_active_clusters(cfg.num_threads, cfg.smem_bytes, (cfg.multicast, 1, 1)) * cfg.multicast
        except (AttributeError, tilehal.TileStackError) as e:
            log.debug("cluster occupancy unknown (%s): the grid is not capped", e)
            hit = 0
        _CLUSTER_CAP[key] = hit
    return hit or None


def _launch(key: KernelKey, cfg: GemmConfig, tiles: int, descs, d_desc, sfb, d, c, group_info, shape_m: int,
            extra_options: tuple[str, ...] = ()) -> None:
    kern = _kernel(key, extra_options) if extra_options else _kernel(key)
    if cfg.kind == "fp8" and not cfg.overlap_promotion and log.isEnabledFor(logging.DEBUG):
        log.debug("fp8 promotion not overlapped with the next wgmma: %s",
                  "DEEPGEMM_FP8_OVERLAP=0" if not cfg.allow_overlap else
                  f"BLOCK_N = {cfg.block_n} (a second partial-sum set would not fit in registers)")
    grid, args = grid_size(cfg, tiles), [descs[0], descs[1], descs[2], d_desc, sfb, d, c, group_info, shape_m]
    cluster = (cfg.multicast, 1, 1) if cfg.multicast > 1 else None
    if cluster is not None:
        cap = resident_cluster_ctas(kern, cfg)
        if cap is not None and cap < grid:
            log.debug("multicast grid %d -> %d CTAs (clusters resident at once)", grid, cap)
            grid = max(cfg.multicast, cap)
    kern.launch(grid, cfg.num_threads, args, smem_bytes=cfg.smem_bytes, cluster=cluster)
    plans.note_launch(kern, grid, cfg.num_threads, args, cfg.smem_bytes, cluster)


def max_multicast() -> int:
    """DEEPGEMM_MULTICAST=2 allows 2-CTA multicast (off by default: it measured slower on the H200)."""
    return 2 if os.environ.get("DEEPGEMM_MULTICAST", "1") == "2" else 1


def overlap_allowed() -> bool:
    """DEEPGEMM_FP8_OVERLAP=0 keeps every fp8 kernel on the serial promotion path (for A/B timing)."""
    return os.environ.get("DEEPGEMM_FP8_OVERLAP", "1") != "0"


def bf16_c_on_tiles() -> bool:
    """DEEPGEMM_BF16_C=tile sends every bf16-C call to the tile kernel (the path before the persistent kernel
    read a bf16 C in place; for A/B timing)."""
    return os.environ.get("DEEPGEMM_BF16_C", "in_place") == "tile"


def mn_major_in_place() -> bool:
    """DEEPGEMM_MN_MAJOR=copy copies MN-major bf16 operands K-major for the persistent kernel (A/B timing)."""
    return os.environ.get("DEEPGEMM_MN_MAJOR", "in_place") != "copy"


def _check_cuda_outputs(a: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None) -> None:
    validate.cuda_output(d, "d")
    if c is not None:
        validate.cuda_output(c, "c")
    _capability_check(a.device)


def splitk_allowed() -> bool:
    """DEEPGEMM_SPLITK=0 keeps small-M bf16 and fp8 GEMMs on the persistent kernel (for A/B timing)."""
    return os.environ.get("DEEPGEMM_SPLITK", "1") != "0"


def dense(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor | None,
          d: torch.Tensor, c: torch.Tensor | None, config: GemmConfig | None = None,
          bias: torch.Tensor | None = None) -> None:
    """a [M, K], b [N, K] K-major; sfa/sfb None for bf16. `config` overrides the heuristic (the
    benchmark's variant sweep uses it to time the candidates the heuristic did not pick); a
    `splitk.SplitKConfig` forces the split-K / tile kernel. `bias` (fp32 [N], contiguous) is added in
    the TMA-store epilogue (bf16 d, no C: the caller checks); calls with a bias stay on the persistent
    kernel. bf16 operands may be MN-major (a [M, K] with strides (1, lda), b likewise): they are read in
    place by the split-K / tile kernel, never copied, unless TMA cannot address them (stride not 16-byte
    aligned) or DEEPGEMM_MN_MAJOR=copy (logged at DEBUG). A bf16 C is read in place by that kernel too."""
    if (sfa is None and bias is None and (splitk.is_mn_major(a) or splitk.is_mn_major(b))
            and not isinstance(config, GemmConfig)):
        if mn_major_in_place() and splitk.in_place_ok(a, "a") and splitk.in_place_ok(b, "b"):
            _check_cuda_outputs(a, d, c)
            for x, name in ((a, "a"), (b, "b")):
                if not splitk.is_mn_major(x):
                    validate.cuda_operand(x, name)
            m, k = a.shape
            n = b.shape[0]
            if degenerate_gemm(m, n, k, d, c):
                return
            cfg = config or splitk.pick_tiles(m, n, k, get_num_sms(), has_c=c is not None)
            if cfg.multicast > 1 and splitk.is_mn_major(a):
                log.debug("split-K: no A multicast for an MN-major A (multicast shares K-major A tiles)")
                cfg = dataclasses.replace(cfg, multicast=1)
            log.debug("bf16 %dx%dx%d: MN-major %s read in place (%dx%d tiles, %d splits)", m, n, k,
                      "+".join(x for x, t in (("a", a), ("b", b)) if splitk.is_mn_major(t)), cfg.block_m,
                      cfg.block_n, cfg.splits)
            splitk.dense_bf16(a, b, d, c, cfg)
            return
        if not mn_major_in_place():
            log.debug("MN-major bf16 operands copied K-major: DEEPGEMM_MN_MAJOR=copy")
    if sfa is None and (a.stride(-1) != 1 or b.stride(-1) != 1):
        log.debug("bf16 operand(s) with strides a %s / b %s copied K-major for the persistent kernel",
                  a.stride(), b.stride())
        a = a if a.stride(-1) == 1 else a.contiguous()
        b = b if b.stride(-1) == 1 else b.contiguous()
    _check_cuda(a, b, d, c)
    m, k = a.shape
    n = b.shape[0]
    if degenerate_gemm(m, n, k, d, c):
        if bias is not None and k == 0 and m and n:
            d += bias
        return
    fp8 = sfa is not None
    if not fp8 and bias is None and config is None and m == 1:
        why = gemv.why_not(a, b, d, c) if gemv.allowed() else "DEEPGEMM_GEMV is off"
        if why is None:
            gemv.gemv_bf16(a, b, d, c, get_num_sms())
            return
        log.debug("bf16 1x%dx%d: no GEMV kernel (%s)", n, k, why)
    if not fp8 and bias is None and (isinstance(config, splitk.SplitKConfig)
                                     or (config is None and splitk_allowed())):
        # Small M: too few output tiles for the SMs; split K instead (None when not clearly faster).
        sk = config if config is not None else splitk.pick_splitk(m, n, k, get_num_sms(), has_c=c is not None)
        if (sk is None and config is None and c is not None and c.dtype == torch.bfloat16
                and (bf16_c_on_tiles() or not (d.dtype == torch.bfloat16 and staged_store(d.dtype, n, True, False)))):
            # bf16 accumulation where the persistent kernel's staged epilogue cannot read the bf16 C (N not a
            # multiple of 8, or DEEPGEMM_BF16_C=tile): the tile kernel reads it in place (widening C to fp32
            # would cost an extra pass).
            sk = splitk.pick_tiles(m, n, k, get_num_sms(), has_c=True)
            log.debug("bf16 %dx%dx%d with a bf16 C (%s): tile kernel (reads C as bf16)", m, n, k,
                      "DEEPGEMM_BF16_C=tile" if bf16_c_on_tiles() else "N % 8 != 0")
        if sk is not None:
            log.debug("bf16 %dx%dx%d: split-K kernel, %dx%d tiles, %d splits", m, n, k, sk.block_m, sk.block_n,
                      sk.splits)
            splitk.dense_bf16(a, b, d, c, sk)
            return
    elif not fp8 and config is None and bias is None:
        log.debug("split-K not used: DEEPGEMM_SPLITK=0")
    if fp8 and bias is None and (isinstance(config, splitk.SplitKConfig) or (config is None and splitk_allowed())):
        # Small M with few output tiles: split K over the SMs (None when the persistent kernel is expected as fast).
        sk = config if config is not None else splitk.pick_splitk(m, n, k, get_num_sms(), "fp8")
        if sk is not None:
            log.debug("fp8 %dx%dx%d: split-K kernel, %dx%d tiles, %d splits", m, n, k, sk.block_m, sk.block_n,
                      sk.splits)
            splitk.dense_fp8(a, _sfa_layout(sfa), b, sfb.contiguous(), d, c, sk)
            return
    elif fp8 and config is None and bias is None:
        log.debug("fp8 split-K not used: DEEPGEMM_SPLITK=0")
    if config is None and c is not None and c_epilogue_tma():
        why = c_tma_why_not(d, c, n, fp8)
        if why is None:
            config = tile_rule(pick_config("bf16", m, n, k, tma_store=True, c_tma=True, max_multicast=max_multicast()),
                               m, n, k)
        else:
            log.debug("C_TMA not used for %dx%dx%d: %s", m, n, k, why)
    if getattr(config, "c_tma", False):
        why = c_tma_why_not(d, c, n, fp8) or (None if config.tma_store else "config.tma_store is False")
        if why is not None:
            raise ShapeError(f"config.c_tma: expected a bf16 C and D with N % 8 == 0 and tma_store, got {why}")
    cfg = config or pick_config("fp8" if fp8 else "bf16", m, n, k, **epilogue(d, n, c is not None, "normal"),
                                max_multicast=max_multicast(), overlap=overlap_allowed())
    if config is None and bias is None:
        cfg = tile_rule(cfg, m, n, k)  # measured tile exceptions (bf16 TMA-store plans only)
    # bf16 accumulation into a bf16 D: the staged copy-out epilogue reads the bf16 C in place (C_BF16).
    c_bf16 = (c is not None and c.dtype == torch.bfloat16 and d.dtype == torch.bfloat16 and not cfg.tma_store
              and cfg.d_swizzle == 1)
    if c_bf16:
        log.debug("bf16 %dx%dx%d with a bf16 C: persistent kernel, C read in place by the staged epilogue", m, n, k)
    if c is not None and c.dtype != torch.float32 and not c_bf16 and not cfg.c_tma:
        # The direct-store epilogue adds C in fp32 from an fp32 buffer: such a C is widened once.
        log.debug("c: %s accumulation without the staged epilogue; widening C to fp32", c.dtype)
        c = c.float()
    sfa_t = _sfa_layout(sfa) if fp8 else None
    sfb_c = sfb.contiguous() if fp8 else None
    descs = _descriptors(a, b, sfa_t, cfg, sfa_rows=sfa.shape[1] if fp8 else 0, sfa_cols=m)
    if cfg.c_tma:  # C's descriptor (D's boxes and swizzle) in the activation-scale slot, unused by bf16 kernels
        descs = (descs[0], descs[1], _d_descriptor(c, cfg))
        log.debug("bf16 %dx%dx%d with a bf16 C: C_TMA epilogue (%dx%d tiles, %d stages)", m, n, k, cfg.block_m,
                  cfg.block_n, cfg.stages)
    if bias is not None and not cfg.tma_store:
        raise ShapeError("bias: expected the TMA-store epilogue (bf16 d, no C, N % 8 == 0); the caller adds it "
                         "otherwise")
    key = kernel_key(cfg, n, k, "normal", 1, d.dtype, c is not None, bias is not None, c_bf16)
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    _launch(key, cfg, tiles, descs, _d_descriptor(d, cfg), sfb_c, d, bias if bias is not None else c, None, m)


def grouped_contiguous(a, sfa, b, sfb, d, m_indices, config: GemmConfig | None = None,
                       extra_options: tuple[str, ...] = (), swiglu: bool = False) -> None:
    """m-grouped contiguous GEMM. `config` overrides the heuristic and `extra_options` are added to the kernel's
    NVRTC options (-D switches of kernels/gemm_sm90.cuh): the benchmarks' A/B of variants. `swiglu`: b holds
    gate|up rows interleaved in blocks of 64 (swiglu_interleave) and d [M, N/2] gets bf16(silu(gate) * up)."""
    if sfa is None and b.dim() == 3 and b.stride(-1) != 1:
        # bf16 B stored MN-major ([G, K, N] seen as [G, N, K]: DeepGEMM's SM90 bf16 grouped tests pass it to
        # the nt entry point): the grouped kernel reads K-major tiles, so B is copied once (logged).
        log.debug("b: MN-major bf16 B (strides %s) copied K-major for the contiguous grouped kernel", b.stride())
        b = b.contiguous()
    _check_cuda(a, b, d, None)
    m, k = a.shape
    g, n, _ = b.shape
    if m == 0 or n == 0:
        return
    fp8 = sfa is not None
    cfg = config or pick_config("fp8" if fp8 else "bf16", m, n, k, num_groups=g, grouping="contiguous",
                                **epilogue(d, n, False, "contiguous"), max_multicast=max_multicast(),
                                overlap=overlap_allowed())
    if swiglu and not cfg.swiglu:
        cfg = swiglu_config(cfg, m, n)
    elif config is None and fp8:
        cfg = grouped_schedule(cfg, m, n)
    cfg = check_expert_raster(cfg, m)
    sfa_t = _sfa_layout(sfa) if fp8 else None
    descs = _descriptors(a, b.view(g * n, k), sfa_t, cfg, sfa_rows=sfa.shape[1] if fp8 else 0, sfa_cols=m)
    key = kernel_key(cfg, n, k, "contiguous", g, d.dtype, False)
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    _launch(key, cfg, tiles, descs, _d_descriptor(d, cfg), sfb.contiguous() if fp8 else None,
            d, None, m_indices.contiguous(), m, extra_options)


def check_expert_raster(cfg: GemmConfig, m: int) -> GemmConfig:
    """A config with the expert-major raster must have the producer-fed schedule (else ArgumentError); an M
    beyond the kernel's expert table (EXPERT_TABLE_BLOCKS m-blocks) keeps the default raster (logged)."""
    if not cfg.expert_raster:
        return cfg
    if not cfg.use_tile_info:
        raise ArgumentError("config: expert_raster=True needs the producer-fed tile schedule (tile_info=True; "
                            "heuristics.expert_raster_config sets both)")
    if ceil_div(m, cfg.block_m) > EXPERT_TABLE_BLOCKS:
        log.debug("expert-major raster not used: %d m-blocks > the kernel's table of %d", ceil_div(m, cfg.block_m),
                  EXPERT_TABLE_BLOCKS)
        return dataclasses.replace(cfg, expert_raster=False)
    return cfg


def grouped_schedule(cfg: GemmConfig, m: int, n: int) -> GemmConfig:
    """DEEPGEMM_GROUPED_SCHEDULE (opt-in, fp8 contiguous, not GPU-timed yet): comma-separated tokens
    `expert` / `expert:<band>` (the expert-major raster, bands of <band> n-units, 0 or none: the whole row) and
    `mcast` (2-CTA A multicast with the producer-fed tile schedule, when the n-blocks pair up evenly). Unset or
    `default`: the heuristic's schedule. Unknown tokens raise ArgumentError."""
    raw = os.environ.get("DEEPGEMM_GROUPED_SCHEDULE", "")
    if raw in ("", "default"):
        return cfg
    for tok in (t.strip() for t in raw.split(",") if t.strip()):
        name, _, arg = tok.partition(":")
        if name == "mcast":
            if ceil_div(n, cfg.block_n) % 2 or cfg.num_sms % 2 or cfg.block_m % 16:
                log.debug("DEEPGEMM_GROUPED_SCHEDULE=mcast not used: %d n-blocks / %d SMs do not pair up",
                          ceil_div(n, cfg.block_n), cfg.num_sms)
                continue
            cfg = dataclasses.replace(cfg, multicast=2, multicast_on_a=True, tile_info=True)
        elif name == "expert" and (arg == "" or arg.isdigit()):
            cfg = expert_raster_config(cfg, int(arg or 0))
        else:
            raise ArgumentError(f"DEEPGEMM_GROUPED_SCHEDULE: expected comma-separated 'default', 'mcast', 'expert' or "
                                f"'expert:<band>', got {tok!r} in {raw!r}")
    return cfg


def grouped_masked(a, sfa, b, sfb, d, masked_m, expected_m: int, extra_options: tuple[str, ...] = (),
                   config: GemmConfig | None = None) -> None:
    _check_cuda(a, b, d, None)
    g, m_max, k = a.shape
    n = b.shape[1]
    if m_max == 0 or n == 0:
        return
    fp8 = sfa is not None
    cfg = config or pick_config("fp8" if fp8 else "bf16", min(expected_m, m_max), n, k, num_groups=g,
                                grouping="masked", **epilogue(d, n, False, "masked"), max_multicast=max_multicast(),
                                overlap=overlap_allowed())
    sfa_t = _sfa_layout(sfa) if fp8 else None
    sk = sfa.shape[2] if fp8 else 0
    descs = _descriptors(a.view(g * m_max, k), b.view(g * n, k), sfa_t, cfg, sfa_rows=g * sk, sfa_cols=m_max)
    key = kernel_key(cfg, n, k, "masked", g, d.dtype, False)
    upper = g * ceil_div(m_max, cfg.block_m) * ceil_div(n, cfg.block_n)  # tiles if every group were full
    d_desc = _d_descriptor(d.view(g * m_max, n), cfg) if cfg.tma_store else _NULL_DESC  # rows of every group
    _launch(key, cfg, upper, descs, d_desc, sfb.contiguous() if fp8 else None, d, None,
            masked_m.contiguous(), m_max, extra_options)
