"""Helpers around the fine-grained FP8 recipe: casts, scale layouts, SM count, alignment.

Scale factors (sf) are float32. Activations use 1x128 blocks (one scale per token and 128-wide
K block), weights 128x128 blocks. The CUDA kernels read activation scales through TMA, which
wants them MN-major (consecutive tokens adjacent) with a 16-byte aligned stride.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from tilehal import ArgumentError, ShapeError

from .sizes import (  # re-exported: deepgemm.utils.ceil_div etc. as before
    align,
    ceil_div,
    get_tma_aligned_size,
)

log = logging.getLogger("deepgemm")

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK_K = 128  # K granularity of every scale factor
_M_ALIGNMENT_CONTIGUOUS = 128
CONTIGUOUS_BLOCK_M = 128  # rows per block of the contiguous grouped kernel: one expert per block
_num_sms: int | None = None


def set_num_sms(num_sms: int) -> None:
    """Limit the persistent kernels to `num_sms` SMs (e.g. to leave SMs to communication kernels)."""
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ArgumentError(f"num_sms: expected a positive int, got {num_sms!r}")
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if num_sms > total:
            raise ArgumentError(f"num_sms: expected at most {total} (this device's SM count), got {num_sms}")
    global _num_sms
    _num_sms = num_sms


def get_num_sms() -> int:
    """SMs the kernels may use: set_num_sms's value, else the current device's count (132 without a GPU,
    the H200/H800 count, so CPU-side planning matches the common target)."""
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


def set_mk_alignment_for_contiguous_layout(alignment: int) -> None:
    """Set the row (m-grouped) / K (k-grouped) alignment of the contiguous grouped layouts (DeepGEMM's setter).

    The sm_90a kernels use 128-row blocks, one expert per block, so on CUDA the alignment must be a
    multiple of 128 (checked when a grouped GEMM runs on a GPU); the CPU reference takes any positive value.
    """
    if not isinstance(alignment, int) or alignment < 1:
        raise ArgumentError(f"alignment: expected a positive int, got {alignment!r}")
    global _M_ALIGNMENT_CONTIGUOUS
    _M_ALIGNMENT_CONTIGUOUS = alignment


def get_mk_alignment_for_contiguous_layout() -> int:
    """Each group's rows (m-grouped) or K slice (k-grouped) start at a multiple of this (default 128)."""
    return _M_ALIGNMENT_CONTIGUOUS


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m: int | None = None) -> int:
    """The alignment the kernels are built for: 128 on sm_90 (DeepGEMM returns 128 there too; only its
    SM100 kernels shrink it with `expected_m`)."""
    if expected_m is not None and (not isinstance(expected_m, int) or expected_m < 0):
        raise ArgumentError(f"expected_m: expected a non-negative int or None, got {expected_m!r}")
    return CONTIGUOUS_BLOCK_M


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


def degenerate_gemm(m: int, n: int, k: int, d: torch.Tensor, c: torch.Tensor | None) -> bool:
    """Answer the shapes no kernel runs for: an empty D (M or N = 0) is left as it is, K = 0 gives
    D = C (or 0). True when the call is answered, so the caller returns."""
    if m == 0 or n == 0:
        return True
    if k == 0:
        d.copy_(c if c is not None else torch.zeros_like(d))
        return True
    return False


