"""Test helpers shared by the packages' test suites and benchmarks (argument-handling probes, environment).

`probe_arguments(fn, kwargs)` calls `fn(**kwargs)` once per (argument, bad value) pair with that one
argument replaced, and returns every call that ended in something other than success or a
TileStackError: a raw library exception (IndexError, ZeroDivisionError, a torch RuntimeError, ...),
or a call that ran past `timeout_s` (on the main thread of a POSIX process). The stack's rule is
that bad input raises a TileStackError naming the argument before any work runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .errors import TileStackError


def bad_values() -> dict[str, Any]:
    """Values that break careless argument handling: wrong types, NaN, sizes 0/-1/huge, empty or
    NaN tensors and arrays (torch and numpy entries only when they are installed)."""
    out: dict[str, Any] = {"None": None, "-1": -1, "0": 0, "1.5": 1.5, "nan": math.nan, "inf": math.inf,
                           "str": "x", "True": True, "list": [], "big": 2**40, "-big": -(2**40)}
    try:
        import numpy as np

        out.update({"np2d": np.ones((2, 2), np.float32), "np_nan": np.array([math.nan])})
    except ImportError:
        pass
    try:
        import torch

        out.update({"t_empty": torch.empty(0), "t_float": torch.ones(3), "t_nan": torch.tensor([math.nan]),
                    "t_int2d": torch.ones(2, 2, dtype=torch.int64), "t_neg": -torch.ones(2, 3)})
    except ImportError:
        pass
    return out


class _Timeout(Exception):
    pass


def _raise_timeout(*_: Any) -> None:
    raise _Timeout()


def probe_arguments(fn: Callable, kwargs: dict[str, Any], skip: dict[str, set[str]] | None = None,
                    timeout_s: int = 20, values: dict[str, Any] | None = None,
                    fresh: Callable[[], tuple[Callable, dict[str, Any]]] | None = None) -> list[str]:
    """Failures of `fn` under one-argument mutations of `kwargs` (empty when every call either succeeded
    or raised a TileStackError). `skip[arg]` names bad values not to try for `arg`. `fresh()`, when
    given, returns a new (fn, kwargs) for each call (for methods of objects a call may change)."""
    values = bad_values() if values is None else values
    use_alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    failures = []
    for arg in kwargs:
        for name, bad in values.items():
            if name in (skip or {}).get(arg, set()):
                continue
            call, base = fresh() if fresh is not None else (fn, kwargs)
            kw = dict(base)
            kw[arg] = bad
            old = signal.signal(signal.SIGALRM, _raise_timeout) if use_alarm else None
            if use_alarm:
                signal.alarm(timeout_s)
            try:
                call(**kw)
            except TileStackError:
                pass
            except _Timeout:
                failures.append(f"{getattr(fn, '__qualname__', fn)}({arg}={name}): no answer in {timeout_s} s")
            except Exception as e:  # noqa: BLE001 - any other exception is the finding
                failures.append(f"{getattr(fn, '__qualname__', fn)}({arg}={name}): {type(e).__name__}: {str(e)[:160]}")
            finally:
                if use_alarm:
                    signal.alarm(0)
                    signal.signal(signal.SIGALRM, old)
    return failures


@contextlib.contextmanager
def without_modules(*prefixes: str) -> Iterator[None]:
    """Inside the block, every import statement naming a module that starts with one of `prefixes` raises
    ImportError, as if it were not installed (also when it is loaded already; references taken before the block
    keep working). For tests of optional-dependency fallbacks. builtins.__import__ is put back after, also on
    error."""
    import builtins

    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        from .errors import ArgumentError

        raise ArgumentError(f"prefixes: expected one or more non-empty module name prefixes, got {prefixes!r}")
    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.startswith(prefixes):
            raise ImportError(f"{name} is hidden by tilehal.testing.without_modules{prefixes}")
        return real(name, *args, **kwargs)

    builtins.__import__ = refuse
    try:
        yield
    finally:
        builtins.__import__ = real


@contextlib.contextmanager
def environ(values: dict[str, str | None]) -> Iterator[None]:
    """Set the environment variables of `values` (None: unset) for the block, then put back what was
    there before (set or unset), also when the block raises."""
    def put(settings: dict[str, str | None]) -> None:
        for k, v in settings.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in values}
    try:
        put(values)
        yield
    finally:
        put(old)
