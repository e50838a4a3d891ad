"""@tilelang.autotune(configs=[...]) stacked on @tilelang.jit: compile candidates in parallel, time them,
keep the best per (kernel, arguments, configs, target, machine) in a JSON cache under tilehal.cache_dir()."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tilehal

from ..errors import CompileError
from .kernel import JITFactory, JITKernel, _hashable, compile

log = logging.getLogger("tilelang.autotune")


@dataclass
class AutotuneResult:
    config: dict
    latency_ms: float
    from_cache: bool
    timings: dict[str, float]


def autotune_cache_dir() -> Path:
    d = tilehal.cache_dir() / "tilelang_autotune"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def _machine(target: str = "cpu") -> str:
    """The device a tuned config is best on: the CPU, and for cuda / auto targets the GPU (name,
    compute capability, SM count) when there is one."""
    try:
        c = tilehal.cpu()
        out = f"{getattr(c, 'name', '')}|{getattr(c, 'cores', '')}|{getattr(c, 'simd', '')}"
    except Exception:  # noqa: BLE001 - device description is only part of a cache key
        out = "cpu"
    if target in ("cuda", "auto"):
        try:
            import torch

            if torch.cuda.is_available():
                p = torch.cuda.get_device_properties(torch.cuda.current_device())
                out += f"|{p.name}|sm_{p.major}{p.minor}|{p.multi_processor_count}"
        except Exception:  # noqa: BLE001 - no torch / no driver: a CPU key
            pass
    return out


class AutoTuner:
    def __init__(self, factory: JITFactory, configs: Sequence[dict] | Callable[..., Sequence[dict]], warmup: int,
                 rep: int, max_workers: int | None, ref_prog: Callable | None, atol: float, rtol: float,
                 use_cache: bool, progress: bool) -> None:
        from .eager import EagerJIT

        if not isinstance(factory, (JITFactory, EagerJIT)):
            raise tilehal.ArgumentError("autotune: stack it on top of @tilelang.jit(...): @tilelang.autotune(configs=...) then "
                            "@tilelang.jit(out_idx=...)")
        self.eager = isinstance(factory, EagerJIT)
        self.factory = factory
        self.configs = configs
        self.warmup, self.rep = warmup, rep
        self.max_workers = max_workers or max(1, min(4, os.cpu_count() or 1))
        self.ref_prog, self.atol, self.rtol = ref_prog, atol, rtol
        self.use_cache = use_cache
        self.progress = progress
        self._kernels: dict[Any, JITKernel] = {}
        self.last_result: AutotuneResult | None = None
        functools.update_wrapper(self, factory.fn)

    def _key(self, args: tuple, kwargs: dict, configs: list[dict]) -> str:
        fn = self.factory.fn
        try:
            src = inspect.getsource(fn)
        except OSError:
            src = fn.__qualname__
        payload = repr((fn.__module__, fn.__qualname__, src, _hashable(_shapes(args)), _hashable(_shapes(kwargs)),
                        [_hashable(c) for c in configs], self.factory.target, _machine(self.factory.target)))
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def _compile(self, args: tuple, kwargs: dict, cfg: dict) -> JITKernel:
        if self.eager:
            return self.factory.compile(*args, **{**kwargs, **cfg})
        func = self.factory.fn(*args, **{**kwargs, **cfg})
        return compile(func, out_idx=self.factory.out_idx, target=self.factory.target,
                       pass_configs=self.factory.pass_configs)

    def _given_tunables(self, args: tuple, kwargs: dict, configs: list[dict]) -> list[str]:
        """The tunable parameters the caller passed explicitly (positionally or by keyword)."""
        sig = inspect.signature(self.factory.fn)
        try:  # keywords outside the signature (an eager function's T.const sizes) are not tunables
            bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        except TypeError:
            return []
        names = {k for c in configs for k in c}
        return sorted(n for n in names if n in bound.arguments)

    def compile(self, *args: Any, **kwargs: Any) -> JITKernel:
        """The tuned (or, with tunables given, the directly built) kernel, without running it."""
        return self._tune(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kernel = self._tune(args, kwargs)
        if not self.eager:
            return kernel
        from .eager import run

        _, tensors, _ = self.factory.split(args, kwargs)
        return run(kernel, [tensors[n] for n in self.factory.tensor_names])

    def _tune(self, args: tuple, kwargs: dict) -> JITKernel:
        configs = list(self.configs(*args, **kwargs) if callable(self.configs) else self.configs)
        if not configs:
            raise tilehal.ArgumentError("autotune: configs is empty")
        given = self._given_tunables(args, kwargs, configs)
        if given:  # as in the public TileLang: explicitly passed tunables mean no tuning
            log.info("autotune %s: tunable parameter(s) %s passed explicitly; building that config without tuning",
                     self.factory.fn.__name__, given)
            return self._compile(args, kwargs, {})
        key = self._key(args, kwargs, configs)
        if key in self._kernels:
            return self._kernels[key]
        path = autotune_cache_dir() / f"{key}.json"
        if self.use_cache and path.exists():
            try:
                rec = json.loads(path.read_text())
                kernel = self._compile(args, kwargs, rec["config"])
                kernel.config, kernel.latency = rec["config"], rec["latency_ms"]
                self.last_result = AutotuneResult(rec["config"], rec["latency_ms"], True, rec.get("timings", {}))
                self._kernels[key] = kernel
                log.debug("autotune cache hit %s -> %s", path.name, rec["config"])
                return kernel
            except (OSError, ValueError, KeyError) as e:
                log.debug("autotune cache entry %s unusable (%s); re-tuning", path, e)
        from tqdm.auto import tqdm

        name = self.factory.fn.__name__
        compiled: list[tuple[dict, JITKernel | None, str]] = []
        with ThreadPoolExecutor(self.max_workers) as pool:
            futs = [(cfg, pool.submit(self._compile, args, kwargs, cfg)) for cfg in configs]
            for cfg, fut in tqdm(futs, desc=f"autotune {name}: compile", disable=not self.progress, leave=False):
                try:
                    compiled.append((cfg, fut.result(), ""))
                except (CompileError, tilehal.TileStackError, ValueError) as e:
                    log.debug("autotune: config %s failed to compile: %s", cfg, e)
                    compiled.append((cfg, None, str(e)))
        best: tuple[float, dict, JITKernel] | None = None
        timings: dict[str, float] = {}
        for cfg, kernel, _err in tqdm(compiled, desc=f"autotune {name}: bench", disable=not self.progress,
                                     leave=False):
            if kernel is None:
                continue
            prof = kernel.get_profiler()
            if self.ref_prog is not None:
                try:
                    prof.assert_allclose(self.ref_prog, atol=self.atol, rtol=self.rtol)
                except AssertionError as e:
                    log.debug("autotune: config %s gave wrong results: %s", cfg, e)
                    continue
            ms = prof.do_bench(warmup=self.warmup, rep=self.rep)  # time budgets in ms
            timings[json.dumps(cfg, sort_keys=True, default=str)] = ms
            if best is None or ms < best[0]:
                best = (ms, cfg, kernel)
        if best is None:
            errs = "; ".join(f"{c}: {e}" for c, k, e in compiled if k is None)[:2000]
            raise CompileError(f"autotune {name}: no config compiled and passed ({errs})")
        ms, cfg, kernel = best
        kernel.config, kernel.latency = cfg, ms
        rec = {"config": cfg, "latency_ms": ms, "timings": timings, "kernel": self.factory.fn.__qualname__,
               "args": repr(args), "target": kernel.target}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rec, indent=1, default=str))
        os.replace(tmp, path)
        self.last_result = AutotuneResult(cfg, ms, False, timings)
        self._kernels[key] = kernel
        return kernel


def autotune(configs: Sequence[dict] | Callable[..., Sequence[dict]], warmup: float = 5, rep: float = 20,
             max_workers: int | None = None, ref_prog: Callable | None = None, atol: float = 1e-2,
             rtol: float = 1e-2, cache: bool = True, progress: bool = True, **_: Any) -> Callable[[JITFactory],
                                                                                                  AutoTuner]:
    """Decorator: pick the fastest of `configs` (dicts of factory keyword arguments) per call signature.

    `warmup` and `rep` are per-candidate time budgets in ms (as in do_bench). When the caller passes
    any tunable parameter explicitly, that configuration is built directly, without tuning."""

    def wrap(factory: Any) -> AutoTuner:
        return AutoTuner(factory, configs, warmup, rep, max_workers, ref_prog, atol, rtol, cache, progress)

    return wrap


def _shapes(x: Any) -> Any:
    """Tensors in a cache key stand for their shape and dtype."""
    if isinstance(x, dict):
        return {k: _shapes(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return ("tensor", tuple(int(s) for s in x.shape), str(x.dtype))
    return x
