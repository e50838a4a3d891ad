"""The pass list for each target, in one readable place.

interp runs tile ops directly (it is the semantic oracle), so it only gets the cleanups; cpu
lets gemm read in-bounds A tiles in place, lowers every tile op except gemm to loops (gemm becomes a
call to the C micro-kernel), fuses
adjacent T.Parallel loops, and marks vectorizable loops for the C compiler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..ir.nodes import PrimFunc
from ..ir.verifier import verify
from .checks import check_shapes
from .dce import dce
from .elide_copies import elide_gemm_copies
from .fuse_parallel import fuse_parallel
from .lower_tile_ops import lower_tile_ops
from .simplify import simplify
from .vectorize import vectorize_hints

log = logging.getLogger("tilelang.passes")

Pass = Callable[[PrimFunc], PrimFunc]


def verify_lowered(func: PrimFunc) -> PrimFunc:
    """verify, allowing what lowering introduces (gemm operands read in place from global memory)."""
    return verify(func, allow_global_gemm=True)


PIPELINES: dict[str, list[Pass]] = {
    "interp": [check_shapes, simplify, dce, verify],
    "cpu": [check_shapes, simplify, dce, elide_gemm_copies, lower_tile_ops, simplify, fuse_parallel, dce,
            vectorize_hints, verify_lowered],
    "cuda": [check_shapes, simplify, dce, verify],
}


def run_pipeline(func: PrimFunc, target: str, pass_configs: dict | None = None) -> PrimFunc:
    disabled = set((pass_configs or {}).get("disable_passes", ()))
    for p in PIPELINES[target]:
        if p.__name__ in disabled:
            log.debug("pass %s disabled by pass_configs", p.__name__)
            continue
        func = p(func)
    return func
