"""`@tilelang.jit` on an eager-style function (see frontend/eager.py): specialize, cache, run.

- `f(*tensors_and_meta, **meta)` compiles the specialization for the tensors' `T.const` sizes and
  the meta arguments (cached), runs it and returns the `T.empty` outputs (a tuple when several).
- `f.compile(M=..., N=..., **meta)` returns the JITKernel (call it with the input tensors).
- `f.get_tir(...)` returns the PrimFunc, `f.get_kernel_source(...)` the generated source.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from tilehal import ArgumentError

from ..errors import CompileError
from ..frontend.eager import EagerParser, EagerResult, tensor_params
from .kernel import JITKernel, _hashable, compile

log = logging.getLogger("tilelang.runtime")

_EMPTY = inspect.Parameter.empty


class EagerJIT:
    def __init__(self, fn: Callable, target: str, pass_configs: dict | None, out_idx: Any = None) -> None:
        if out_idx is not None:
            raise ArgumentError("out_idx is only supported for @tilelang.jit factories that return a @T.prim_func; an "
                             "eager function declares its outputs with T.empty() and returns them")
        self.fn = fn
        self.target = target
        self.pass_configs = pass_configs
        self.out_idx = None
        self.signature = inspect.signature(fn)
        self.tensor_names = tensor_params(fn)
        self._kernels: dict[Any, tuple[JITKernel, EagerResult]] = {}
        self._matchers: dict[Any, dict[str, tuple[str, int]]] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    # ------------------------------------------------------------ arguments

    def split(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
        """(meta arguments, tensor arguments, T.const values given by keyword)."""
        names = list(self.signature.parameters)
        consts = {k: v for k, v in kwargs.items() if k not in self.signature.parameters}
        kw = {k: v for k, v in kwargs.items() if k in self.signature.parameters}
        try:
            bound = self.signature.bind_partial(*args, **kw)
        except TypeError as e:
            raise ArgumentError(f"{self.fn.__name__}: {e}") from None
        meta: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        for n in names:
            p = self.signature.parameters[n]
            if n in self.tensor_names:
                tensors[n] = bound.arguments.get(n)
            elif n in bound.arguments:
                meta[n] = bound.arguments[n]
            elif p.default is not _EMPTY:
                meta[n] = p.default
            elif p.kind == p.VAR_KEYWORD or p.kind == p.VAR_POSITIONAL:
                continue
            else:
                raise ArgumentError(f"{self.fn.__name__}: missing argument {n!r}")
        return meta, tensors, consts

    def _meta_key(self, meta: dict[str, Any]) -> Any:
        return tuple((k, _hashable(v)) for k, v in meta.items())

    # ------------------------------------------------------------ specialization

    def specialize(self, meta: dict[str, Any], tensors: dict[str, Any], consts: dict[str, int]
                   ) -> tuple[JITKernel, EagerResult]:
        mk = self._meta_key(meta)
        matcher = self._matchers.get(mk)
        if matcher is not None:
            values = dict(consts)
            for c, (p, d) in matcher.items():
                t = tensors.get(p)
                if c not in values and t is not None and len(t.shape) > d:
                    values[c] = int(t.shape[d])
            key = (mk, tuple(sorted(values.items())))
            with self._lock:
                hit = self._kernels.get(key)
            if hit is not None:
                return hit
        res = self._parse(meta, tensors, consts)
        kernel = compile(res.func, out_idx=res.out_idx, target=self.target, pass_configs=self.pass_configs)
        key = (mk, tuple(sorted(res.consts.items())))
        with self._lock:
            self._matchers[mk] = res.matcher
            self._kernels[key] = (kernel, res)
        log.debug("eager jit %s: specialized for %s", self.fn.__name__, res.consts)
        return kernel, res

    def _parse(self, meta: dict[str, Any], tensors: dict[str, Any], consts: dict[str, int]) -> EagerResult:
        """Parse until every T.const size is known from the start: a first pass learns the sizes that come
        from tensor annotations (the body may use them before those annotations, e.g. `splitK = K //
        split_k`), the last pass runs with all of them as Python ints. A pass that learns nothing new
        is the authoritative one, errors included."""
        given = dict(consts)
        matcher: dict[str, tuple[str, int]] = {}
        while True:
            parser = EagerParser(self.fn, meta, tensors, given, self.tensor_names)
            try:
                res = parser.parse_eager()
            except CompileError:
                learned = {k: v for k, v in parser.const_values.items() if k not in given}
                if not learned:
                    raise
                log.debug("eager jit %s: re-parsing with sizes %s", self.fn.__name__, learned)
            else:
                learned = {k: v for k, v in res.consts.items() if k not in given}
                if not learned:
                    res.matcher = {**matcher, **res.matcher}
                    return res
            matcher.update(parser.matcher)
            given.update(learned)

    def compile(self, *args: Any, **kwargs: Any) -> JITKernel:
        meta, tensors, consts = self.split(args, kwargs)
        return self.specialize(meta, tensors, consts)[0]

    def get_tir(self, *args: Any, **kwargs: Any) -> Any:
        meta, tensors, consts = self.split(args, kwargs)
        return self.specialize(meta, tensors, consts)[1].func

    def get_kernel_source(self, *args: Any, **kwargs: Any) -> str:
        return self.compile(*args, **kwargs).get_kernel_source()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        meta, tensors, consts = self.split(args, kwargs)
        missing = [n for n, t in tensors.items() if t is None]
        if missing:
            raise ArgumentError(f"{self.fn.__name__}: missing tensor argument(s) {missing} (use .compile(...) to build "
                            f"the kernel without running it)")
        kernel, _ = self.specialize(meta, tensors, consts)
        return run(kernel, [tensors[n] for n in self.tensor_names])

    def __repr__(self) -> str:
        return f"<tilelang.jit eager {self.fn.__name__}({', '.join(self.tensor_names)})>"


def run(kernel: JITKernel, inputs: list[Any]) -> Any:
    out = kernel(*inputs)
    return tuple(out) if isinstance(out, list) else out