def _check_2d_or_3d(x: Any, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ShapeError(f"{name}: expected 2 or 3 dimensions, got {x.dim()} (shape {tuple(x.shape)})")


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to the next power of two (the UE8M0 format: exponent only)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ShapeError(f"x: expected a floating torch tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).ne(0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def _check_ue8m0(x: torch.Tensor, name: str) -> None:
    bits = x.view(torch.int32)
    if x.dtype != torch.float32 or bool((bits < 0).any()) or bool((bits & 0x7FFFFF).any()):
        raise ShapeError(f"{name}: expected non-negative float32 powers of two (UE8M0 values), got other values")


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """Pack float32 powers of two [..., K] (K % 4 == 0) into int32 [..., K / 4], 4 exponent bytes per word."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] % 4:
        raise ShapeError(f"x: expected a tensor whose last dimension is a multiple of 4, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    _check_ue8m0(x, "x")
    return (x.view(torch.int32) >> 23).to(torch.uint8).view(torch.int32)


def unpack_ue8m0_from_int(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_ue8m0_to_int: int32 [..., K / 4] -> float32 [..., K] powers of two."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise ShapeError(f"packed: expected an int32 tensor, got "
                         f"{packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__}")
    dense = packed.clone(memory_format=torch.contiguous_format)  # fresh strides, even for size-1 dims
    return (dense.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with Inf and NaN as 0: a block's scale comes from its finite values only, so one Inf or NaN does not
    turn the whole block into NaN (it stays at its own position, see _to_e4m3)."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Round to e4m3, saturating: +-Inf become +-448 (the largest e4m3 magnitude at the block's scale), NaN
    stays NaN; e4m3fn has no Inf, and an unsaturated cast would turn values past 448 into NaN."""
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _scale(amax: torch.Tensor, use_ue8m0: bool, top: float = FP8_MAX) -> torch.Tensor:
    if not isinstance(use_ue8m0, bool):
        raise ArgumentError(f"use_ue8m0: expected a bool, got {use_ue8m0!r}")
    sf = amax / top
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK_K,
                          use_packed_ue8m0: bool = False, tma_aligned_sf: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., M, K] per token and `gran_k`-wide K block: (x_fp8 [..., M, K], sf [..., M, ceil(K/gran_k)]).

    sf = amax / 448 (amax of the block's finite values, clamped to 1e-4 so all-zero blocks stay finite),
    rounded up to a power of two with `use_ue8m0`; x ~= x_fp8 * sf. An Inf is stored as +-448 (the
    block's largest magnitude) and a NaN as NaN, each at its own position: the rest of the block is
    quantized as if they were not there. `use_packed_ue8m0` returns sf packed four per int32 (DeepGEMM's
    SM100 layout; needs ceil(K/gran_k) % 4 == 0).
    `tma_aligned_sf` (2-D x) returns sf already in the layout the CUDA kernels read
    (get_mn_major_tma_aligned_tensor's), so fp8_gemm_nt skips that copy. On CUDA tensors one fused
    kernel does it all (deepgemm/kernels/fp8_cast.cuh, same values).
    """
    _check_2d_or_3d(x, "x")
    _check_gran(gran_k)
    if tma_aligned_sf and (use_packed_ue8m0 or x.dim() != 2):
        raise ShapeError(f"tma_aligned_sf: expected a 2-D x with float32 scales, got {x.dim()} dimensions"
                         + (" and use_packed_ue8m0" if use_packed_ue8m0 else ""))
    if x.is_cuda and not use_packed_ue8m0:
        from . import cuda_cast

        fused = cuda_cast.per_token(x, gran_k, use_ue8m0, tma_aligned_sf)
        if fused is not None:
            return fused
    elif x.is_cuda:
        log.debug("per_token_cast_to_fp8: torch ops instead of the fused kernel (use_packed_ue8m0)")
    *lead, m, k = x.shape
    sk = ceil_div(k, gran_k)
    xf = x.float()
    if k % gran_k:
        xf = torch.nn.functional.pad(xf, (0, sk * gran_k - k))
    blocks = xf.view(*lead, m, sk, gran_k)
    sf = _scale(_finite_abs(blocks).amax(dim=-1).clamp(min=1e-4), use_ue8m0)
    q = _to_e4m3(blocks * (1.0 / sf.unsqueeze(-1))).view(*lead, m, sk * gran_k)[..., :k]
    sf = sf.contiguous()
    if tma_aligned_sf:
        return q.contiguous(), get_mn_major_tma_aligned_tensor(sf)
    return q.contiguous(), pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf


def _silu_mul_checked(x: Any) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[-1] % 2:
        raise ShapeError(f"x: expected a 2-D tensor [M, 2 * F] (gate | up), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation for x = [gate | up] ([M, 2F]): bf16 silu(gate) * up (fp32 math), [M, F].

    On CUDA tensors one fused kernel (kernels/fp8_cast.cuh); else torch ops."""
    _silu_mul_checked(x)
    if x.is_cuda:
        from . import cuda_cast

        fused = cuda_cast.silu_mul(x, fp8=False)
        if fused is not None:
            return fused
    f = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[:, :f].float()) * x[:, f:].float()).to(torch.bfloat16)


def silu_mul_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, tma_aligned_sf: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_cast_to_fp8(silu(gate) * up) for x = [gate | up] ([M, 2F]), the fp32 product never
    stored: one fused kernel on CUDA (the MoE experts' step between their GEMMs), torch ops elsewhere."""
    _silu_mul_checked(x)
    if x.is_cuda:
        from . import cuda_cast

        fused = cuda_cast.silu_mul(x, fp8=True, ue8m0=use_ue8m0, mn_major_sf=tma_aligned_sf)
        if fused is not None:
            return fused
    f = x.shape[-1] // 2
    return per_token_cast_to_fp8(torch.nn.functional.silu(x[:, :f].float()) * x[:, f:].float(), use_ue8m0=use_ue8m0,
                                 tma_aligned_sf=tma_aligned_sf)


def per_channel_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False,
                            gran_k: int = BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [K, N] per channel and `gran_k`-tall K block (K % gran_k == 0): (x_fp8 [K, N], sf [K/gran_k, N]).

    The layout of MN-major operands of the weight-gradient (1D1D) GEMMs.
    """
    _check_gran(gran_k)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] % gran_k:
        raise ShapeError(f"x: expected a 2-D tensor whose first dimension is a multiple of {gran_k}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    k, n = x.shape
    blocks = x.float().view(k // gran_k, gran_k, n)
    sf = _scale(_finite_abs(blocks).amax(dim=1).clamp(min=1e-4), use_ue8m0)
    return _to_e4m3(blocks * (1.0 / sf.unsqueeze(1))).view(k, n), sf


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False,
                          gran_k: int = BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] per gran_k x gran_k block: (x_fp8 [..., N, K], sf [..., ceil(N/gran_k), ceil(K/gran_k)]).

    On CUDA tensors (gran_k 128) one fused kernel does it (deepgemm/kernels/fp8_cast.cuh, same values)."""
    _check_2d_or_3d(x, "x")
    _check_gran(gran_k)
    if x.is_cuda:
        if gran_k == BLOCK_K:
            from . import cuda_cast

            fused = cuda_cast.per_block(x, use_ue8m0)
            if fused is not None:
                return fused
        else:
            log.debug("per_block_cast_to_fp8: torch ops instead of the fused kernel (gran_k = %d)", gran_k)
    *lead, n, k = x.shape
    sn, sk = ceil_div(n, gran_k), ceil_div(k, gran_k)
    xf = torch.nn.functional.pad(x.float(), (0, sk * gran_k - k, 0, sn * gran_k - n))
    blocks = xf.view(*lead, sn, gran_k, sk, gran_k)
    sf = _scale(_finite_abs(blocks).amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4), use_ue8m0)
    q = _to_e4m3(blocks * (1.0 / sf)).view(*lead, sn * gran_k, sk * gran_k)[..., :n, :k]
    return q.contiguous(), sf.view(*lead, sn, sk).contiguous()


def per_custom_dims_cast_to_fp8(x: torch.Tensor, dims: tuple[int, ...],
                                use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per index of the kept `dims` (amax over every other dimension): (x_fp8, sf squeezed)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.numel() == 0:
        raise ShapeError(f"x: expected a non-empty torch tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                      and -x.dim() <= d < x.dim() for d in dims):
        raise ArgumentError(f"dims: expected a tuple of dimensions of x (ndim {x.dim()}), got {dims!r}")
    keep = {d % x.dim() for d in dims}
    reduce = tuple(i for i in range(x.dim()) if i not in keep)
    sf = _scale(_finite_abs(x.float()).amax(dim=reduce, keepdim=True).clamp(min=1e-4), use_ue8m0)
    return _to_e4m3(x * (1.0 / sf)), sf.squeeze()


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code 0..7


def per_token_cast_to_fp4(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK_K,
                          use_packed_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [M, K] (K even) to e2m1 codes packed two per int8 byte (low nibble first), sf = amax / 6.

    FP4 operands are an SM100 format of DeepGEMM: the casts exist here (for data preparation and
    tests); deepgemm's GEMMs reject int8-packed FP4 operands with a ShapeError.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % 2:
        raise ShapeError(f"x: expected a 2-D tensor with an even last dimension, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if use_packed_ue8m0 and not use_ue8m0:
        raise ArgumentError("use_packed_ue8m0: expected use_ue8m0=True with it, got use_ue8m0=False")
    _check_gran(gran_k)
    m, k = x.shape
    sk = ceil_div(k, gran_k)
    xf = torch.nn.functional.pad(x.float(), (0, sk * gran_k - k)).view(m, sk, gran_k)
    sf = _scale(_finite_abs(xf).amax(dim=2).clamp(min=1e-4), use_ue8m0, top=6.0)  # Inf -> +-6 * sf, NaN -> 0
    scaled = xf * (1.0 / sf.unsqueeze(2))
    mag = scaled.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for lo, hi in zip(FP4_VALUES, FP4_VALUES[1:]):  # round to nearest: count midpoints passed
        code += (mag > (lo + hi) / 2).to(torch.uint8)
    code |= ((scaled < 0) & (code != 0)).to(torch.uint8) << 3
    code = code.view(m, sk * gran_k)[:, :k]
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8).contiguous()
    if use_packed_ue8m0:
        if sk % 4:
            sf = torch.nn.functional.pad(sf, (0, align(sk, 4) - sk), value=1.0)  # 2^0: covers nothing
        return packed, pack_ue8m0_to_int(sf.contiguous())
    return packed, sf.contiguous()


def _fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    u = packed.view(torch.uint8)
    codes = torch.empty((*u.shape[:-1], u.shape[-1] * 2), dtype=torch.uint8, device=u.device)
    codes[..., 0::2], codes[..., 1::2] = u & 0x0F, u >> 4
    return codes


def transpose_packed_fp4(a: torch.Tensor) -> torch.Tensor:
    """Transpose packed FP4 [M, K/2] (M even) into packed [K, M/2]."""
    if not isinstance(a, torch.Tensor) or a.dtype != torch.int8 or a.dim() != 2 or a.shape[0] % 2:
        raise ShapeError("a: expected a 2-D int8 tensor of packed FP4 with an even number of rows")
    codes = _fp4_codes(a).T.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8).contiguous()


def cast_back_from_fp4(packed: torch.Tensor, sf: torch.Tensor, gran_k: int = BLOCK_K,
                       use_packed_ue8m0: bool = False) -> torch.Tensor:
    """Dequantize packed FP4 [M, K/2] with sf [M, ceil(K/gran_k)] (or packed UE8M0) to float32 [M, K]."""
    if use_packed_ue8m0:
        sf = unpack_ue8m0_from_int(sf)
    codes = _fp4_codes(packed).to(torch.int64)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    val = table[codes & 7]
    val = torch.where((codes & 8).bool(), -val, val)
    k = val.shape[-1]
    return val * sf[:, torch.arange(k, device=packed.device) // gran_k]


def _check_gran(gran_k: int) -> None:
    if not isinstance(gran_k, int) or isinstance(gran_k, bool) or not 1 <= gran_k <= 1 << 16:
        raise ArgumentError(f"gran_k: expected an int in [1, 65536], got {gran_k!r}")


def is_mn_major_tma_aligned(sf: torch.Tensor) -> bool:
    """True when sf [..., MN, SK] already has the layout the kernels read (MN-major, the MN stride
    padded to 16 bytes, also for SK == 1)."""
    if sf.dim() < 2 or sf.dtype not in (torch.float32, torch.int32):
        return False
    mn, sk = sf.shape[-2], sf.shape[-1]
    aligned = get_tma_aligned_size(mn, 4)
    if sf.stride(-2) != 1 or sf.stride(-1) != aligned:
        return False
    if sf.dim() == 3 and sf.shape[0] > 1 and sf.stride(0) != aligned * sk:
        return False
    return sf.data_ptr() % 16 == 0


def _mn_major_copy(s: torch.Tensor) -> torch.Tensor:
    """s [G, MN, SK] copied into storage [G, SK, aligned MN], viewed back as [G, MN, SK]."""
    g, mn, sk = s.shape
    aligned = get_tma_aligned_size(mn, 4)
    storage = torch.zeros((g, sk, aligned), dtype=s.dtype, device=s.device)
    storage[:, :, :mn] = s.transpose(1, 2)
    return storage[:, :, :mn].transpose(1, 2)


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """Return sf [..., MN, SK] (same values and shape) stored MN-major with the MN stride padded to 16 bytes:
    strides (1, tma_aligned_mn) (and (tma_aligned_mn * SK, 1, tma_aligned_mn) with groups), as DeepGEMM.

    This is the layout the CUDA kernels read activation scales in; a tensor already in it is returned as is.
    """
    _check_2d_or_3d(sf, "sf")
    if sf.dtype != torch.float32:
        raise ShapeError(f"sf: expected dtype float32, got {sf.dtype}")
    if is_mn_major_tma_aligned(sf):
        return sf
    out = _mn_major_copy(sf.unsqueeze(0) if sf.dim() == 2 else sf)
    return out[0] if sf.dim() == 2 else out


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor) -> torch.Tensor:
    """fp32 UE8M0 scales [(G,) MN, SK] -> int32 [(G,) MN, ceil(SK/4)], four exponent bytes per word (K padded
    with zero bytes), stored MN-major with a TMA-aligned MN stride (DeepGEMM's SM100 scale layout)."""
    _check_2d_or_3d(sf, "sf")
    if sf.dtype != torch.float32:
        raise ShapeError(f"sf: expected dtype float32, got {sf.dtype}")
    s = sf.unsqueeze(0) if sf.dim() == 2 else sf
    _check_ue8m0(s.contiguous(), "sf")
    g, mn, sk = s.shape
    exps = torch.zeros((g, mn, align(sk, 4)), dtype=torch.uint8, device=sf.device)
    exps[:, :, :sk] = (s.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    out = _mn_major_copy(exps.view(torch.int32))
    return out[0] if sf.dim() == 2 else out


def get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(
    sf: torch.Tensor, grouped_layout: torch.Tensor, ks_cpu: list[int] | None, gran_k: int = BLOCK_K,
    k_alignment: int | None = None, use_psum_layout: bool = False,
) -> torch.Tensor:
    """Per-channel fp32 UE8M0 scales of a k-grouped operand, sf [sum(ceil(K_g/gran_k)), MN], packed per group:
    group g's rows become ceil(K_g / (4 gran_k)) int32 rows [., MN] (four K blocks per word), concatenated."""
    if use_psum_layout:
        raise ShapeError("use_psum_layout: expected False (the psum k-grouped layout is SM100-only in DeepGEMM and "
                         "not provided by deepgemm), got True")
    if not isinstance(sf, torch.Tensor) or sf.dim() != 2 or sf.dtype != torch.float32:
        raise ShapeError("sf: expected a 2-D float32 tensor [sum of K blocks, MN]")
    if not ks_cpu:
        raise ShapeError(f"ks_cpu: expected the list of per-group K sizes, got {ks_cpu!r}")
    _check_gran(gran_k)
    blocks = [ceil_div(k, gran_k) for k in ks_cpu]
    if sum(blocks) != sf.shape[0]:
        raise ShapeError(f"sf: expected {sum(blocks)} rows (K blocks of ks_cpu), got {sf.shape[0]}")
    outs = []
    for part in sf.split(blocks):
        outs.append(get_mn_major_tma_aligned_packed_ue8m0_tensor(part.T).T)
    return torch.cat(outs) if outs else sf.new_empty((0, sf.shape[1]), dtype=torch.int32)


def transform_sf_into_required_layout(
    sf: torch.Tensor,
    mn: int,
    k: int,
    recipe: tuple[int, ...] = (1, 128, 128),
    num_groups: int | None = None,
    is_sfa: bool | None = True,
    disable_ue8m0_cast: bool = False,
    psum_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check a scale tensor against its operand's size and return it in the layout the sm_90a kernels read.

    `recipe` is (gran_m, gran_n, gran_k) with `is_sfa` choosing gran_m or gran_n, or (gran_mn, gran_k)
    (DeepGEMM's recipe_a / recipe_b form). Per-row scales (gran_mn = 1): [(G,) mn, ceil(k/gran_k)] ->
    MN-major, TMA-aligned; 128x128 blocks: [(G,) ceil(mn/128), ceil(k/128)] -> contiguous. fp32 scales
    are never cast to UE8M0 on sm_90 (disable_ue8m0_cast has nothing to disable).
    """
    r = tuple(recipe)
    if len(r) == 3:
        if is_sfa is None:
            raise ArgumentError("is_sfa: expected True or False with a 3-element recipe, got None")
        gran_mn, gran_k = (r[0] if is_sfa else r[1]), r[2]
    elif len(r) == 2:
        gran_mn, gran_k = r
    else:
        raise ArgumentError(f"recipe: expected (gran_m, gran_n, gran_k) or (gran_mn, gran_k), got {r}")
    if (gran_mn, gran_k) not in ((1, 128), (128, 128)):
        raise ArgumentError(f"recipe: expected 1x128 or 128x128 scale blocks on sm_90, got {gran_mn}x{gran_k} "
                         f"(from recipe {r})")
    if psum_layout is not None:
        raise ShapeError("psum_layout: expected None (the packed psum scale layout is DeepGEMM's SM100 format)")
    name = "sfa" if is_sfa or is_sfa is None and gran_mn == 1 else "sfb"
    expected = (ceil_div(mn, gran_mn), ceil_div(k, gran_k))
    if num_groups is not None:
        expected = (num_groups, *expected)
    if not isinstance(sf, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(sf).__name__}")
    if tuple(sf.shape) != expected:
        raise ShapeError(f"{name}: expected shape {expected}, got {tuple(sf.shape)}")
    if sf.dtype != torch.float32:
        raise ShapeError(f"{name}: expected dtype float32, got {sf.dtype}")
    if gran_mn == 1:
        return get_mn_major_tma_aligned_tensor(sf)
    return sf.contiguous()
