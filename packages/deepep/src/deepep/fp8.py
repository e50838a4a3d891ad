"""fp8 e4m3 with one fp32 scale per 128 channels of a token (DeepEP/DeepGEMM's activation layout)."""

from __future__ import annotations

import torch
from tilehal import ShapeError

FP8_MAX = 448.0
GROUP = 128


def _ceil_pow2(sf: torch.Tensor) -> torch.Tensor:
    """Round positive scales up to a power of two (UE8M0-representable)."""
    bits = sf.float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).ne(0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H % 128 == 0) -> (x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32).

    scale = amax(group) / 448 (rounded up to a power of two with `round_scale`), so x ~= x_fp8 * scale.
    """
    from .checks import flag, tensor

    tensor(x, "x")
    flag(round_scale, "round_scale")
    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ShapeError(f"x: expected [T, H] with H % {GROUP} == 0, got shape {tuple(x.shape)}")
    t, h = x.shape
    g = x.float().view(t, h // GROUP, GROUP)
    amax = g.abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / FP8_MAX
    if round_scale:
        scales = _ceil_pow2(scales)
    q = (g / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    return q.view(t, h), scales


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales [..., G] (G % 4 == 0) -> int32 [..., G / 4], four exponent bytes per word."""
    if scales.shape[-1] % 4:
        raise ValueError(f"scales: expected a last dimension divisible by 4, got {tuple(scales.shape)}")
    return (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8).view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., G / 4] of UE8M0 exponent bytes -> fp32 [..., G]."""
    dense = packed.clone(memory_format=torch.contiguous_format)  # fresh strides, even for size-1 dims
    return (dense.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8`: bf16 like DeepEP's (any leading dims). `scales` may also be
    packed UE8M0 (int32, four per word) as low-latency dispatch returns with use_ue8m0=True."""
    from .checks import tensor

    tensor(x_fp8, "x_fp8")
    tensor(scales, "scales", dtypes=(torch.float32, torch.int32))
    h = x_fp8.shape[-1]
    groups = -(-h // GROUP) // (4 if scales.dtype == torch.int32 else 1)
    if x_fp8.dim() < 1 or h % GROUP or tuple(scales.shape) != (*x_fp8.shape[:-1], groups):
        raise ShapeError(f"scales: expected shape {(*x_fp8.shape[:-1], groups)} for x_fp8 of shape "
                         f"{tuple(x_fp8.shape)} (H % {GROUP} == 0; int32: UE8M0 packed four per word), got "
                         f"{tuple(scales.shape)}")
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    g = x_fp8.float().unflatten(-1, (h // GROUP, GROUP))
    return (g * scales.float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
