"""Integer helpers on Python ints (host side; inside kernels use T.ceildiv)."""

from __future__ import annotations

import tilehal


def _int(x: object, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise tilehal.ArgumentError(f"{name}: expected a Python int, got {type(x).__name__} {x!r}")
    return x


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b != 0."""
    a, b = _int(a, "cdiv: a"), _int(b, "cdiv: b")
    if b == 0:
        raise tilehal.ArgumentError("cdiv: b must be non-zero, got 0")
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    n = _int(n, "next_power_of_2: n")
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
