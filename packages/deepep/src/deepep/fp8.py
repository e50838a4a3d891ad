"""fp8 e4m3 with one fp32 scale per 128 channels of a token (DeepEP/DeepGEMM's activation layout)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
GROUP = 128


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H % 128 == 0) -> (x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32).

    scale = amax(group) / 448, so x ~= x_fp8 * scale per group.
    """
    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ValueError(f"x: expected [T, H] with H % {GROUP} == 0, got shape {tuple(x.shape)}")
    t, h = x.shape
    g = x.float().view(t, h // GROUP, GROUP)
    amax = g.abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / FP8_MAX
    q = (g / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    return q.view(t, h), scales


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8` in float32 (works for any leading dims)."""
    h = x_fp8.shape[-1]
    g = x_fp8.float().unflatten(-1, (h // GROUP, GROUP))
    return (g * scales.unsqueeze(-1)).flatten(-2)
