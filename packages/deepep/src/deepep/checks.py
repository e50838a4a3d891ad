"""Type checks of deepep's public arguments, run before anything else touches them: a wrong type or
an unusable value is a TileStackError naming the argument (never a raw AttributeError/TypeError
from deep inside a call)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tilehal import ArgumentError, ShapeError, check_int

INT32_MAX = 2**31 - 1  # row and slot indices are int32 (handles, NVLink kernels): counts stay below


def tensor(x: Any, name: str, ndim: int | None = None, dtypes: tuple | None = None,
           optional: bool = False) -> torch.Tensor | None:
    """`x` if it is a torch.Tensor (with `ndim` dims and one of `dtypes`, when given), else ShapeError."""
    if x is None and optional:
        return None
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ShapeError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ShapeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    return x


def flag(v: Any, name: str) -> bool:
    """A bool argument: True/False (numpy bools, 0 and 1 too), else ArgumentError."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ArgumentError(f"{name}: expected True or False, got {v!r}"[:300])


def flags(**values: Any) -> None:
    for name, v in values.items():
        flag(v, name)


def positive_seconds(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
            or v <= 0:
        raise ArgumentError(f"{name}: expected a finite number of seconds > 0, got {v!r}"[:300])
    return float(v)


__all__ = ["INT32_MAX", "check_int", "flag", "flags", "positive_seconds", "tensor"]
