"""Backends, one per target. The table below is the only place a target name maps to code."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import tilehal

from ..ir.nodes import PrimFunc

log = logging.getLogger("tilelang.backends")


def _build_interp(func: PrimFunc, options: dict) -> Any:
    from .interp import InterpKernel

    return InterpKernel(func)


def _build_cpu(func: PrimFunc, options: dict) -> Any:
    from .c.backend import build_c_kernel

    return build_c_kernel(func, options)


def _build_cuda(func: PrimFunc, options: dict) -> Any:
    raise tilehal.DeviceError("target 'cuda': the CUDA backend is not implemented yet in tilelang (planned: "
                              "backends/cuda); use target='cpu' or 'interp'")


BACKENDS: dict[str, Callable[[PrimFunc, dict], Any]] = {
    "interp": _build_interp,
    "cpu": _build_cpu,
    "cuda": _build_cuda,
}
TARGET_ALIASES = {"c": "cpu", "llvm": "cpu", "host": "cpu", "numpy": "interp"}


def resolve_target(target: str | None) -> str:
    t = (target or "auto").lower()
    if t == "auto" and os.environ.get("TILELANG_DEFAULT_TARGET"):  # as in the public TileLang
        t = os.environ["TILELANG_DEFAULT_TARGET"].lower()
    t = TARGET_ALIASES.get(t, t)
    if t == "auto":
        if tilehal.c_compiler() is not None:
            return "cpu"
        log.debug("target auto: no C compiler found, using the interpreter")
        return "interp"
    if t not in BACKENDS:
        raise ValueError(f"target: expected one of {sorted(BACKENDS)} or 'auto', got {target!r}")
    return t
