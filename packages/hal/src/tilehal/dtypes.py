"""The dtype table: one row per element type, mapping our name to numpy, torch, C and CUDA.

numpy has no bf16/fp8, so those rows use ml_dtypes; torch is optional and looked up by
attribute name only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import ArgumentError


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    kind: str  # "float", "int", "uint", "bool"
    numpy: np.dtype
    torch_name: str  # attribute of the torch module
    c_name: str  # C type used when computing in C (bf16/fp8 stored as raw bits)
    cuda_name: str

    @property
    def bits(self) -> int:
        return self.itemsize * 8

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    def to_torch(self) -> Any:
        try:
            import torch
        except ImportError:
            from .errors import DeviceError

            raise DeviceError(f"dtype {self.name}: torch is not installed (pip install tilestack-hal[torch])") from None
        return getattr(torch, self.torch_name)

    def __str__(self) -> str:
        return self.name


def _row(name, itemsize, kind, np_dtype, torch_name, c_name, cuda_name) -> DType:
    return DType(name, itemsize, kind, np.dtype(np_dtype), torch_name, c_name, cuda_name)


TABLE: tuple[DType, ...] = (
    _row("float64", 8, "float", np.float64, "float64", "double", "double"),
    _row("float32", 4, "float", np.float32, "float32", "float", "float"),
    _row("float16", 2, "float", np.float16, "float16", "uint16_t", "__half"),
    _row("bfloat16", 2, "float", ml_dtypes.bfloat16, "bfloat16", "uint16_t", "__nv_bfloat16"),
    _row("float8_e4m3", 1, "float", ml_dtypes.float8_e4m3fn, "float8_e4m3fn", "uint8_t", "__nv_fp8_e4m3"),
    _row("float8_e5m2", 1, "float", ml_dtypes.float8_e5m2, "float8_e5m2", "uint8_t", "__nv_fp8_e5m2"),
    _row("int64", 8, "int", np.int64, "int64", "int64_t", "long long"),
    _row("int32", 4, "int", np.int32, "int32", "int32_t", "int"),
    _row("int16", 2, "int", np.int16, "int16", "int16_t", "short"),
    _row("int8", 1, "int", np.int8, "int8", "int8_t", "signed char"),
    _row("uint8", 1, "uint", np.uint8, "uint8", "uint8_t", "unsigned char"),
    _row("bool", 1, "bool", np.bool_, "bool", "uint8_t", "bool"),
)

BY_NAME: dict[str, DType] = {d.name: d for d in TABLE}

# Spellings users write (TileLang, torch, numpy) that are not our canonical names.
ALIASES: dict[str, str] = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "fp64": "float64",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3",
    "e4m3": "float8_e4m3",
    "fp8": "float8_e4m3",
    "fp8_e4m3": "float8_e4m3",
    "float8_e4m3fnuz": "float8_e4m3",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
    "long": "int64",
    "int": "int32",
    "bool_": "bool",
}

_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in TABLE}


def get_dtype(x: Any) -> DType:
    """Our DType for a name, numpy dtype, torch dtype, ml_dtypes type or DType."""
    if isinstance(x, DType):
        return x
    if x is None or isinstance(x, (bool, int, float)):
        # np.dtype(None) is float64: a missing dtype must not become one silently.
        raise ArgumentError(f"dtype: expected a dtype name, numpy/torch dtype or DType, got {x!r}")
    if isinstance(x, str):
        key = x.strip().lower().removeprefix("torch.").removeprefix("numpy.")
        key = ALIASES.get(key, key)
        if key in BY_NAME:
            return BY_NAME[key]
        raise ArgumentError(f"dtype: expected one of {sorted(BY_NAME)} (or an alias), got {x!r}")
    mod = type(x).__module__
    if mod.startswith("torch"):
        return get_dtype(str(x))
    try:
        npd = np.dtype(x)
    except (TypeError, ValueError):
        raise ArgumentError(f"dtype: expected a dtype name, numpy/torch dtype or DType, got {x!r}") from None
    if npd in _BY_NUMPY:
        return _BY_NUMPY[npd]
    raise ArgumentError(f"dtype: numpy dtype {npd} has no TileStack equivalent; supported: {sorted(BY_NAME)}")


def to_numpy_dtype(x: Any) -> np.dtype:
    return get_dtype(x).numpy


def to_torch_dtype(x: Any) -> Any:
    return get_dtype(x).to_torch()
