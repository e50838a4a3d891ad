"""Run a function on N local ranks of a Gloo group: how deepep's own multi-process tests run.

    results = run_on_ranks(4, "/path/to/workers.py", "check_dispatch", timeout_s=60, seed=1)

The worker file is loaded by path in each child (test modules are not importable by name), the
function is called as `fn(rank, world_size, **kwargs)` with the default group initialized, and
its return values come back in rank order. Children are forked from a server that preloaded
torch, so a group starts in well under a second after the first. A child that does not finish
by the deadline is killed, and the call raises with every child's traceback.
"""

from __future__ import annotations

import datetime
import importlib.util
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        # Not "fork": the parent may already run OpenMP or CUDA, which do not survive a fork.
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "deepep"])
    return _CTX


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"_deepep_worker_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _child(rank: int, world: int, store_path: str, path: str, name: str, kwargs: dict, results, pg_timeout_s: float,
           env: dict, backend: str) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        out = _load(path, name)(rank, world, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including the CommTimeoutError a test may expect
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # Flush the queue's feeder thread, then skip the process group's destructor: with a dead
        # peer it could wait for Gloo's own timeout.
        results.close()
        results.join_thread()
        os._exit(0)


def run_on_ranks(world_size: int, path: str, name: str, *, timeout_s: float = 120.0, pg_timeout_s: float = 30.0,
                 allow_missing: frozenset[int] | set[int] = frozenset(), env: dict[str, str] | None = None,
                 backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run `name` from the file `path` on `world_size` ranks; returns the per-rank results.

    Ranks in `allow_missing` may die without reporting (their result is None). With
    backend="nccl", rank r uses GPU r. Children inherit this process's environment (plus `env`).
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="deepep-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, world_size, store, os.path.abspath(path), name, kwargs, results,
                                                  pg_timeout_s, dict(env or {}), backend), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    r, status, value = results.get(timeout=min(left, 0.5))
                    got[r] = (status, value)
                except queue.Empty:
                    alive = [i for i, p in enumerate(procs) if p.is_alive()]
                    if all(i in got or i in allow_missing for i in range(world_size) if i not in alive) and \
                            not alive:
                        break
        finally:
            for p in procs:
                p.join(timeout=0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in got and r not in allow_missing]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nranks {missing} did not report within {timeout_s:.0f} s"
        raise AssertionError(f"run_on_ranks({world_size}, {name}) failed:\n{msg}")
    return [got[r][1] if r in got else None for r in range(world_size)]
