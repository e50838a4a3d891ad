"""TMA descriptors (CUtensorMap) for sm_90 kernels, built with the driver's cuTensorMapEncodeTiled.

The result is the descriptor's 128 bytes; pass it to a kernel as `Arg.raw(desc)` (or plain bytes)
for a `const __grid_constant__ tilehal::TmaDescriptor` parameter (include <tilehal/tma.cuh>).
Encoding needs the CUDA driver (a GPU machine) but no context.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

from .dtypes import get_dtype
from .errors import DeviceError, ShapeError
from .tensors import data_ptr

log = logging.getLogger("tilehal.tma")

_DTYPE_ENUM = {  # our dtype name -> CUtensorMapDataType member
    "uint8": "UINT8", "int8": "UINT8", "float8_e4m3": "UINT8", "float8_e5m2": "UINT8", "bool": "UINT8",
    "float16": "FLOAT16", "bfloat16": "BFLOAT16", "float32": "FLOAT32", "float64": "FLOAT64",
    "int32": "INT32", "int64": "INT64", "int16": "UINT16",
}
_SWIZZLE_BYTES = {"none": 0, "32B": 32, "64B": 64, "128B": 128}


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise DeviceError("TMA descriptors need cuda-bindings (pip install 'tilestack-hal[cuda]')") from e
    return driver


def encode_tiled(
    tensor_or_ptr: Any,
    dtype: Any,
    shape: Sequence[int],
    strides: Sequence[int],
    box: Sequence[int],
    *,
    swizzle: str = "none",
    l2_promotion: int = 256,
) -> bytes:
    """Encode a tiled TMA descriptor and return its 128 bytes.

    `shape`, `strides` (in elements) and `box` list dimensions outermost first, as torch does; the
    innermost stride must be 1. Out-of-bounds box elements read as zero. `swizzle` is "none", "32B",
    "64B" or "128B" (then box[-1] * itemsize must be <= the swizzle width).
    """
    dt = get_dtype(dtype)
    if dt.name not in _DTYPE_ENUM:
        raise ShapeError(f"dtype: expected one of {sorted(_DTYPE_ENUM)}, got {dt.name}")
    rank = len(shape)
    if not 1 <= rank <= 5 or len(strides) != rank or len(box) != rank:
        raise ShapeError(f"shape/strides/box: expected equal lengths from 1 to 5, got {len(shape)}, {len(strides)}, {len(box)}")
    if strides[-1] != 1:
        raise ShapeError(f"strides: expected the innermost stride to be 1, got {strides[-1]}")
    if swizzle not in _SWIZZLE_BYTES:
        raise ShapeError(f"swizzle: expected one of {list(_SWIZZLE_BYTES)}, got {swizzle!r}")
    addr = int(tensor_or_ptr) if isinstance(tensor_or_ptr, int) else data_ptr(tensor_or_ptr)
    if addr % 16:
        raise ShapeError(f"tensor: expected a 16-byte aligned address for TMA, got {addr:#x}")
    item = dt.itemsize
    for i, s in enumerate(strides[:-1]):
        if (s * item) % 16:
            raise ShapeError(f"strides[{i}]: expected a multiple of 16 bytes for TMA, got {s * item} bytes")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ShapeError(f"box[{i}]: expected 1..256 elements, got {b}")
    if (box[-1] * item) % 16:
        raise ShapeError(f"box[-1]: expected a multiple of 16 bytes, got {box[-1] * item} bytes")
    sw = _SWIZZLE_BYTES[swizzle]
    if sw and box[-1] * item > sw:
        raise ShapeError(f"box[-1]: expected at most {sw} bytes with swizzle {swizzle}, got {box[-1] * item}")

    drv = _driver()
    dtype_enum = getattr(drv.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DTYPE_ENUM[dt.name]}")
    swz = getattr(drv.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_NONE" if not sw else f"CU_TENSOR_MAP_SWIZZLE_{swizzle}")
    l2 = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}[l2_promotion]
    l2_enum = getattr(drv.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{l2}")
    # The driver lists dimensions innermost first; strides exclude the innermost and are in bytes.
    dims = [drv.cuuint64_t(int(x)) for x in reversed(shape)]
    gstrides = [drv.cuuint64_t(int(s) * item) for s in reversed(strides[:-1])]
    boxd = [drv.cuuint32_t(int(b)) for b in reversed(box)]
    elem = [drv.cuuint32_t(1)] * rank
    err, tmap = drv.cuTensorMapEncodeTiled(
        dtype_enum, rank, addr, dims, gstrides, boxd, elem,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swz, l2_enum,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if int(err) != 0:
        raise ShapeError(
            f"cuTensorMapEncodeTiled failed ({err}): shape={tuple(shape)} strides={tuple(strides)} box={tuple(box)} "
            f"dtype={dt.name} swizzle={swizzle}"
        )
    return ctypes.string_at(tmap.getPtr(), 128)


def encode_2d(tensor: Any, box_rows: int, box_cols: int, *, swizzle: str = "none") -> bytes:
    """Descriptor of a 2-D torch tensor with unit column stride (its own shape and row stride)."""
    if tensor.dim() != 2:
        raise ShapeError(f"tensor: expected 2 dimensions, got {tensor.dim()}")
    return encode_tiled(tensor, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), (box_rows, box_cols),
                        swizzle=swizzle)


_replace_fn: Any = None  # libcuda's cuTensorMapReplaceAddress through ctypes, or False
_scratch = threading.local()


def _replace_address_fn() -> Any:
    global _replace_fn
    if _replace_fn is None:
        fn: Any = False
        try:
            from .jit.fastlaunch import _libcuda_names

            for name in _libcuda_names():
                try:
                    f = ctypes.CDLL(name).cuTensorMapReplaceAddress
                except (OSError, AttributeError) as e:
                    log.debug("retarget: %s has no usable cuTensorMapReplaceAddress (%s)", name, e)
                    continue
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                fn = f
                break
        finally:
            _replace_fn = fn
    return _replace_fn or None


def retarget(desc: bytes, address: int) -> bytes | None:
    """`desc` (a descriptor from encode_tiled) pointing at `address` instead, everything else kept
    (the driver's cuTensorMapReplaceAddress: about a microsecond, against several for a fresh encode).

    Returns None where the driver entry point cannot be reached through ctypes (then encode anew);
    raises ShapeError for an address that is not 16-byte aligned.
    """
    if address % 16:
        raise ShapeError(f"address: expected a 16-byte aligned address for TMA, got {address:#x}")
    fn = _replace_address_fn()
    if fn is None:
        return None
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        raw = (ctypes.c_ubyte * 192)()
        base = ctypes.addressof(raw)
        buf = _scratch.buf = (raw, base + (-base) % 64)  # CUtensorMap is 64-byte aligned
    ctypes.memmove(buf[1], desc, 128)
    err = fn(buf[1], address)
    if err != 0:
        raise ShapeError(f"cuTensorMapReplaceAddress failed ({err}) for address {address:#x}")
    return ctypes.string_at(buf[1], 128)
