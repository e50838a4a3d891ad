"""`tilelang.profiler`: `do_bench` (the public TileLang's time-budgeted benchmark) and the Profiler."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from tilehal import ArgumentError

from ..runtime.profiler import Profiler, TensorSupplyType

log = logging.getLogger("tilelang.profiler")

_MAX_CALLS = 10_000


def _cuda_live() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()
    except ImportError:
        return False


def do_bench(fn: Callable[[], Any], warmup: float = 25, rep: float = 100, _n_warmup: int = 0, _n_repeat: int = 0,
             quantiles: list[float] | None = None, backend: str = "event", return_mode: str = "mean",
             **ignored: Any) -> float | list[float]:
    """Latency of `fn()` in milliseconds.

    As in the public TileLang, `warmup` and `rep` are time budgets in milliseconds: one call is
    timed first, then about `warmup` ms of warm-up calls and `rep` ms of timed calls are run
    (at least one; `_n_warmup` / `_n_repeat` fix the counts instead). `return_mode` is
    "mean", "median", "min" or "max"; `quantiles` returns those quantiles instead. On the CPU
    each call is timed with perf_counter; with CUDA in use, tilehal.bench times it with events
    (median). `backend`, `fast_flush` and the other GPU options are accepted; on the CPU they
    have no meaning.
    """
    if return_mode not in ("mean", "median", "min", "max"):
        raise ArgumentError(f"do_bench: return_mode must be 'mean', 'median', 'min' or 'max', got {return_mode!r}")
    if ignored:
        log.debug("do_bench: options %s have no effect on this device", sorted(ignored))
    t0 = time.perf_counter()
    fn()
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-4)
    n_warm = _n_warmup or min(_MAX_CALLS, int(warmup / est_ms))
    n_rep = _n_repeat or max(1, min(_MAX_CALLS, int(rep / est_ms)))
    if _cuda_live():
        import tilehal

        r = tilehal.bench(fn, warmup=n_warm, iters=n_rep, device="auto")
        return {"min": r.min_s, "max": r.max_s}.get(return_mode, r.median_s) * 1e3
    for _ in range(n_warm):
        fn()
    times = []
    for _ in range(n_rep):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    if quantiles is not None:
        s = sorted(times)
        return [s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] for q in quantiles]
    return {"mean": statistics.fmean, "median": statistics.median, "min": min, "max": max}[return_mode](times)


__all__ = ["Profiler", "TensorSupplyType", "do_bench"]
