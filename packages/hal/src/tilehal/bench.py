"""Timing and numerical-agreement helpers used by every package's benchmarks and tests."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .tensors import as_numpy, is_torch


@dataclass(frozen=True)
class BenchResult:
    median_s: float
    min_s: float
    max_s: float
    p20_s: float
    p80_s: float
    iters: int
    timer: str  # "cuda_events", "perf_counter" or "host" (bench_host)
    host_s: float = 0.0  # median host time of one call (launch overhead on CUDA)
    times_s: tuple[float, ...] = ()  # every timed call, in order (means and quantiles of callers)

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6

    def __str__(self) -> str:
        return f"{self.median_us:.1f} us (p20 {self.p20_s * 1e6:.1f}, p80 {self.p80_s * 1e6:.1f}, n={self.iters})"


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


FLUSH_MODES = (False, True, "write", "read")  # bench's flush_l2: none, memset (True = "write"), read
MAX_ITERS = 10**7  # warm-up / timed calls: more is a typo, and would run for hours
MAX_TIME_S = 3600.0


def _check_bench_args(fn: Any, warmup: Any, iters: Any, device: Any, min_time_s: Any) -> None:
    from .errors import ArgumentError

    if not callable(fn):
        raise ArgumentError(f"fn: expected a callable taking no arguments, got {type(fn).__name__}")
    for arg, value, lo in (("warmup", warmup, 0), ("iters", iters, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= MAX_ITERS:
            raise ArgumentError(f"{arg}: expected an integer in [{lo}, {MAX_ITERS}], got {value!r}")
    if not isinstance(device, str) or device not in ("auto", "cuda", "cpu"):
        raise ArgumentError(f"device: expected 'auto', 'cuda' or 'cpu', got {device!r}")
    if isinstance(min_time_s, bool) or not isinstance(min_time_s, (int, float)) or not 0 <= min_time_s <= MAX_TIME_S:
        raise ArgumentError(f"min_time_s: expected a number of seconds in [0, {MAX_TIME_S}], got {min_time_s!r}")


def bench(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    iters: int = 20,
    device: str = "auto",
    flush_l2: bool | str = False,
    min_time_s: float = 0.0,
    hide_host: bool = True,
) -> BenchResult:
    """Time `fn()`: warm-up, then `iters` timed calls (more until `min_time_s` has passed).

    On CUDA ("auto" picks it when torch sees a GPU) each call is timed with CUDA events on the
    current stream; `flush_l2` overwrites a 256 MiB buffer between calls so the L2 starts cold (True or
    "write": a memset, which leaves the L2 full of dirty lines that the timed call's first misses write
    back; "read": the buffer is read instead, so the L2 starts cold and clean).
    With `hide_host` (default) a spin kernel is queued before the start event, long enough to
    cover the host's launch work, so the figure is GPU time — what a CUDA graph replay of `fn`
    would take — for ours and the peer alike; `host_s` reports the host time per call
    separately. `hide_host=False` counts host gaps too. On the CPU, time.perf_counter per call.
    """
    _check_bench_args(fn, warmup, iters, device, min_time_s)
    if not (isinstance(flush_l2, (bool, np.bool_)) or (isinstance(flush_l2, str) and flush_l2 in FLUSH_MODES)):
        from .errors import ArgumentError

        raise ArgumentError(f"flush_l2: expected one of {FLUSH_MODES}, got {flush_l2!r}"[:200])
    read_flush = isinstance(flush_l2, str) and flush_l2 == "read"
    flush_l2 = bool(flush_l2)
    use_cuda = False
    if device in ("auto", "cuda"):
        try:
            import torch

            use_cuda = torch.cuda.is_available()
        except ImportError:
            use_cuda = False
        if device == "cuda" and not use_cuda:
            from .errors import DeviceError

            raise DeviceError("bench(device='cuda'): no CUDA GPU is available")
    host_times: list[float] = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        host_times.append(time.perf_counter() - t0)
    times: list[float] = []
    if use_cuda:
        import torch

        flush = None
        if read_flush:  # float32 zeros: the sum reads them in one reduction and writes 4 bytes (an int32 sum
            # would first widen the buffer to int64: 512 MiB written)
            flush = torch.zeros(64 * 2**20, dtype=torch.float32, device="cuda")
        elif flush_l2:
            flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        estimate = statistics.median(host_times) if host_times else 0.0
        host_times = []
        start_t = time.perf_counter()
        while len(times) < iters or time.perf_counter() - start_t < min_time_s:
            if flush is not None:
                if read_flush:
                    flush.sum()
                else:
                    flush.zero_()
            if hide_host and hasattr(torch.cuda, "_sleep"):
                if host_times:  # only ever lower: a fn that synchronizes waits out the sleep itself,
                    # and growing the sleep with that time would double it every call
                    estimate = min(estimate, statistics.median(host_times[-8:]))
                # ~2 GHz SM clock: twice the host time plus a margin, in cycles.
                torch.cuda._sleep(int((2 * estimate + 20e-6) * 2e9))
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            t0 = time.perf_counter()
            fn()
            host_times.append(time.perf_counter() - t0)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        timer = "cuda_events"
    else:
        start_t = time.perf_counter()
        while len(times) < iters or time.perf_counter() - start_t < min_time_s:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        host_times = times
        timer = "perf_counter"
    return BenchResult(median_s=statistics.median(times), min_s=min(times), max_s=max(times),
                       p20_s=_percentile(times, 20), p80_s=_percentile(times, 80), iters=len(times), timer=timer,
                       host_s=statistics.median(host_times) if host_times else 0.0, times_s=tuple(times))


def bench_host(fn: Callable[[], Any], *, warmup: int = 10, batches: int = 20, per: int = 50) -> BenchResult:
    """Host time of one call of `fn` (what the caller's thread spends; the GPU runs on asynchronously):
    `warmup` calls, then `batches` runs of `per` back-to-back calls, each timed with perf_counter as a
    whole and divided by `per`. With torch and a GPU the device is synchronized after the warm-up and
    after every batch (outside the timing), so the launch queue never fills and blocks the host.
    times_s holds the per-call time of each batch; median_s is their median (timer "host")."""
    _check_bench_args(fn, warmup, 1, "auto", 0.0)
    from .errors import ArgumentError

    for arg, value in (("batches", batches), ("per", per)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_ITERS:
            raise ArgumentError(f"{arg}: expected an integer in [1, {MAX_ITERS}], got {value!r}")
    sync = None
    try:
        import torch

        if torch.cuda.is_available():
            sync = torch.cuda.synchronize
    except ImportError:
        pass
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times: list[float] = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        times.append((time.perf_counter() - t0) / per)
        if sync is not None:
            sync()
    med = statistics.median(times)
    return BenchResult(median_s=med, min_s=min(times), max_s=max(times), p20_s=_percentile(times, 20),
                       p80_s=_percentile(times, 80), iters=len(times), timer="host", host_s=med, times_s=tuple(times))


def capture_graph(fn: Callable[[], Any], warmup: int = 2, reps: int = 1) -> tuple[Any, Any]:
    """(graph, output): `reps` calls of `fn` captured in one torch.cuda.CUDAGraph, after `warmup` eager calls
    on a side stream (torch's recipe: lazy initialization, JIT compiles, module loads and allocator growth
    happen outside the capture, and the side stream keeps the warm-up's allocations out of the default
    stream's pool). The output is the last captured call's: replaying the graph rewrites it in place. `fn`
    must be capturable (a failed capture raises torch's error). Needs a GPU (DeviceError otherwise)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        from .errors import DeviceError

        raise DeviceError("capture_graph: no CUDA GPU is available (a CUDA graph needs one)")
    from .errors import ArgumentError

    for name, v, lo in (("warmup", warmup, 0), ("reps", reps, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ArgumentError(f"{name}: expected an int >= {lo}, got {v!r}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(reps):
            out = fn()
    return graph, out


def bench_graph(fn: Callable[[], Any], **bench_kwargs: Any) -> BenchResult:
    """Time `fn` captured in a CUDA graph: `bench` of the graph's replay (same keywords), so the
    figure has no Python or launch overhead at all. `fn` runs once eagerly first, outside the
    capture (JIT compiles, module loads, allocator growth; `capture_graph`); it must be capturable.
    Needs a GPU (DeviceError otherwise); a failed capture raises torch's error.
    """
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        from .errors import DeviceError

        raise DeviceError("bench_graph: no CUDA GPU is available (a CUDA graph needs one)")
    graph, _ = capture_graph(fn, warmup=1)
    torch.cuda.synchronize()
    return bench(graph.replay, **{"device": "cuda", **bench_kwargs})


def _float64(x: Any) -> np.ndarray:
    if is_torch(x):
        return x.detach().to("cpu").double().numpy()
    return as_numpy(x).astype(np.float64)


def _calc_diff_torch(x: Any, y: Any) -> float:
    # On the tensors' own device, as DeepGEMM's helper: copying a [4096, 129280] result to the host in
    # float64 took most of a second per call of its tests.
    if tuple(x.shape) != tuple(y.shape):
        from .errors import ShapeError

        raise ShapeError(f"calc_diff: expected equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    a = x.detach().double()
    b = y.detach().to(a.device).double()
    denom = float((a * a + b * b).sum())
    if denom == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (a * b).sum() / denom)


def calc_diff(x: Any, y: Any) -> float:
    """DeepGEMM's similarity gap: 1 - 2*sum(x*y) / sum(x^2 + y^2), in float64 (0 = identical). Two torch
    tensors are compared on x's device; anything else through numpy."""
    if is_torch(x) and is_torch(y):
        return _calc_diff_torch(x, y)
    a, b = _float64(x), _float64(y)
    if a.shape != b.shape:
        from .errors import ShapeError

        raise ShapeError(f"calc_diff: expected equal shapes, got {a.shape} and {b.shape}")
    denom = float((a * a + b * b).sum())
    if denom == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (a * b).sum() / denom)
