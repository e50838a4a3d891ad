"""A progress bar for long host loops (autotuning, data passes): tqdm when it is installed, else a plain
one-line counter on stderr, so code that shows progress runs where tqdm is missing (the GPU machine)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("tilehal.progress")
T = TypeVar("T")


def progress(iterable: Iterable[T], *, desc: str = "", total: int | None = None, disable: bool = False,
             unit: str = "it", leave: bool = False) -> Iterator[T]:
    """Iterate over `iterable`, showing `desc: n/total`; `disable` shows nothing."""
    if disable:
        yield from iterable
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        log.debug("progress: tqdm is not installed; plain counter on stderr")
    else:
        yield from tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave)
        return
    yield from _plain(iterable, desc, total if total is not None else _len(iterable), unit)


def _len(x: Any) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None


def _plain(iterable: Iterable[T], desc: str, total: int | None, unit: str) -> Iterator[T]:
    t0, n = time.perf_counter(), 0
    out = sys.stderr
    of = f"/{total}" if total is not None else ""
    for item in iterable:
        yield item
        n += 1
        out.write(f"\r{desc}: {n}{of} {unit} ({time.perf_counter() - t0:.1f} s)")
        out.flush()
    if n:
        out.write("\n")
        out.flush()
