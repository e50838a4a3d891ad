"""Argument checks shared by every entry point; each raises ShapeError naming the argument and both values
before anything is launched."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from tilehal import ArgumentError, ShapeError, TileStackError

from .utils import BLOCK_K, ceil_div

log = logging.getLogger("deepgemm")

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


class UnsupportedError(TileStackError, NotImplementedError):
    """A DeepGEMM feature that deepgemm does not provide on this device (the message names the argument)."""


DEFAULT_RECIPE = (1, 128, 128)


def _int_tuple(r: Any, name: str, length: int) -> tuple[int, ...]:
    try:
        t = tuple(int(v) for v in r)
    except TypeError:
        raise ArgumentError(f"{name}: expected a tuple of {length} ints, got {r!r}") from None
    if len(t) != length or any(v < 1 for v in t):
        raise ArgumentError(f"{name}: expected a tuple of {length} positive ints, got {r!r}")
    return t


def recipes(recipe: Any, recipe_a: Any, recipe_b: Any, packed: bool = False) -> tuple[int, int, int]:
    """DeepGEMM's recipe arguments -> (gran_k, gran_n, gran_m): K granularity of both operands' scales,
    rows of B per weight scale (1: per row, the 1D1D recipe; 128: 128x128 blocks), rows of A per scale.

    Either `recipe` = (gran_m, gran_n, gran_k) or the pair `recipe_a` = (gran_m, gran_k_a) and
    `recipe_b` = (gran_n, gran_k_b); neither gives the default (1, 128, 128) ((1, 1, 128) for packed
    UE8M0 scales). Activations must be per token (gran_m = 1) with gran_k_a == gran_k_b.
    """
    if recipe is not None and (recipe_a is not None or recipe_b is not None):
        raise ArgumentError(f"recipe: expected either recipe or the recipe_a/recipe_b pair, got recipe={recipe!r} "
                         f"with recipe_a={recipe_a!r}, recipe_b={recipe_b!r}")
    if (recipe_a is None) != (recipe_b is None):
        raise ArgumentError(f"recipe_a/recipe_b: expected both or neither, got recipe_a={recipe_a!r}, recipe_b={recipe_b!r}")
    if recipe_a is not None:
        gm, gka = _int_tuple(recipe_a, "recipe_a", 2)
        gn, gkb = _int_tuple(recipe_b, "recipe_b", 2)
    else:
        r = (1, 1, 128) if packed and recipe is None else _int_tuple(recipe if recipe is not None else DEFAULT_RECIPE,
                                                                      "recipe", 3)
        gm, gn, gka = r
        gkb = gka
    if gm != 1:
        raise UnsupportedError(f"recipe: expected per-token activation scales (gran_m = 1), got gran_m = {gm}")
    if gka != gkb:
        raise UnsupportedError(f"recipe_b: expected the activations' gran_k = {gka}, got {gkb}")
    if gka not in (32, 64, 128):
        raise ArgumentError(f"recipe: expected gran_k 32, 64 or 128, got {gka}")
    return gka, gn, gm


def recipe(r: Any) -> None:
    """The dense recipe check of the older API: only (1, 128, 128) and (1, 1, 128)."""
    t = _int_tuple(r, "recipe", 3)
    if t not in ((1, 128, 128), (1, 1, 128)):
        raise ArgumentError(f"recipe: expected (1, 128, 128) (1x128 activation, 128x128 weight scales) or (1, 1, 128), "
                         f"got {t}")


def sf(x: Any, name: str, rows: int, k: int, gran_rows: int, gran_k: int, groups: int | None,
       rows_used: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """A scale tensor [(G,) ceil(rows/gran_rows), ceil(k/gran_k)] float32, or packed UE8M0 int32
    [(G,) rows, ceil(ceil(k/gran_k)/4)] (gran_rows must be 1); returns the float32 logical tensor.
    `rows_used()` (bool [(G,) rows], made only when values are checked): the rows the GEMM reads; the
    others (padding of grouped layouts, which DeepGEMM leaves as they are, even uninitialized) are not
    checked."""
    sk = ceil_div(k, gran_k)
    lead = () if groups is None else (groups,)
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if x.dtype == torch.int32:
        if gran_rows != 1:
            raise ShapeError(f"{name}: expected float32 scales for {gran_rows}-row blocks (packed UE8M0 scales are "
                             f"per row), got int32")
        want = (*lead, rows, ceil_div(sk, 4))
        shape(x, name, want)
        from .utils import unpack_ue8m0_from_int

        return unpack_ue8m0_from_int(x)[..., :sk]
    want = (*lead, ceil_div(rows, gran_rows), sk)
    tensor(x, name, (torch.float32,), len(want))
    if tuple(x.shape) != want and tuple(x.shape[-2:]) == want[-2:][::-1]:
        raise ShapeError(f"{name}: expected shape {want}, got {tuple(x.shape)} (scales are passed in the same "
                         f"stored orientation as their operand, as in DeepGEMM: transpose them with it)")
    shape(x, name, want)
    scale_values(x, name, rows_used)
    return x


def value_checks(x: torch.Tensor, name: str) -> bool:
    """Whether to check the values of `x` on the host: always for CPU tensors; for CUDA tensors only with
    DEEPGEMM_DEBUG=1 (reading them costs a device sync) and never during CUDA graph capture. Without the
    checks the kernels clamp masked_m to [0, M_max] and skip rows whose m_indices are out of range."""
    if x.device.type != "cuda":
        return True
    if os.environ.get("DEEPGEMM_DEBUG", "0") not in ("", "0") and not torch.cuda.is_current_stream_capturing():
        return True
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: value checks skipped on CUDA (set DEEPGEMM_DEBUG=1 to run them; they sync)", name)
    return False


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def scale_values(x: torch.Tensor, name: str, rows_used: Callable[[], torch.Tensor] | None = None) -> None:
    """Scales must be finite and >= 0: a NaN or Inf scale turns its whole block (up to 128 x 128 outputs'
    worth of products) into NaN, a negative one flips the block's sign. The cast helpers in deepgemm.utils
    never produce them (an Inf or NaN input stays at its own position). `rows_used()`: bool over x's
    leading dims, the rows to check (see sf)."""
    if x.numel() == 0 or not value_checks(x, name):
        return
    bad = ~torch.isfinite(x) | (x < 0)
    if rows_used is not None:
        bad &= rows_used().to(bad.device).unsqueeze(-1)
    if bool(bad.any()):
        at = _first(bad)
        raise ArgumentError(f"{name}: expected finite scales >= 0, got {float(x[at])} at index {at}")


def int_values(x: torch.Tensor, name: str, lo: int, hi: int, what: str) -> None:
    """Every value of integer tensor `x` in [lo, hi]."""
    if x.numel() == 0 or not value_checks(x, name):
        return
    bad = (x < lo) | (x > hi)
    if bool(bad.any()):
        at = _first(bad)
        raise ArgumentError(f"{name}: expected values in [{lo}, {hi}] ({what}), got {int(x[at])} at index {at}")


def scales(sfa: Any, sfb: Any, m: int, n: int, k: int, groups_a: int | None, groups_b: int | None) -> None:
    """sfa [(G,) M, ceil(K/128)], sfb [(G,) ceil(N/128), ceil(K/128)], float32."""
    sf(sfa, "sfa", m, k, 1, BLOCK_K, groups_a)
    sf(sfb, "sfb", n, k, BLOCK_K, BLOCK_K, groups_b)


def compiled_dims(x: Any) -> None:
    if not isinstance(x, str) or any(ch not in "mnk" for ch in x.lower()):
        raise ArgumentError(f"compiled_dims: expected a string of the letters m, n, k, got {x!r}")


def flag(x: Any, name: str) -> bool:
    if not isinstance(x, bool):
        raise ArgumentError(f"{name}: expected a bool, got {x!r}")
    return x


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
