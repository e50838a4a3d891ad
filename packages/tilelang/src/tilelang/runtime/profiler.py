"""kernel.get_profiler(): random inputs, assert_allclose against a reference, do_bench (ms)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import tilehal

from ..ir import dtypes as dt
from ..ir.nodes import Const


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
        from ..profiler import do_bench

        ins = input_tensors if input_tensors is not None else self.inputs()
        fn = func or self.kernel
        return do_bench(lambda: fn(*ins), warmup=warmup, rep=rep, **kwargs)


def _f64(x: Any) -> np.ndarray:
    if tilehal.is_torch(x):
        return x.detach().cpu().double().numpy()
    return np.asarray(x).astype(np.float64)
