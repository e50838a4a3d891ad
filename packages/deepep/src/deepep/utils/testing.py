"""Benchmark helpers with DeepEP's names: bench (CUDA events or perf_counter) and bench_kineto."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["bench", "bench_kineto"]


def bench(fn: Callable[[], Any], num_warmups: int = 50, num_tests: int = 50, post_fn: Callable | None = None,
          flush_l2: bool = True) -> tuple[float, float, float]:
    """(average, min, max) seconds per call of fn (CUDA events on a GPU, perf_counter otherwise)."""
    cuda = torch.cuda.is_available()
    for _ in range(num_warmups):
        fn()
    times = []
    for _ in range(num_tests):
        if cuda:
            if flush_l2:
                torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda").zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if post_fn is not None:
            post_fn()
    times = times[1:] if len(times) > 1 else times
    return sum(times) / len(times), min(times), max(times)


def bench_kineto(fn: Callable[[], Any], kernel_names: str | tuple[str, ...], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: str | None = None, flush_l2: bool = True,
                 barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1) -> Any:
    """Average GPU seconds per call in kernels whose name contains each of kernel_names (torch profiler).
    Without CUDA: the call's wall time split evenly over the names. With num_kernels_per_period > 1 each
    name gives a tuple of that many per-launch times (DeepEP's send/recv split)."""
    single = isinstance(kernel_names, str)
    names = (kernel_names,) if single else tuple(kernel_names)
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        n = max(1, min(num_tests, 3))
        for _ in range(n):
            fn()
        per = (time.perf_counter() - t0) / n / len(names)
        vals = [per if num_kernels_per_period == 1 else (per / num_kernels_per_period,) * num_kernels_per_period
                for _ in names]
        return vals[0] if single else tuple(vals)
    fn()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(num_tests):
            fn()
        torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    durs: dict[str, list[float]] = {n: [] for n in names}
    for ev in prof.events():
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue
        for n in names:
            if n in ev.name:
                durs[n].append(ev.time_range.elapsed_us() / 1e6)
    vals: list[Any] = []
    for n in names:
        d = durs[n]
        if num_kernels_per_period == 1:
            vals.append(sum(d) / num_tests)
        else:
            per = [sum(d[i::num_kernels_per_period]) / num_tests for i in range(num_kernels_per_period)]
            vals.append(tuple(per))
    return vals[0] if single else tuple(vals)
