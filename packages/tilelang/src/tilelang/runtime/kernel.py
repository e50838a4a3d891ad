"""tilelang.compile / tilelang.jit -> JITKernel: argument checks, output allocation, dispatch."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tilehal

from ..backends import BACKENDS, resolve_target
from ..ir.nodes import Const, PrimFunc, Var
from ..passes.pipeline import run_pipeline

log = logging.getLogger("tilelang.runtime")


class JITKernel:
    """A compiled tile program. Call it with torch tensors or numpy arrays (outputs at out_idx are returned)."""

    def __init__(self, func: PrimFunc, out_idx: Sequence[int] | int | None = None, target: str = "auto",
                 pass_configs: dict | None = None) -> None:
        if not isinstance(func, PrimFunc):
            raise tilehal.ArgumentError(f"compile: expected a PrimFunc (from @T.prim_func), got {type(func).__name__}")
        check_compile_args(out_idx, target, pass_configs)
        self.prim_func = func
        self.requested_target = (target or "auto").lower()
        self.target = resolve_target(target)
        if self.requested_target == "auto" and not os.environ.get("TILELANG_DEFAULT_TARGET") and _gpu_machine():
            self.target = "cuda"  # a GPU machine: build for it now; CPU tensors get the host target lazily
        workspace = [func.params.index(b) for b in getattr(func, "workspace", [])]
        self.view_idx = [(func.params.index(v), func.params.index(b)) for v, b in getattr(func, "views", [])]
        n = len(func.params) - len(workspace) - len(self.view_idx)  # out_idx counts the user's parameters only
        if out_idx is None:
            idx: list[int] = []
        elif isinstance(out_idx, int):
            idx = [out_idx]
        else:
            idx = list(out_idx)
        norm = []
        for i in idx:
            if not -n <= i < n:
                raise tilehal.ArgumentError(f"out_idx: expected indices in [-{n}, {n}) for {n} parameters, got {i}")
            norm.append(i % n)
        self.workspace_idx = workspace  # T.alloc_global buffers: allocated per call like outputs, not returned
        self.out_idx = norm + workspace
        from ..pass_config import check_pass_configs

        self.pass_configs = check_pass_configs(pass_configs, self.target)
        self._impls: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._impl = self._build(self.target)
        self.compile_seconds = getattr(self._impl, "compile_seconds", 0.0)
        self.cache_hit = getattr(self._impl, "cache_hit", False)
        self._launch = _LaunchChecks(func)

    def _build(self, target: str) -> Any:
        """Lower and build for `target` once (target 'auto' builds cuda lazily, for CUDA tensors)."""
        impl = self._impls.get(target)
        if impl is not None:
            return impl
        with self._lock:
            impl = self._impls.get(target)
            if impl is None:
                backend = BACKENDS[target]
                if not hasattr(self, "_lowered"):
                    self._lowered = {}
                try:
                    if backend.compile is not None:  # lowers itself (or finds the kernel in its cache)
                        impl = backend.compile(self.prim_func, self.pass_configs,
                                               functools.partial(run_pipeline, self.prim_func, target,
                                                                 self.pass_configs))
                        if getattr(impl, "from_kernel_cache", False):  # what the skipped passes would say
                            from ..passes.pipeline import log as passes_log
                            from ..passes.pipeline import report_ignored_options

                            if passes_log.isEnabledFor(logging.DEBUG):
                                report_ignored_options(self.prim_func, target)
                    else:
                        lowered = run_pipeline(self.prim_func, target, self.pass_configs)
                        impl = backend.build(lowered, self.pass_configs)
                        self._lowered[target] = lowered
                except RecursionError:  # IR built by meta-level Python (not the parser) can nest deeply too
                    from ..errors import CompileError
                    from ..frontend.parser import too_deep

                    raise CompileError(f"{target} build of {self.prim_func.name}: {too_deep()}",
                                       self.prim_func.loc) from None
                self._impls[target] = impl
        return impl

    def _backend_for(self, args: tuple) -> str:
        if self.requested_target != "auto":
            return self.target
        if any(tilehal.is_torch(a) and a.is_cuda for a in args):
            log.debug("target auto: CUDA tensors given, running the cuda backend")
            return "cuda"
        return resolve_target("auto") if self.target == "cuda" else self.target

    @property
    def lowered(self) -> PrimFunc:
        """The prim_func after the target's IR passes (lowered now if the backend found the kernel in its
        cache without lowering)."""
        low = self._lowered.get(self.target)
        if low is None:
            low = self._lowered[self.target] = run_pipeline(self.prim_func, self.target, self.pass_configs)
        return low

    @property
    def params(self) -> list:
        return self.prim_func.params

    def get_kernel_source(self) -> str:
        """The generated CUDA C++ (target cuda), C (target cpu) or the lowered tile IR (target interp)."""
        return self._impl.source()

    def get_profiler(self, tensor_supply_type: Any = None, dynamic_shapes: dict[str, int] | None = None) -> Any:
        from ..profiler import Profiler

        return Profiler(self, tensor_supply_type, dynamic_shapes or {})

    # ------------------------------------------------------------ calling

    def _out_shape(self, i: int, dyn: dict[Var, int]) -> tuple[int, ...]:
        buf = self.params[i]
        shape = []
        for s in buf.shape:
            if isinstance(s, Const):
                shape.append(int(s.value))
            elif s in dyn:
                shape.append(dyn[s])
            else:
                raise tilehal.ShapeError(f"{buf.name}: output size {s.name} is not determined by any input")
        return tuple(shape)

    def __call__(self, *args: Any) -> Any:
        views = {v for v, _ in self.view_idx}
        n_in = len(self.params) - len(self.out_idx) - len(views)
        if len(args) == len(self.params) - len(self.workspace_idx) - len(views) and self.out_idx:
            args = tuple(a for i, a in enumerate(args) if i not in self.out_idx)  # outputs passed explicitly: ignored
        if len(args) != n_in:
            names = [p.name for i, p in enumerate(self.params) if i not in self.out_idx]
            raise tilehal.ArgumentError(f"kernel {self.prim_func.name}: expected {n_in} inputs ({', '.join(names)}), got "
                            f"{len(args)}")
        inputs = iter(args)
        full: list[Any] = [None] * len(self.params)
        for i in range(len(self.params)):
            if i not in self.out_idx and i not in views:
                full[i] = next(inputs)
                if full[i] is None:
                    raise tilehal.ShapeError(f"{self.params[i].name}: expected a torch tensor or numpy array, got None")
        in_params = [(p, a) for p, a in zip(self.params, full) if a is not None]
        target = self._backend_for(args)
        backend = BACKENDS[target]
        dyn = _bind(in_params, backend.device)
        impl = self._build(target)
        use_torch = any(tilehal.is_torch(a) for a in args)
        outs = []
        for i in self.out_idx:
            shape = self._out_shape(i, dyn)
            dtype = self.params[i].dtype
            if backend.device == "cuda":
                import torch

                dev = next(a.device for a in args if tilehal.is_torch(a))
                alloc = torch.zeros if impl.zero_output(i) else torch.empty
                full[i] = alloc(shape, dtype=tilehal.to_torch_dtype(dtype), device=dev)
            elif use_torch:
                import torch

                full[i] = torch.zeros(shape, dtype=tilehal.to_torch_dtype(dtype))
            else:
                full[i] = np.zeros(shape, dtype=tilehal.to_numpy_dtype(dtype))
            if i not in self.workspace_idx:
                outs.append(full[i])
        for v, b in self.view_idx:  # views: the underlying tensor, reshaped (no copy)
            shape = tuple(int(s.value) if isinstance(s, Const) else dyn[s] for s in self.params[v].shape)
            full[v] = full[b].view(shape) if tilehal.is_torch(full[b]) else full[b].reshape(shape)
        self._launch.check(full, dyn)
        if backend.device == "cuda":
            impl(full, dyn)
        else:
            impl([tilehal.as_numpy(a) for a in full], dyn)
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self) -> str:
        return f"<JITKernel {self.prim_func.name} target={self.target} out_idx={self.out_idx}>"


class _LaunchChecks:
    """What the compiled code assumes of a call, checked before it runs (every target): grid sizes
    computed from the T.dynamic sizes in [0, MAX_GRID] (0 runs nothing), parameters the kernel
    writes are writeable, and no written parameter shares memory with another one (the C code
    declares them `restrict`; the interpreter would see a different order of reads and writes)."""

    def __init__(self, func: PrimFunc) -> None:
        from ..ir.nodes import Kernel
        from ..ir.visit import buffers_written, walk_stmts

        self.func = func
        self.grids = [(k, d, g) for k in walk_stmts(func.body) if isinstance(k, Kernel)
                      for d, g in enumerate(k.grid) if not isinstance(g, Const)]
        params = func.params
        base = {params.index(v): params.index(b) for v, b in getattr(func, "views", [])}
        self.root = [base.get(i, i) for i in range(len(params))]  # a view's memory is its tensor's
        written = buffers_written(func.body)
        roots_written = {self.root[i] for i, p in enumerate(params) if p in written}
        self.written = [self.root[i] in roots_written for i in range(len(params))]

    def check(self, full: list[Any], dyn: dict[Var, int]) -> None:
        from ..ir.bounds import MAX_GRID, eval_int
        from ..ir.printer import print_expr

        for k, d, g in self.grids:
            n = eval_int(g, dyn)
            hi = MAX_GRID[min(d, 2)]
            if n is not None and not 0 <= n <= hi:
                sizes = ", ".join(f"{v.name}={dyn[v]}" for v in self.func.dynamic_vars if v in dyn)
                raise tilehal.ShapeError(f"{k.loc or self.func.name}: T.Kernel grid dimension {d} "
                                         f"({print_expr(g)}): expected a value in [0, {hi}], got {n} for {sizes}")
        params = self.func.params
        spans = []
        for i, (p, a) in enumerate(zip(params, full)):
            if not self.written[i] or a is None:
                continue
            if isinstance(a, np.ndarray) and not a.flags.writeable:
                raise tilehal.ArgumentError(f"{p.name}: expected a writeable array (kernel {self.func.name} writes "
                                            f"it), got a read-only numpy array")
        for i, a in enumerate(full):
            if a is not None and self.root[i] == i:
                span = _span(a)
                if span is not None:
                    spans.append((i, span))
        for x, (i, (lo_i, hi_i)) in enumerate(spans):
            for j, (lo_j, hi_j) in spans[x + 1:]:
                if (self.written[i] or self.written[j]) and lo_i < hi_j and lo_j < hi_i:
                    w = params[i].name if self.written[i] else params[j].name
                    raise tilehal.ArgumentError(
                        f"{params[i].name}, {params[j].name}: expected separate memory (kernel {self.func.name} "
                        f"writes {w}), got tensors that overlap; pass a copy")


def _span(a: Any) -> tuple[int, int] | None:
    """[first byte, end) of a tensor's memory (device pointers for CUDA tensors); None if empty."""
    if tilehal.is_torch(a):
        n = a.numel() * a.element_size()
        return (a.data_ptr(), a.data_ptr() + n) if n else None
    a = np.asarray(a)
    return (a.ctypes.data, a.ctypes.data + a.nbytes) if a.nbytes else None


