"""Types, literals and small proofs shared by the CUDA codegen and its per-op rules (rules/)."""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass

import numpy as np
import tilehal

from ...ir import dtypes as dt
from ...ir.layout import Axis, Fragment
from ...ir.nodes import BinOp, Cast, Const, Expr, Var

log = logging.getLogger("tilelang.backends.cuda")

# alignment of every shared-memory buffer the planner places (and of the scratch area after them)
SMEM_ALIGN = 128
SMEM_LIMIT = 232448  # bytes of shared memory a block may opt into on sm_90 (227 KiB)

_LOW = ("float16", "bfloat16", "float8_e4m3", "float8_e5m2")
_MMA_TAG = {"float16": "MmaF16", "bfloat16": "MmaBF16", "float8_e4m3": "MmaE4M3", "float8_e5m2": "MmaE5M2",
            "int8": "MmaS8"}

def cuda_type(dtype: str) -> str:
    return tilehal.get_dtype(dtype).cuda_name


def value_type(dtype: str) -> str:
    """C type of arithmetic on a value of `dtype` (16/8-bit floats compute in float)."""
    return cuda_type(dt.compute_type(dtype))


def esize(dtype: str) -> int:
    return tilehal.get_dtype(dtype).itemsize


def float_literal(v: float, dtype: str) -> str:
    if math.isinf(v):
        lit = "INFINITY" if v > 0 else "-INFINITY"
        return lit if dtype != "float64" else f"((double){lit})"
    if math.isnan(v):
        return "__int_as_float(0x7fffffff)"
    if dtype == "float64":
        return repr(float(v))
    f32 = struct.unpack("f", struct.pack("f", float(np.float32(v))))[0]
    return f"{f32!r}f" if "e" in repr(f32) or "." in repr(f32) else f"{f32!r}.0f"


def _divisible(e: Expr, v: int) -> bool:
    if v == 1:
        return True
    if isinstance(e, Const):
        return int(e.value) % v == 0
    if isinstance(e, BinOp):
        if e.op == "*":
            return _divisible(e.a, v) or _divisible(e.b, v) or (
                isinstance(e.a, Const) and isinstance(e.b, Const) and (int(e.a.value) * int(e.b.value)) % v == 0)
        if e.op in ("+", "-"):
            return _divisible(e.a, v) and _divisible(e.b, v)
    return False


def _nonneg(e: Expr) -> bool:
    if isinstance(e, Const):
        return not isinstance(e.value, bool) and e.value >= 0
    if isinstance(e, Var):
        return True  # loop, block and size variables are never negative
    if isinstance(e, BinOp) and e.op in ("+", "*", "//", "%", "max", "min"):
        return _nonneg(e.a) and _nonneg(e.b)
    if isinstance(e, Cast):
        return _nonneg(e.value)
    return False


@dataclass
class SmemInfo:
    offset: int
    stages: int
    stage_elems: int
    swizzle: tuple[int, int, int] | None  # (shift, mask, log2 elems per 16 bytes)


@dataclass
class ParCtx:
    layout: Fragment | None
    var_pos: dict[Var, int]
    regvars: dict[tuple[int, Axis], str]
    lead: str | None  # C condition true on one replica (guards global/shared stores)
