"""@tilelang.autotune(configs=[...]) stacked on @tilelang.jit: compile candidates in parallel, time them,
keep the best per (kernel, arguments, configs, target, machine) in a JSON cache under tilehal.cache_dir().

Which config a call gets, in order: the tunables the caller passed (no tuning); the one tuned before (the
cache); the `defaults` table's entry for these arguments (no tuning: a first call is fast) unless tuning is
asked for (`tuner.tune(...)` or TILELANG_AUTOTUNE=1); else tuning now. TILELANG_AUTOTUNE=0 never tunes
(the default entry, else the first config). A cache entry that is unreadable, for another key, or names a
config outside `configs` is never used: it is logged (WARNING) and replaced by a fresh tuning."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tilehal

from ..__about__ import __version__
from ..errors import CompileError
from .kernel import JITFactory, JITKernel, _hashable, compile

log = logging.getLogger("tilelang.autotune")
CACHE_FORMAT = 2  # bumped when the record or the key changes: older records are then simply not found
ENV = "TILELANG_AUTOTUNE"  # "1": tune even where a default config exists; "0": never tune


@dataclass
class AutotuneResult:
    config: dict
    latency_ms: float  # nan for a default config (not timed)
    from_cache: bool
    timings: dict[str, float]
    source: str = "tuned"  # "tuned", "cache" or "default"


def _canon(cfg: Any) -> str:
    return json.dumps(cfg, sort_keys=True, default=str)


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
                 use_cache: bool, progress: bool, defaults: Mapping | Callable[..., dict | None] | None = None) -> None:
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
        if defaults is not None and not (callable(defaults) or isinstance(defaults, Mapping)):
            raise tilehal.ArgumentError(f"autotune: defaults must be a dict (positional arguments -> config) or a "
                                        f"callable of the factory arguments, got {type(defaults).__name__}")
        self.defaults = defaults
        self._kernels: dict[Any, JITKernel] = {}
        self.last_result: AutotuneResult | None = None
        functools.update_wrapper(self, factory.fn)

    def _key(self, args: tuple, kwargs: dict, configs: list[dict]) -> str:
        fn = self.factory.fn
        try:
            src = inspect.getsource(fn)
        except OSError:
            src = fn.__qualname__
        payload = repr((CACHE_FORMAT, __version__, fn.__module__, fn.__qualname__, src, _hashable(_shapes(args)),
                        _hashable(_shapes(kwargs)), [_hashable(c) for c in configs], self.factory.target,
                        _machine(self.factory.target)))
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def default_config(self, args: tuple, kwargs: dict, configs: list[dict]) -> dict | None:
        """The defaults table's config for this call (None: no entry). Dict tables are keyed by the tuple of
        positional arguments (tensors by (shape, dtype)), with "*" as the entry for any call."""
        d = self.defaults
        if d is None:
            return None
        if callable(d):
            cfg = d(*args, **kwargs)
        else:
            key = tuple(_shapes(a) for a in args)
            cfg = d.get(key, d.get(key[0] if len(key) == 1 else None, d.get("*")))
        if cfg is None:
            return None
        names = {k for c in configs for k in c}
        if not isinstance(cfg, dict) or not set(cfg) <= names:
            raise tilehal.ArgumentError(f"autotune {self.factory.fn.__name__}: default config for {args!r} must be a "
                                        f"dict of tunable parameters {sorted(names)}, got {cfg!r}")
        return cfg

    def _read_cache(self, path: Path, key: str, configs: list[dict]) -> dict | None:
        """The cache record at `path` if it is valid for `key` and names one of `configs`; None if there is none.
        A record that exists but fails a check is reported (WARNING) and None returned: it is re-tuned and
        overwritten, never used."""
        if not path.exists():
            return None
        try:
            rec = json.loads(path.read_text())
            if not isinstance(rec, dict):
                raise ValueError(f"not a JSON object ({type(rec).__name__})")
            if rec.get("format") != CACHE_FORMAT or rec.get("key") != key:
                raise ValueError(f"written for another key or format ({rec.get('key')!r}, {rec.get('format')!r})")
            cfg = rec.get("config")
            if not isinstance(cfg, dict) or _canon(cfg) not in {_canon(c) for c in configs}:
                raise ValueError(f"config {cfg!r} is not one of the {len(configs)} candidates")
            lat = rec.get("latency_ms")
            if not isinstance(lat, (int, float)) or not math.isfinite(lat) or lat < 0:
                raise ValueError(f"latency_ms {lat!r} is not a finite non-negative number")
            if not isinstance(rec.get("timings", {}), dict):
                raise ValueError("timings is not an object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            log.warning("autotune cache entry %s is unusable (%s); tuning again and replacing it", path, e)
            return None
        # the candidate list's own object (equal by value), so the kernel gets exactly a listed config
        rec["config"] = next(c for c in configs if _canon(c) == _canon(rec["config"]))
        return rec

    def _compile(self, args: tuple, kwargs: dict, cfg: dict) -> JITKernel:
        """Build one candidate. A config's "pass_configs" entry (compiler options such as cuda_persistent) is
        merged over the factory's instead of being passed to the factory function."""
        cfg = dict(cfg)
        extra = cfg.pop("pass_configs", None)
        if extra is not None and not isinstance(extra, dict):
            raise tilehal.ArgumentError(f"autotune: a config's pass_configs must be a dict, got {extra!r}")
        if self.eager:
            if extra:
                raise tilehal.ArgumentError("autotune: per-config pass_configs need a @tilelang.jit prim_func factory "
                                            "(not the eager style)")
            return self.factory.compile(*args, **{**kwargs, **cfg})
        func = self.factory.fn(*args, **{**kwargs, **cfg})
        return compile(func, out_idx=self.factory.out_idx, target=self.factory.target,
                       pass_configs={**(self.factory.pass_configs or {}), **(extra or {})} or None)

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

    def candidates(self, *args: Any, **kwargs: Any) -> list[dict]:
        """The configs a tuning run for these arguments times (`configs`, or what the callable returns)."""
        configs = list(self.configs(*args, **kwargs) if callable(self.configs) else self.configs)
        if not configs:
            raise tilehal.ArgumentError("autotune: configs is empty")
        return configs

    def build_candidates(self, *args: Any, **kwargs: Any) -> list[tuple[dict, JITKernel | None, str]]:
        """Compile every candidate for these arguments without running any (in parallel, as a tuning run does):
        [(config, kernel or None, error)]. On a machine without the GPU this warms the kernel and binary caches
        that a later tuning run on the GPU reads (same compiler, same sources)."""
        configs = self.candidates(*args, **kwargs)
        out: list[tuple[dict, JITKernel | None, str]] = []
        with ThreadPoolExecutor(self.max_workers) as pool:
            futs = [pool.submit(self._compile, args, kwargs, cfg) for cfg in configs]
            for cfg, fut in zip(configs, futs):
                try:
                    out.append((cfg, fut.result(), ""))
                except (CompileError, tilehal.TileStackError, ValueError) as e:
                    out.append((cfg, None, str(e)))
        return out

    def tune(self, *args: Any, **kwargs: Any) -> JITKernel:
        """Tune for these arguments now (even where a default config exists or a record is cached) and
        cache the winner; later calls with the same arguments get it."""
        return self._tune(args, kwargs, force=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kernel = self._tune(args, kwargs)
        if not self.eager:
            return kernel
        from .eager import run

        _, tensors, _ = self.factory.split(args, kwargs)
        return run(kernel, [tensors[n] for n in self.factory.tensor_names])

    def _tune(self, args: tuple, kwargs: dict, force: bool = False) -> JITKernel:
        configs = list(self.configs(*args, **kwargs) if callable(self.configs) else self.configs)
        if not configs:
            raise tilehal.ArgumentError("autotune: configs is empty")
        if not all(isinstance(c, dict) for c in configs):
            raise tilehal.ArgumentError(f"autotune: every config must be a dict of factory keyword arguments, got "
                                        f"{[c for c in configs if not isinstance(c, dict)][:3]!r}")
        bad = [c for c in configs if not isinstance(c.get("pass_configs", {}), dict)]
        if bad:
            raise tilehal.ArgumentError(f"autotune: a config's pass_configs must be a dict, got {bad[0]!r}")
        given = self._given_tunables(args, kwargs, configs)
        if given:  # as in the public TileLang: explicitly passed tunables mean no tuning
            log.info("autotune %s: tunable parameter(s) %s passed explicitly; building that config without tuning",
                     self.factory.fn.__name__, given)
            return self._compile(args, kwargs, {})
        key = self._key(args, kwargs, configs)
        if key in self._kernels and not force:
            return self._kernels[key]
        name = self.factory.fn.__name__
        path = autotune_cache_dir() / f"{key}.json"
        if self.use_cache and not force:
            rec = self._read_cache(path, key, configs)
            if rec is not None:
                try:
                    kernel = self._compile(args, kwargs, rec["config"])
                except (CompileError, tilehal.TileStackError, ValueError) as e:
                    log.warning("autotune %s: cached config %s no longer compiles (%s); tuning again", name,
                                rec["config"], e)
                else:
                    kernel.config, kernel.latency = rec["config"], rec["latency_ms"]
                    self.last_result = AutotuneResult(rec["config"], rec["latency_ms"], True, rec.get("timings", {}),
                                                      "cache")
                    self._kernels[key] = kernel
                    log.debug("autotune cache hit %s -> %s", path.name, rec["config"])
                    return kernel
        mode = os.environ.get(ENV, "")
        if not force and mode != "1":
            cfg = self.default_config(args, kwargs, configs)
            if cfg is None and mode == "0":
                cfg = configs[0]
                log.info("autotune %s: %s=0 and no default config for %r: building the first config %s", name, ENV,
                         args, cfg)
            if cfg is not None:
                kernel = self._compile(args, kwargs, cfg)
                kernel.config, kernel.latency = cfg, float("nan")
                self.last_result = AutotuneResult(cfg, float("nan"), False, {}, "default")
                self._kernels[key] = kernel
                log.debug("autotune %s: default config %s for %r (not tuned; tuner.tune(...) or %s=1 tunes)", name,
                          cfg, args, ENV)
                return kernel
        kernel = self._search(args, kwargs, configs, name)
        ms, cfg = kernel.latency, kernel.config
        rec = {"format": CACHE_FORMAT, "key": key, "config": cfg, "latency_ms": ms, "timings": self.last_result.timings,
               "kernel": self.factory.fn.__qualname__, "args": repr(args), "target": kernel.target,
               "machine": _machine(self.factory.target)}
        if self.use_cache:
            tmp = path.with_suffix(f".{os.getpid()}.{id(self)}.tmp")
            tmp.write_text(json.dumps(rec, indent=1, default=str))
            os.replace(tmp, path)  # atomic: a reader sees the old record or the new one, never half of one
        self._kernels[key] = kernel
        return kernel

    def _search(self, args: tuple, kwargs: dict, configs: list[dict], name: str) -> JITKernel:
        """Compile every candidate (threads: NVRTC and the C compiler release the GIL), check and time each;
        the fastest correct one, with last_result set."""
        compiled: list[tuple[dict, JITKernel | None, str]] = []
        with ThreadPoolExecutor(self.max_workers) as pool:
            futs = {pool.submit(self._compile, args, kwargs, cfg): i for i, cfg in enumerate(configs)}
            done: dict[int, tuple[dict, JITKernel | None, str]] = {}
            for fut in tilehal.progress(as_completed(futs), desc=f"autotune {name}: compile", total=len(futs),
                                        disable=not self.progress, unit="config"):
                cfg = configs[futs[fut]]
                try:
                    done[futs[fut]] = (cfg, fut.result(), "")
                except (CompileError, tilehal.TileStackError, ValueError) as e:
                    log.debug("autotune: config %s failed to compile: %s", cfg, e)
                    done[futs[fut]] = (cfg, None, str(e))
            compiled = [done[i] for i in range(len(configs))]
        best: tuple[float, dict, JITKernel] | None = None
        timings: dict[str, float] = {}
        shared: tuple | None = None  # (parameter signature, inputs): made once, every candidate runs on them
        for cfg, kernel, _err in tilehal.progress(compiled, desc=f"autotune {name}: bench", disable=not self.progress,
                                                  unit="config"):
            if kernel is None:
                continue
            prof = kernel.get_profiler()
            sig = _param_signature(kernel)
            if shared is not None and shared[0] == sig:
                prof._inputs = shared[1]
            else:
                shared = (sig, prof.inputs())
            if self.ref_prog is not None:
                try:
                    prof.assert_allclose(self.ref_prog, atol=self.atol, rtol=self.rtol)
                except AssertionError as e:
                    log.debug("autotune: config %s gave wrong results: %s", cfg, e)
                    continue
            ms = prof.do_bench(warmup=self.warmup, rep=self.rep)  # time budgets in ms
            timings[_canon(cfg)] = ms
            if best is None or ms < best[0]:
                best = (ms, cfg, kernel)
        if best is None:
            errs = "; ".join(f"{c}: {e}" for c, k, e in compiled if k is None)[:2000]
            raise CompileError(f"autotune {name}: no config compiled and passed ({errs})")
        ms, cfg, kernel = best
        kernel.config, kernel.latency = cfg, ms
        self.last_result = AutotuneResult(cfg, ms, False, timings, "tuned")
        return kernel


def autotune(configs: Sequence[dict] | Callable[..., Sequence[dict]], warmup: float = 5, rep: float = 20,
             max_workers: int | None = None, ref_prog: Callable | None = None, atol: float = 1e-2,
             rtol: float = 1e-2, cache: bool = True, progress: bool = True,
             defaults: Mapping | Callable[..., dict | None] | None = None,
             **_: Any) -> Callable[[JITFactory], AutoTuner]:
    """Decorator: pick the fastest of `configs` (dicts of factory keyword arguments) per call signature.

    `warmup` and `rep` are per-candidate time budgets in ms (as in do_bench). When the caller passes
    any tunable parameter explicitly, that configuration is built directly, without tuning. `defaults`
    (a dict from the tuple of positional arguments, or "*", to a config; or a callable of the factory
    arguments returning a config or None) gives a first call its config without tuning (see the module
    docstring for the order)."""

    def wrap(factory: Any) -> AutoTuner:
        return AutoTuner(factory, configs, warmup, rep, max_workers, ref_prog, atol, rtol, cache, progress, defaults)

    return wrap


def _param_signature(kernel: JITKernel) -> Any:
    """What the profiler's random inputs depend on: each parameter's shape and dtype, and the outputs."""
    try:
        return (repr([(str(getattr(p, "shape", "")), str(getattr(p, "dtype", ""))) for p in kernel.params]),
                tuple(kernel.out_idx), getattr(kernel, "target", ""))
    except Exception:  # noqa: BLE001 - no signature: inputs are not shared
        return object()


def _shapes(x: Any) -> Any:
    """Tensors in a cache key stand for their shape and dtype."""
    if isinstance(x, dict):
        return {k: _shapes(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return ("tensor", tuple(int(s) for s in x.shape), str(x.dtype))
    return x
