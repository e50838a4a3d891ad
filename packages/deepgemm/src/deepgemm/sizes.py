"""Integer size helpers shared by deepgemm's modules (imported by utils, which re-exports them, and by the
modules utils itself calls into, so no import circle forms)."""

from __future__ import annotations

import numpy as np
import torch
from tilehal import ArgumentError, check_choice


def _integer_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers. `a` may also be an integer tensor (element-wise, as DeepGEMM's
    plain arithmetic: its tests call it on an element of a device tensor; no sync, so not checked for sign)."""
    if isinstance(b, (int, np.integer)) and b > 0 and (isinstance(a, (int, np.integer)) or _integer_tensor(a)):
        return (a + b - 1) // b
    raise ArgumentError(f"ceil_div: expected integers a >= 0 (or an integer tensor) and b > 0, got a={a!r}, b={b!r}")


def align(x: int, a: int) -> int:
    """x rounded up to a multiple of a (x may be an integer tensor, as in ceil_div)."""
    return ceil_div(x, a) * a


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """`x` rounded up so that x * element_size is a multiple of 16 bytes (TMA's stride rule)."""
    check_choice(element_size, "element_size", (1, 2, 4, 8, 16))
    return align(x, 16 // element_size)
