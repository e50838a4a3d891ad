"""Shape and bounds checks that hold for any IR (also IR built by the high-level scheduler)."""

from __future__ import annotations

from ..ir.nodes import PrimFunc
from ..ir.verifier import verify
from ..ir.visit import walk_stmts


def check_shapes(func: PrimFunc) -> PrimFunc:
    verify(func)
    for s in walk_stmts(func.body):
        s.check()  # each statement checks its own operands (T.copy / T.gemm shapes)
    return func
