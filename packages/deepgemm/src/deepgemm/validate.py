"""Argument checks shared by every entry point; each raises ShapeError naming the argument and both values
before anything is launched."""

from __future__ import annotations

from typing import Any

import torch
from tilehal import ShapeError

from .utils import BLOCK_K, ceil_div

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float32)


def tensor(x: Any, name: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ShapeError(f"{name}: expected dtype {want}, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() != ndim:
        raise ShapeError(f"{name}: expected {ndim} dimensions, got {x.dim()} (shape {tuple(x.shape)})")
    return x


def shape(x: torch.Tensor, name: str, expected: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ShapeError(f"{name}: expected shape {tuple(expected)}, got {tuple(x.shape)}")


def size(name: str, what: str, expected: int, actual: int) -> None:
    if expected != actual:
        raise ShapeError(f"{name}: expected {what} = {expected}, got {actual}")


def pair(x: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise ShapeError(f"{name}: expected a (tensor, scales) pair, got {type(x).__name__}")
    return x[0], x[1]


def recipe(r: Any) -> None:
    if tuple(r) != (1, 128, 128):
        raise ValueError(f"recipe: expected (1, 128, 128) (1x128 activation, 128x128 weight scales), got {tuple(r)}")


def scales(sfa: Any, sfb: Any, m: int, n: int, k: int, groups_a: int | None, groups_b: int | None) -> None:
    """sfa [(G,) M, ceil(K/128)], sfb [(G,) ceil(N/128), ceil(K/128)], float32."""
    sk = ceil_div(k, BLOCK_K)
    ea = (m, sk) if groups_a is None else (groups_a, m, sk)
    eb = (ceil_div(n, BLOCK_K), sk) if groups_b is None else (groups_b, ceil_div(n, BLOCK_K), sk)
    tensor(sfa, "sfa", (torch.float32,), len(ea))
    shape(sfa, "sfa", ea)
    tensor(sfb, "sfb", (torch.float32,), len(eb))
    shape(sfb, "sfb", eb)


def same_device(**named: torch.Tensor | None) -> torch.device:
    devs = {k: v.device for k, v in named.items() if v is not None}
    first_name, first = next(iter(devs.items()))
    for k, dv in devs.items():
        if dv != first:
            raise ShapeError(f"{k}: expected device {first} (the device of {first_name}), got {dv}")
    return first


def cuda_operand(x: torch.Tensor, name: str) -> None:
    """What TMA needs of a K-major operand: unit inner stride, 16-byte row stride and base address."""
    if x.stride(-1) != 1:
        raise ShapeError(f"{name}: expected unit stride along K on CUDA, got strides {tuple(x.stride())}")
    row_bytes = x.stride(-2) * x.element_size()
    if row_bytes % 16 or x.shape[-1] * x.element_size() % 16:
        raise ShapeError(
            f"{name}: expected K * {x.element_size()} bytes to be a multiple of 16 on CUDA (TMA row stride), "
            f"got K = {x.shape[-1]} (row stride {row_bytes} bytes)"
        )
    if x.data_ptr() % 16:
        raise ShapeError(f"{name}: expected a 16-byte aligned data pointer on CUDA, got {x.data_ptr():#x}")


def cuda_output(x: torch.Tensor, name: str) -> None:
    if not x.is_contiguous():
        raise ShapeError(f"{name}: expected a contiguous tensor on CUDA, got strides {tuple(x.stride())}")
    if x.data_ptr() % 16:
        raise ShapeError(f"{name}: expected a 16-byte aligned data pointer on CUDA, got {x.data_ptr():#x}")
