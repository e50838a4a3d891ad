"""Element types in the IR: canonical names from tilehal plus the promotion rules for expressions.

Arithmetic on 16- and 8-bit floats happens in float32 (as on the GPU's CUDA cores and in our C
backend); a value is rounded to its storage type only when stored into a buffer.
"""

from __future__ import annotations

import tilehal

LOW_PRECISION_FLOATS = frozenset({"float16", "bfloat16", "float8_e4m3", "float8_e5m2"})
INDEX = "int32"  # loop variables and grid indices


def canonical(dtype: object) -> str:
    """Our dtype name for anything TileLang users write ("float", "float16", T.float16, torch dtypes)."""
    try:
        return tilehal.get_dtype(str(dtype) if not isinstance(dtype, str) else dtype).name
    except TypeError:
        return tilehal.get_dtype(dtype).name


def is_float(dtype: str) -> bool:
    return dtype.startswith("float") or dtype == "bfloat16"


def is_int(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def compute_type(dtype: str) -> str:
    """The type arithmetic on a value of `dtype` is carried out in."""
    return "float32" if dtype in LOW_PRECISION_FLOATS else dtype


_FLOAT_RANK = {"float32": 1, "float64": 2}
_INT_RANK = {"bool": 0, "int8": 1, "uint8": 1, "int16": 2, "int32": 3, "int64": 4}


def promote(a: str, b: str) -> str:
    """Result type of a binary arithmetic op on compute types `a` and `b`."""
    a, b = compute_type(a), compute_type(b)
    if a == b:
        return a
    if is_float(a) and is_float(b):
        return a if _FLOAT_RANK[a] >= _FLOAT_RANK[b] else b
    if is_float(a):
        return a
    if is_float(b):
        return b
    return a if _INT_RANK.get(a, 3) >= _INT_RANK.get(b, 3) else b
