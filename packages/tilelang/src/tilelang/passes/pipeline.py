"""Runs a target's ordered pass list (each backend owns its list: backends/<target>/pipeline.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..ir.nodes import PrimFunc

log = logging.getLogger("tilelang.passes")

Pass = Callable[[PrimFunc], PrimFunc]


def passes_for(target: str, pass_configs: dict | None = None) -> list[Pass]:
    from ..backends import BACKENDS

    return BACKENDS[target].passes(dict(pass_configs or {}))


# the op and loop keywords each target acts on; the others are kept in the IR and reported at DEBUG
USED_OPTIONS = {
    "interp": set(),
    "cpu": set(),  # T.Pipelined runs as a serial loop: num_stages has no meaning for the C backend
    # cuda: pipelining, T.use_swizzle, T.annotate_layout on shared buffers, wgmma choice and its wait depth
    "cuda": {"num_stages", "swizzle", "layout", "use_wgmma", "wg_wait"},
    "cuda_emu": {"num_stages", "swizzle", "layout", "use_wgmma"},  # mma.sync only: no wgmma to wait for
}


def report_ignored_options(func: PrimFunc, target: str) -> None:
    from ..ir.nodes import For
    from ..ir.visit import walk_stmts

    used = USED_OPTIONS.get(target, set())
    for s in walk_stmts(func.body):
        opts = s.user_options()
        ignored = {k: v for k, v in opts.items() if k not in used}
        if ignored:
            what = type(s).__name__ if not isinstance(s, For) else f"T.{s.kind} loop"
            log.debug("%s: %s options %s have no effect on target %s", s.loc, what, ignored, target)


def run_pipeline(func: PrimFunc, target: str, pass_configs: dict | None = None) -> PrimFunc:
    if log.isEnabledFor(logging.DEBUG):
        report_ignored_options(func, target)
    disabled = set((pass_configs or {}).get("disable_passes", ()))
    for p in passes_for(target, pass_configs):
        if p.__name__ in disabled:
            log.debug("pass %s disabled by pass_configs", p.__name__)
            continue
        func = p(func)
    return func
