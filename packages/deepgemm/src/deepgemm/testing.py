"""Test and benchmark helpers with DeepGEMM's names (`deep_gemm.testing`): bench, bench_kineto, calc_diff,
count_bytes, get_arch_major, test_filter, ignore_env.

On a machine without CUDA there are no kernels to profile: bench_kineto then times the call on the CPU
(see its docstring), and get_arch_major reports 9, the architecture the CPU reference stands in for.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from tilehal import calc_diff as _calc_diff

__all__ = ["assert_bitwise_equal", "bench", "bench_kineto", "calc_diff", "count_bytes", "get_arch_major",
           "ignore_env", "test_filter"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity gap 1 - 2 sum(xy) / sum(x^2 + y^2) in float64 (0.0 when both are all zero)."""
    return float(_calc_diff(x, y))


def count_bytes(*tensors: Any) -> int:
    """Bytes of the given tensors; tuples/lists (e.g. (fp8, scales) pairs) are counted element by element."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total


def get_arch_major() -> int:
    """The CUDA compute capability's major number; 9 without a GPU (the CPU reference follows sm_90's semantics)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0]
    return 9


def _cpu_time(fn: Callable[[], Any], num_tests: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(num_tests):
        fn()
    return (time.perf_counter() - t0) / num_tests


def bench(fn: Callable[[], Any], num_warmups: int = 5, num_tests: int = 10, high_precision: bool = False) -> float:
    """Seconds per call of fn: CUDA events after warm-up and an L2 flush (perf_counter without CUDA)."""
    if not torch.cuda.is_available():
        return _cpu_time(fn, num_tests)
    torch.cuda.synchronize()
    torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda").zero_()
    for _ in range(num_warmups):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_tests):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / num_tests / 1e3


def bench_kineto(fn: Callable[[], Any], kernel_names: str | tuple[str, ...], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: str | None = None, flush_l2: bool = True,
                 with_multiple_kernels: bool = False, barrier: Callable[[], Any] | None = None) -> Any:
    """Average GPU time (seconds) per call of fn spent in kernels whose name contains each of `kernel_names`
    (a str gives one float, a tuple a tuple), measured with the torch profiler as DeepGEMM's helper does.

    deepgemm's kernels are named `deepgemm::gemm_sm90<...>`, so the names DeepGEMM's tests use ('gemm_',
    'bf16_gemm') match them. Without CUDA: the wall time of one call, split evenly over the names (so the
    sum over a tuple is the call's time, and ratios of two calls stay meaningful).
    """
    single = isinstance(kernel_names, str)
    names = (kernel_names,) if single else tuple(kernel_names)
    if not torch.cuda.is_available():
        t = _cpu_time(fn, max(1, min(num_tests, 3))) / len(names)
        return t if single else (t,) * len(names)
    if int(os.environ.get("DG_USE_NVIDIA_TOOLS", "0")):
        return 1 if single else (1,) * len(names)
    fn()
    flush = int(8e9 // 4) if flush_l2 else 0
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(num_tests):
            if flush:
                torch.empty(flush, dtype=torch.int32, device="cuda").zero_()
            if barrier is not None:
                barrier()
            fn()
        torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    totals = {n: 0.0 for n in names}
    for ev in prof.events():
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue  # kernels only (CPU-side ops would count their kernels twice)
        for n in names:
            # DeepGEMM's kernel names all contain "gemm"; ours are deepgemm::gemm_sm90<...> for both dtypes.
            if n in ev.name or ("gemm" in n and "deepgemm" in ev.name):
                totals[n] += ev.time_range.elapsed_us()
    times = tuple(totals[n] / 1e6 / num_tests for n in names)
    return times[0] if single else times


def assert_bitwise_equal(x: torch.Tensor, y: torch.Tensor, label: str = "") -> None:
    """Raise AssertionError naming the first differing element unless x and y are equal byte for byte."""
    assert x.shape == y.shape and x.dtype == y.dtype, f"{label}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
    xb, yb = x.contiguous().view(torch.uint8).flatten(), y.contiguous().view(torch.uint8).flatten()
    diff = (xb != yb).nonzero()
    if diff.numel():
        first = int(diff[0]) // x.element_size()
        raise AssertionError(f"bitwise mismatch{f' ({label})' if label else ''}: {diff.numel()} bytes differ, "
                             f"first at element {first}")


def test_filter(condition: Callable[[], bool]) -> Callable:
    """Run the decorated test only when condition() holds (else print that it was filtered)."""
    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition():
                return func(*args, **kwargs)
            print(f"{func.__name__}:\n > Filtered by {condition}\n")
            return None
        return wrapper
    return decorator


test_filter.__test__ = False  # not a pytest test


def ignore_env(name: str, condition: Callable[[], bool]) -> Callable:
    """Run the decorated function with environment variable `name` removed while condition() holds."""
    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not condition():
                return func(*args, **kwargs)
            saved = os.environ.pop(name, None)
            try:
                return func(*args, **kwargs)
            finally:
                if saved is not None:
                    os.environ[name] = saved
        return wrapper
    return decorator
