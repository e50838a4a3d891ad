"""Vectorization hints for C: innermost element-parallel loops get `vectorize` (-> #pragma omp simd)."""

from __future__ import annotations

from ...ir.nodes import For, PrimFunc, Seq, Stmt
from ...ir.visit import map_stmt, walk_stmts


def _innermost(s: For) -> bool:
    return not any(isinstance(x, For) for x in walk_stmts(s.body))


def vectorize_hints(func: PrimFunc) -> PrimFunc:
    def mark(s: Stmt) -> Stmt:
        if isinstance(s, For) and s.kind in ("parallel", "vectorized") and _innermost(s):
            s.annotations["vectorize"] = True
        return s

    body = map_stmt(func.body, mark) or Seq([])
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source)