def _gpu_machine() -> bool:
    """A CUDA GPU is visible (torch sees one) and a CUDA compiler is here: target "auto" means cuda."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except ImportError:
        return False
    v = tilehal.jit.cuda.compiler_versions()
    return bool(v.get("nvrtc") or v.get("nvcc"))


def _bind(pairs: list[tuple[Any, Any]], device: str = "cpu") -> dict[Var, int]:
    """Check each (param, tensor) and bind the T.dynamic sizes from the tensors' shapes."""
    dyn: dict[Var, int] = {}
    for buf, x in pairs:
        tilehal.check_tensor(x, buf.name, dtype=buf.dtype, ndim=buf.ndim, contiguous=True, device=device)
        for d, (s, actual) in enumerate(zip(buf.shape, x.shape)):
            actual = int(actual)
            if isinstance(s, Const):
                if int(s.value) != actual:
                    want = tuple(int(t.value) if isinstance(t, Const) else t.name for t in buf.shape)
                    raise tilehal.ShapeError(f"{buf.name}: expected shape {want}, got {tuple(x.shape)}")
            elif s in dyn and dyn[s] != actual:
                raise tilehal.ShapeError(f"{buf.name}: dim {d} is {s.name}={dyn[s]} from an earlier argument, "
                                         f"got {actual}")
            else:
                dyn[s] = actual
    return dyn


