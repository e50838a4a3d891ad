"""`tilelang.profiler`: `do_bench` (the public TileLang's time-budgeted benchmark) and the Profiler."""

from __future__ import annotations

import enum
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tilehal
from tilehal import ArgumentError

from ..ir import dtypes as dt
from ..ir.nodes import Const

log = logging.getLogger("tilelang.profiler")

_MAX_CALLS = 10_000


# ---------------------------------------------------------------- kernel.get_profiler()


class TensorSupplyType(enum.Enum):
    Auto = "auto"  # by dtype: small integers for integer tensors, standard normal for floats
    Normal = "normal"
    Uniform = "uniform"
    Integer = "integer"
    Randn = "randn"
    One = "one"
    Zero = "zero"


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401

        return True
    except ImportError:
        return False


class Profiler:
    def __init__(self, kernel: Any, supply: TensorSupplyType | None, dynamic_shapes: dict[str, int],
                 seed: int = 0) -> None:
        self.kernel = kernel
        self.supply = supply or TensorSupplyType.Auto
        self.dynamic_shapes = dict(dynamic_shapes)
        self.rng = np.random.default_rng(seed)
        self._inputs: list[Any] | None = None

    def _shape(self, buf: Any) -> tuple[int, ...]:
        out = []
        for s in buf.shape:
            if isinstance(s, Const):
                out.append(int(s.value))
            elif s.name in self.dynamic_shapes:
                out.append(int(self.dynamic_shapes[s.name]))
            else:
                raise tilehal.ShapeError(f"get_profiler: size {s.name} of {buf.name} is dynamic; pass "
                                         f"dynamic_shapes={{{s.name!r}: N}}")
        return tuple(out)

    def _make(self, buf: Any) -> Any:
        shape = self._shape(buf)
        s = self.supply
        if s == TensorSupplyType.Zero:
            arr = np.zeros(shape)
        elif s == TensorSupplyType.One:
            arr = np.ones(shape)
        elif s == TensorSupplyType.Integer or dt.is_int(buf.dtype):
            arr = self.rng.integers(-2, 3, size=shape)
        elif s == TensorSupplyType.Uniform:
            arr = self.rng.uniform(-1, 1, size=shape)
        else:
            arr = self.rng.standard_normal(shape)
        arr = arr.astype(np.float32).astype(tilehal.to_numpy_dtype(buf.dtype))
        if _have_torch():
            import torch

            t = tilehal.from_numpy_like(np.ascontiguousarray(arr), torch.empty(0)).clone()
            # a cuda kernel gets its inputs on the GPU (JITKernel.target is "cuda" there)
            return t.cuda() if getattr(self.kernel, "target", "") == "cuda" else t
        return arr

    def inputs(self) -> list[Any]:
        if self._inputs is None:
            views = {v for v, _ in getattr(self.kernel, "view_idx", [])}
            self._inputs = [self._make(p) for i, p in enumerate(self.kernel.params)
                            if i not in self.kernel.out_idx and i not in views]
        return self._inputs

    def assert_allclose(self, reference_program: Callable[..., Any], atol: float = 1e-2, rtol: float = 1e-2,
                        max_mismatched_ratio: float = 0.0) -> None:
        """Run the kernel and `reference_program` on the same random inputs and compare every output."""
        ins = self.inputs()
        outs = self.kernel(*ins)
        ref = reference_program(*ins)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        refs = ref if isinstance(ref, (list, tuple)) else [ref]
        if len(outs) != len(refs):
            raise AssertionError(f"assert_allclose: kernel returned {len(outs)} outputs, reference {len(refs)}")
        for i, (o, r) in enumerate(zip(outs, refs)):
            a = _f64(o)
            b = _f64(r)
            if a.shape != b.shape:
                raise AssertionError(f"output {i}: shape {a.shape} vs reference {b.shape}")
            bad = ~np.isclose(a, b, atol=atol, rtol=rtol, equal_nan=True)
            ratio = bad.mean() if bad.size else 0.0
            if ratio > max_mismatched_ratio:
                idx = np.unravel_index(np.argmax(np.abs(a - b) * bad), a.shape)
                raise AssertionError(f"output {i}: {bad.sum()} of {bad.size} elements differ beyond atol={atol}, "
                                     f"rtol={rtol}; worst at {idx}: kernel {a[idx]} vs reference {b[idx]}")

    def do_bench(self, func: Callable[..., Any] | None = None, warmup: float = 25, rep: float = 100,
                 input_tensors: list[Any] | None = None, **kwargs: Any) -> float:
        """Latency in milliseconds of `func` (default: the kernel) on the profiler's inputs; `warmup` and
        `rep` are time budgets in ms (see tilelang.profiler.do_bench)."""
        ins = input_tensors if input_tensors is not None else self.inputs()
        fn = func or self.kernel
        return do_bench(lambda: fn(*ins), warmup=warmup, rep=rep, **kwargs)


def _f64(x: Any) -> np.ndarray:
    if tilehal.is_torch(x):
        return x.detach().cpu().double().numpy()
    return np.asarray(x).astype(np.float64)


# ---------------------------------------------------------------- do_bench


def _cuda_live() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()
    except ImportError:
        return False


def do_bench(fn: Callable[[], Any], warmup: float = 25, rep: float = 100, _n_warmup: int = 0, _n_repeat: int = 0,
             quantiles: list[float] | None = None, fast_flush: bool = True, backend: str = "event",
             return_mode: str = "mean", grad_to_none: Any = None, **ignored: Any) -> float | list[float]:
    """Latency of `fn()` in milliseconds.

    As in the public TileLang, `warmup` and `rep` are time budgets in milliseconds: a first
    estimate of one call's time, then about `warmup` ms of warm-up calls and `rep` ms of timed
    calls are run (at least one; `_n_warmup` / `_n_repeat` fix the counts instead). `return_mode`
    is "mean", "median", "min" or "max"; `quantiles` returns those quantiles instead.

    On the CPU each call is timed with perf_counter. With CUDA in use (torch initialized), the
    estimate is 5 synchronized calls timed with CUDA events, and each timed call is bracketed by
    events on the current stream (tilehal.bench: a spin kernel ahead of the start event hides the
    host's launch work, so the figure is GPU time); `fast_flush=True` (the default, as in the
    public TileLang) overwrites a 256 MiB buffer before every timed call so each starts with a
    cold L2. `backend="cupti"` is not available here: it is timed with events (logged at DEBUG).
    """
    if return_mode not in ("mean", "median", "min", "max"):
        raise ArgumentError(f"do_bench: return_mode must be 'mean', 'median', 'min' or 'max', got {return_mode!r}")
    cuda = _cuda_live()
    if ignored:
        log.debug("do_bench: options %s have no effect here", sorted(ignored))
    if cuda:
        import tilehal
        import torch

        if backend != "event":
            log.debug("do_bench: backend=%r is not available; timing with CUDA events", backend)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            fn()
        e.record()
        e.synchronize()
        est_ms = max(s.elapsed_time(e) / 5, 1e-4)
    else:
        t0 = time.perf_counter()
        fn()
        est_ms = max((time.perf_counter() - t0) * 1e3, 1e-4)
    n_warm = _n_warmup or min(_MAX_CALLS, int(warmup / est_ms))
    n_rep = _n_repeat or max(1, min(_MAX_CALLS, int(rep / est_ms)))
    if cuda:
        r = tilehal.bench(fn, warmup=n_warm, iters=n_rep, device="cuda", flush_l2=fast_flush)
        times = [t * 1e3 for t in r.times_s]
    else:
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
