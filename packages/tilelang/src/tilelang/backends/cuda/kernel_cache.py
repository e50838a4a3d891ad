"""The CUDA target's kernel cache: a compiled prim_func found again without lowering it.

A cached compile of the CUDA target (the same program compiled again, in this process or a later
one) used to run the IR passes and the whole code generation before the disk-cached cubin was
found. Here the generated CUDA source, its kernel names and shared-memory sizes are stored in
tilehal's verified disk cache under a key of the program's *structure*: every field of every IR
node (dtypes, options, annotations, layouts, kernel attributes; buffers and variables numbered by
first appearance, so two builds of one factory agree; source locations left out), the pass
configs and build options, and a stamp of the tilelang and tilehal sources (any edit of the
compiler is a new key). On a hit only the structure is walked and the cubin loaded (its own
cache); the kernels launch with the grid expressions of the program as written.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import tilehal
from tilehal.cache import content_key

from ...ir.nodes import Buffer, Kernel, PrimFunc, Seq, Var

log = logging.getLogger("tilelang.backends.cuda")

_SKIP = {"uid", "loc", "source", "parent"}
_VERSION = "tilelang-cuda-kernel-v3"  # v2: entries carry TMA descriptor specs; v3: launch threads (warp specialization)
_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(t: type) -> tuple[str, ...]:
    f = _FIELDS.get(t)
    if f is None:
        f = _FIELDS[t] = tuple(x.name for x in dataclasses.fields(t) if x.name not in _SKIP)
    return f


def structural_key(func: PrimFunc) -> str:
    """A digest of everything in `func` that code generation can read."""
    out: list[str] = []
    ids: dict[int, int] = {}
    append = out.append

    def enc(x: Any) -> None:
        if x is None or isinstance(x, (bool, int, float, str)):
            append(repr(x))
        elif isinstance(x, (list, tuple)):
            append("(")
            for y in x:
                enc(y)
            append(")")
        elif isinstance(x, dict):
            append("{")
            for k in sorted(x, key=repr):
                enc(k)
                enc(x[k])
            append("}")
        elif isinstance(x, enum.Enum):
            append(f"E{type(x).__name__}.{x.name}")
        elif dataclasses.is_dataclass(x):
            if isinstance(x, (Buffer, Var)):
                n = ids.get(id(x))
                if n is not None:
                    append(f"@{n}")
                    return
                ids[id(x)] = len(ids)
            append(type(x).__name__)
            append("<")
            for name in _fields(type(x)):
                enc(getattr(x, name))
            append(">")
        else:  # an object of another kind (a user layout function, ...): its type and text
            append(f"?{type(x).__module__}.{type(x).__qualname__}:{x!r}")

    enc(func)
    return hashlib.sha256("\x00".join(out).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _compiler_stamp() -> str:
    """The relative paths and contents of the tilelang and tilehal sources (once per process). Contents, not
    mtimes: a copy of the tree (the GPU machine's, with a cache warmed on the CPU machine) finds the same entries
    whatever its files' times."""
    from ...__about__ import __version__

    h = hashlib.sha256(f"{__version__}|{getattr(tilehal, '__version__', '')}".encode())
    for root in (Path(__file__).resolve().parents[2], Path(tilehal.__file__).resolve().parent):
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".cuh", ".h") and p.is_file():
                h.update(f"{p.relative_to(root)}|{hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def cache_key(func: PrimFunc, options: dict) -> str:
    opts = json.dumps({k: v for k, v in options.items()}, sort_keys=True, default=repr)
    return content_key(_VERSION, structural_key(func), opts, _compiler_stamp())


def top_kernels(func: PrimFunc) -> list[Kernel]:
    body = func.body.body if isinstance(func.body, Seq) else [func.body]
    return [s for s in body if isinstance(s, Kernel)]


def pack(source: str, kernels: list[tuple[str, Kernel, int]], tma: dict, threads: dict) -> bytes:
    return json.dumps({"source": source, "threads": threads,
                       "kernels": [[name, smem, [t.as_list() for t in tma.get(name, ())]]
                                   for name, _, smem in kernels]}).encode()


def unpack(func: PrimFunc, data: bytes) -> tuple[str, list[tuple[str, Kernel, int]], dict, dict] | None:
    """(source, [(kernel name, Kernel of `func`, smem bytes)], {kernel name: [TmaSpec]}, {kernel name: launch
    threads}), or None when the entry does not fit."""
    from .rules.tma import TmaSpec

    try:
        rec = json.loads(data)
        names = [(str(n), int(s)) for n, s, _ in rec["kernels"]]
        tma = {str(n): [TmaSpec(int(p), str(d), int(r), int(c), str(w)) for p, d, r, c, w in specs]
               for n, _, specs in rec["kernels"]}
        source = str(rec["source"])
        # [launch threads, persistent tiles] (+ the cluster dims of a TMA multicast kernel)
        threads = {str(n): [int(v[0]), int(v[1])] + [[int(x) for x in c] for c in v[2:3]]
                   for n, v in rec["threads"].items()}
    except (ValueError, KeyError, TypeError) as e:
        log.debug("kernel cache entry unusable (%s)", e)
        return None
    ks = top_kernels(func)
    if len(ks) != len(names):
        return None
    return source, [(n, k, s) for (n, s), k in zip(names, ks)], tma, threads


__all__ = ["cache_key", "pack", "structural_key", "top_kernels", "unpack"]