def check_compile_args(out_idx: Any, target: Any, pass_configs: Any) -> None:
    """Types of compile/jit's options, before anything is built (their values are checked where used)."""
    if target is not None and not isinstance(target, str):
        raise tilehal.ArgumentError(f"target: expected a string ('auto', 'cpu', 'interp', 'cuda'), got {target!r}")
    if pass_configs is not None and not isinstance(pass_configs, dict):
        raise tilehal.ArgumentError(f"pass_configs: expected a dict or None, got {type(pass_configs).__name__}")
    ok = out_idx is None or (isinstance(out_idx, int) and not isinstance(out_idx, bool)) or (
        isinstance(out_idx, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in out_idx))
    if not ok:
        raise tilehal.ArgumentError(f"out_idx: expected None, an int or a list of ints, got {out_idx!r}")


def compile(func: PrimFunc, out_idx: Sequence[int] | int | None = None, target: str = "auto",  # noqa: A001
            pass_configs: dict | None = None, **_: Any) -> JITKernel:
    """Lower and build a prim_func for `target` ("auto", "cpu", "interp", "cuda").

    Compiling the same PrimFunc object again with the same arguments returns the kernel built the
    first time (an in-process memo; a new process finds the binary in the disk cache)."""
    if not isinstance(func, PrimFunc):
        return JITKernel(func, out_idx=out_idx, target=target, pass_configs=pass_configs)
    check_compile_args(out_idx, target, pass_configs)
    key = (_hashable(out_idx), str(target).lower(), _hashable(pass_configs or {}))
    with _memo_lock:
        hit = _memo.get(func, {}).get(key)
    if hit is not None:
        return hit
    kernel = JITKernel(func, out_idx=out_idx, target=target, pass_configs=pass_configs)
    with _memo_lock:
        _memo.setdefault(func, {})[key] = kernel
    return kernel


