"""Argument checks shared by the umbrella's public constructors (the stack's ArgumentError, naming the
argument, the expected and the actual value)."""

from __future__ import annotations

from typing import Any

import torch
from tilehal import ArgumentError, check_choice, check_int

MAX_FEATURES = 2**31 - 1


def features(value: Any, name: str) -> int:
    return check_int(value, name, lo=1, hi=MAX_FEATURES)


def flag(value: Any, name: str) -> bool:
    return check_choice(value, name, (False, True))


def dtype(value: Any, name: str = "dtype", allow_none: bool = True) -> torch.dtype | None:
    if (value is None and allow_none) or isinstance(value, torch.dtype):
        return value
    raise ArgumentError(f"{name}: expected a torch dtype{' or None' if allow_none else ''}, got {value!r}")


def device(value: Any, name: str = "device") -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, (str, torch.device)):
        try:
            return torch.device(value)
        except (RuntimeError, TypeError) as e:
            raise ArgumentError(f"{name}: expected a torch device like 'cpu' or 'cuda:0', got {value!r} ({e})") from None
    raise ArgumentError(f"{name}: expected a torch device, a string like 'cuda:0' or None, got {value!r}")


def allocate(fn, what: str, shape: tuple) -> Any:
    """fn() that allocates parameters; the allocator's refusal becomes an ArgumentError naming `what`."""
    try:
        return fn()
    except (RuntimeError, MemoryError) as e:
        raise ArgumentError(f"{what}: expected parameters that fit in memory, got shape {shape} ({str(e)[:80]})") \
            from None
