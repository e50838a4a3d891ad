"""Shape and bounds checks that hold for any IR (also IR built by the high-level scheduler)."""

from __future__ import annotations

from ..errors import CompileError
from ..ir.nodes import Copy, Gemm, PrimFunc
from ..ir.verifier import verify
from ..ir.visit import walk_stmts


def check_shapes(func: PrimFunc) -> PrimFunc:
    verify(func)
    for s in walk_stmts(func.body):
        if isinstance(s, Copy) and s.src.squeezed() != s.dst.squeezed():
            raise CompileError(f"T.copy: shape mismatch {tuple(s.src.extents)} vs {tuple(s.dst.extents)}", s.loc)
        if isinstance(s, Gemm):
            a, b, c = s.A.as_2d(), s.B.as_2d(), s.C.as_2d()
            m, k = (a[1], a[0]) if s.transpose_A else (a[0], a[1])
            k2, n = (b[1], b[0]) if s.transpose_B else (b[0], b[1])
            if k != k2 or tuple(c) != (m, n):
                raise CompileError(f"T.gemm: shape mismatch A {m}x{k}, B {k2}x{n}, C {tuple(c)}", s.loc)
    return func