_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_memo_lock = threading.Lock()


class JITFactory:
    """`@tilelang.jit(out_idx=...)` on a function returning a prim_func: calling it returns a cached JITKernel."""

    def __init__(self, fn: Callable[..., PrimFunc], out_idx: Any, target: str, pass_configs: dict | None) -> None:
        self.fn = fn
        self.out_idx = out_idx
        self.target = target
        self.pass_configs = pass_configs
        self.signature = inspect.signature(fn)
        self._cache: dict[Any, JITKernel] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def key(self, args: tuple, kwargs: dict) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple((k, _hashable(v)) for k, v in bound.arguments.items())

    def __call__(self, *args: Any, **kwargs: Any) -> JITKernel:
        k = self.key(args, kwargs)
        with self._lock:
            hit = self._cache.get(k)
        if hit is not None:
            return hit
        func = self.fn(*args, **kwargs)
        if isinstance(func, JITKernel):
            return func
        kernel = compile(func, out_idx=self.out_idx, target=self.target, pass_configs=self.pass_configs)
        with self._lock:
            self._cache[k] = kernel
        return kernel

    def get_tir(self, *args: Any, **kwargs: Any) -> PrimFunc:
        return self.fn(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> JITKernel:
        """The kernel for these factory arguments (same as calling the factory)."""
        return self(*args, **kwargs)

    def get_kernel_source(self, *args: Any, **kwargs: Any) -> str:
        return self(*args, **kwargs).get_kernel_source()


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)
