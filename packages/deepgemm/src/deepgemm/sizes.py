"""Integer size helpers shared by deepgemm's modules (imported by utils, which re-exports them, and by the
modules utils itself calls into, so no import circle forms)."""

from __future__ import annotations

import numpy as np
from tilehal import ArgumentError, check_choice


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)) and b > 0:
        return (a + b - 1) // b
    raise ArgumentError(f"ceil_div: expected integers a >= 0 and b > 0, got a={a!r}, b={b!r}")


def align(x: int, a: int) -> int:
    return ceil_div(x, a) * a


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """`x` rounded up so that x * element_size is a multiple of 16 bytes (TMA's stride rule)."""
    check_choice(element_size, "element_size", (1, 2, 4, 8, 16))
    return align(x, 16 // element_size)
