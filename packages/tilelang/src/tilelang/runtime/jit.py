"""`@tilelang.jit`: picks the style of the decorated function (a prim_func factory, or the eager
style whose body is the kernel). Both styles build on runtime/kernel.py; keeping the choice here
lets the eager runtime import the kernel runtime without a circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tilehal

from ..frontend.eager import is_eager_style
from .eager import EagerJIT
from .kernel import JITFactory


def jit(func: Callable | None = None, *, out_idx: Any = None, target: str = "auto", pass_configs: dict | None = None,
        **_: Any) -> Any:
    """Decorator: `@tilelang.jit(out_idx=[-1])` on a factory that builds and returns a `@T.prim_func`."""

    from .kernel import check_compile_args

    check_compile_args(out_idx, target, pass_configs)

    def wrap(fn: Callable) -> Any:
        if not callable(fn):
            raise tilehal.ArgumentError(f"jit: expected a function to decorate, got {type(fn).__name__}")
        if is_eager_style(fn):  # the function's body is the kernel (T.const / T.empty / with T.Kernel)
            return EagerJIT(fn, target, pass_configs, out_idx)
        return JITFactory(fn, out_idx, target, pass_configs)

    return wrap(func) if func is not None else wrap
