"""Numeric helpers with DeepEP's names: calc_diff, fp8 casts, inplace_unique, hash_tensor."""

from __future__ import annotations

import torch

from ..fp8 import per_token_cast_back as _cast_back
from ..fp8 import per_token_cast_to_fp8 as _cast_to

__all__ = ["align", "calc_diff", "ceil_div", "hash_tensor", "hash_tensors", "inplace_unique", "per_token_cast_back",
           "per_token_cast_to_fp8", "safe_div"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity gap of x + 1 and y + 1 (float64): 1 - 2 sum(ab) / sum(a^2 + b^2)."""
    a, b = x.double() + 1, y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def safe_div(a: float, b: float) -> float:
    """a / b, and 0 for 0 / 0."""
    if b == 0:
        if a == 0:
            return 0
        raise ZeroDivisionError(f"safe_div: {a} / 0")
    return a / b


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (fp8 [T, H], fp32 scales [T, ceil(H/128)]); H need not be a multiple of 128 (zero padded)."""
    t, h = x.shape
    pad = align(h, 128) - h
    q, s = _cast_to(torch.nn.functional.pad(x, (0, pad)) if pad else x)
    return (q[:, :h].contiguous() if pad else q), s


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """Inverse of per_token_cast_to_fp8 as bf16 (scales fp32, or packed UE8M0 int32)."""
    h = x_fp8.shape[-1]
    pad = align(h, 128) - h
    if pad:
        x_fp8 = torch.nn.functional.pad(x_fp8.view(torch.uint8), (0, pad)).view(torch.float8_e4m3fn)
    out = _cast_back(x_fp8, x_scales.contiguous().view(*x_fp8.shape[:-1], -1))
    return out[..., :h].contiguous() if pad else out


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Per row, keep each value in [0, num_slots) once (descending), -1 elsewhere: x [N, k] int64, in place."""
    present = torch.zeros(x.shape[0], num_slots + 1, dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots), True)
    present = present[:, :num_slots]
    ids = torch.arange(num_slots, device=x.device).expand_as(present)
    vals = torch.where(present, ids, torch.full_like(ids, -1))
    vals = torch.sort(vals, dim=1, descending=True).values
    x.fill_(-1)
    width = min(num_slots, x.shape[1])
    x[:, :width] = vals[:, :width]


def hash_tensor(t: torch.Tensor) -> int:
    """Sum of the tensor's bytes read as int32 (a cheap fingerprint)."""
    return int(t.contiguous().view(torch.int32).sum().item())


def hash_tensors(*tensors: object) -> int:
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value
