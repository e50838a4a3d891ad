"""Backends, one object per target: its name, the device its tensors live on, its ordered pass
list, and its build. This table is the only place a target name maps to code."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tilehal

from ..ir.nodes import PrimFunc

log = logging.getLogger("tilelang.backends")


@dataclass(frozen=True)
class Backend:
    name: str
    device: str  # where the kernel's tensors live: "cpu" or "cuda"
    passes: Callable[[dict], list]  # options -> ordered list of PrimFunc -> PrimFunc passes
    build: Callable[[PrimFunc, dict], Any]  # lowered func, options -> callable(args, dyn) with .source()
    # optional: func as written, options, lower() (runs the passes) -> built kernel (a backend with a kernel
    # cache that can skip the passes); JITKernel then lowers for `.lowered` only when asked
    compile: Callable[[PrimFunc, dict, Callable[[], PrimFunc]], Any] | None = None


def _interp_passes(options: dict) -> list:
    from ..ir.verifier import verify
    from ..passes.checks import check_shapes
    from ..passes.dce import dce
    from ..passes.simplify import simplify

    # the oracle runs tile ops directly: only the cleanups
    return [check_shapes, simplify, dce, verify]


def _cpu_passes(options: dict) -> list:
    from .c.pipeline import passes

    return passes(options)


def _cuda_passes(options: dict) -> list:
    from .cuda.pipeline import passes

    return passes(options)


def _build_interp(func: PrimFunc, options: dict) -> Any:
    from .interp import InterpKernel

    return InterpKernel(func)


def _build_cpu(func: PrimFunc, options: dict) -> Any:
    from .c.backend import build_c_kernel

    return build_c_kernel(func, options)


def _build_cuda(func: PrimFunc, options: dict) -> Any:
    from .cuda.backend import build_cuda_kernel

    return build_cuda_kernel(func, options)


def _compile_cuda(func: PrimFunc, options: dict, lower: Callable[[], PrimFunc]) -> Any:
    from .cuda.backend import compile_cuda_kernel

    return compile_cuda_kernel(func, options, lower)


def _build_cuda_emu(func: PrimFunc, options: dict) -> Any:
    from .cuda.emulate import build_emulated

    return build_emulated(func, options)


def _build_cuda_threads(func: PrimFunc, options: dict) -> Any:
    from .cuda.thread_target import ThreadLoweredKernel

    return ThreadLoweredKernel(func, options)


BACKENDS: dict[str, Backend] = {
    "interp": Backend("interp", "cpu", _interp_passes, _build_interp),
    "cpu": Backend("cpu", "cpu", _cpu_passes, _build_cpu),
    "cuda": Backend("cuda", "cuda", _cuda_passes, _build_cuda, _compile_cuda),
    # testing: the cuda backend's code run on the CPU with a thread per CUDA thread (backends/cuda/emulate.py)
    "cuda_emu": Backend("cuda_emu", "cpu", _cuda_passes, _build_cuda_emu),
    # testing: the cuda backend's thread-level program run by the thread interpreter (numpy lanes;
    # backends/cuda/lower_thread.py), the CPU check of every lowering against the tile interpreter
    "cuda_threads": Backend("cuda_threads", "cpu", _cuda_passes, _build_cuda_threads),
}
TARGET_ALIASES = {"c": "cpu", "llvm": "cpu", "host": "cpu", "numpy": "interp"}


def host_target() -> str:
    if tilehal.c_compiler() is not None:
        return "cpu"
    log.debug("target auto: no C compiler found, using the interpreter")
    return "interp"


def resolve_target(target: str | None) -> str:
    """A target name; "auto" resolves to the host target here (JITKernel switches to cuda per call when
    it is given CUDA tensors)."""
    t = (target or "auto").lower()
    if t == "auto" and os.environ.get("TILELANG_DEFAULT_TARGET"):  # as in the public TileLang
        t = os.environ["TILELANG_DEFAULT_TARGET"].lower()
    t = TARGET_ALIASES.get(t, t)
    if t == "auto":
        return host_target()
    if t not in BACKENDS:
        raise tilehal.ArgumentError(f"target: expected one of {sorted(BACKENDS)} or 'auto', got {target!r}")
    return t
