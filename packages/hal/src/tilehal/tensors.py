"""Tensor helpers: accept torch tensors and numpy arrays alike, check them, never copy silently."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .dtypes import DType, get_dtype
from .errors import ArgumentError, ShapeError, TileStackError


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_torch(x)


def dtype_of(x: Any) -> DType:
    try:
        return get_dtype(x.dtype)
    except AttributeError:
        raise ShapeError(f"x: expected a torch tensor or numpy array, got {type(x).__name__}") from None


def device_of(x: Any) -> str:
    """'cpu' or 'cuda:N'."""
    if is_torch(x):
        d = x.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{d.index if d.index is not None else 0}"
    return "cpu"


def data_ptr(x: Any) -> int:
    if is_torch(x):
        return int(x.data_ptr())
    try:
        return int(x.__array_interface__["data"][0])
    except AttributeError:
        raise ShapeError(f"x: expected a torch tensor or numpy array, got {type(x).__name__}") from None


def is_contiguous(x: Any) -> bool:
    if is_torch(x):
        return bool(x.is_contiguous())
    try:
        return bool(x.flags["C_CONTIGUOUS"])
    except (AttributeError, TypeError, KeyError):
        raise ShapeError(f"x: expected a torch tensor or numpy array, got {type(x).__name__}") from None


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view of a CPU tensor or array (zero-copy; bf16/fp8 through ml_dtypes views)."""
    if isinstance(x, np.ndarray):
        return x
    if not is_torch(x):
        raise ArgumentError(f"tensor: expected a numpy array or torch tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ShapeError(f"tensor: expected a CPU tensor for a numpy view, got device {x.device}")
    dt = dtype_of(x)
    if dt.name in ("bfloat16", "float16", "float8_e4m3", "float8_e5m2"):
        import torch

        raw = x.view(torch.int16 if dt.itemsize == 2 else torch.uint8)
        return np.from_dlpack(raw.detach()).view(dt.numpy)
    return np.from_dlpack(x.detach())


def from_numpy_like(arr: np.ndarray, like: Any) -> Any:
    """Wrap `arr` as the same kind as `like` (numpy stays numpy; torch gets a zero-copy tensor)."""
    if not is_torch(like):
        return arr
    import torch

    dt = get_dtype(arr.dtype)
    if dt.name in ("bfloat16", "float16", "float8_e4m3", "float8_e5m2"):
        raw = torch.from_numpy(arr.view(np.int16 if dt.itemsize == 2 else np.uint8))
        t = raw.view(dt.to_torch())
    else:
        t = torch.from_numpy(arr)
    return t if like.device.type == "cpu" else t.to(like.device)


def check_tensor(
    x: Any,
    name: str,
    *,
    dtype: Any | Sequence[Any] | None = None,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    contiguous: bool = False,
    device: str | None = None,
    alignment: int | None = None,
) -> Any:
    """Validate an argument before any kernel sees it; raise ShapeError naming it and both values.

    `shape` entries of None match any size. `device` is "cpu", "cuda" (any index) or "cuda:N".
    `alignment` is in bytes, for the data pointer.
    """
    try:
        if not is_array(x):
            raise ShapeError(f"{name}: expected a torch tensor or numpy array, got {type(x).__name__}")
        if dtype is not None:
            allowed = [get_dtype(d) for d in (dtype if isinstance(dtype, (list, tuple, set)) else [dtype])]
            actual = dtype_of(x)
            if actual not in allowed:
                want = " or ".join(d.name for d in allowed)
                raise ShapeError(f"{name}: expected dtype {want}, got {actual.name}")
        actual_shape = tuple(int(s) for s in x.shape)
        if ndim is not None and len(actual_shape) != ndim:
            raise ShapeError(f"{name}: expected {ndim} dimensions, got {len(actual_shape)} (shape {actual_shape})")
        if shape is not None:
            ok = len(shape) == len(actual_shape) and all(
                s is None or int(s) == a for s, a in zip(shape, actual_shape)
            )
            if not ok:
                want = tuple("*" if s is None else int(s) for s in shape)
                raise ShapeError(f"{name}: expected shape {want}, got {actual_shape}")
        if contiguous and not is_contiguous(x):
            raise ShapeError(f"{name}: expected a contiguous tensor, got strides {tuple(_strides(x))}")
        if device is not None:
            actual_dev = device_of(x)
            match = actual_dev == device or (device == "cuda" and actual_dev.startswith("cuda"))
            if not match:
                raise ShapeError(f"{name}: expected device {device}, got {actual_dev}")
        if alignment is not None and data_ptr(x) % alignment != 0:
            raise ShapeError(f"{name}: expected data aligned to {alignment} bytes, got address {data_ptr(x):#x}")

    except TileStackError:
        raise
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, AttributeError) as e:
        raise ArgumentError(f"check_tensor({name!r}): expected dtype a dtype or list of them, shape a sequence of ints "
                            f"or None, ndim an int, contiguous a bool, device a string, alignment a positive int; "
                            f"got dtype={dtype!r}, shape={shape!r}, ndim={ndim!r}, contiguous={contiguous!r}, "
                            f"device={device!r}, alignment={alignment!r} ({type(e).__name__}: {e})"[:600]) from None
    return x


def _strides(x: Any) -> tuple[int, ...]:
    if is_torch(x):
        return tuple(x.stride())
    return tuple(s // x.itemsize for s in x.strides)


def stream_buffer(cache: dict, device: Any, numel: int, dtype: Any = None, min_numel: int = 256) -> Any:
    """A zero-filled torch buffer of at least `numel` elements (default dtype int32) for the current
    stream of CUDA `device`, kept in `cache` under (device index, stream), so launches on different
    streams never share one; a new, larger zero-filled buffer replaces one that is too small (at
    least `min_numel` elements). What kernels use it for (tickets, counters) they leave zero again
    before they finish, so it is zero between launches."""
    import torch

    for arg, value, lo in (("numel", numel, 0), ("min_numel", min_numel, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
            raise ArgumentError(f"{arg}: expected an integer >= {lo}, got {value!r}")
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.zeros(max(numel, min_numel), dtype=torch.int32 if dtype is None else dtype,
                                       device=device)
    return buf
