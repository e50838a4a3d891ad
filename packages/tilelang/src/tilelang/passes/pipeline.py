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


def run_pipeline(func: PrimFunc, target: str, pass_configs: dict | None = None) -> PrimFunc:
    disabled = set((pass_configs or {}).get("disable_passes", ()))
    for p in passes_for(target, pass_configs):
        if p.__name__ in disabled:
            log.debug("pass %s disabled by pass_configs", p.__name__)
            continue
        func = p(func)
    return func
