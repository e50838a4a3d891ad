"""guard_global_stores: element stores to global tensors only happen in bounds (cpu target).

The public TileLang legalizes memory accesses by default, so a kernel whose last tile runs past
the end of an output (top-k with blk_m not dividing M, say) drops those stores instead of
writing past the tensor. This pass wraps each user-written `T[idx] = v` on a global tensor in
an `if` on its indices, except where the indices are provably in range (constant indices of
static dims). Tile ops guard themselves when they are lowered, so the pass runs before that.
`pass_configs={"tl.disable_safe_memory_legalize": True}` turns it off.
"""

from __future__ import annotations

import logging

from ...ir.nodes import Const, If, PrimFunc, Stmt, Store, binop, const
from ...ir.visit import Transformer

log = logging.getLogger("tilelang.backends.c")


def _in_range_statically(idx, dim) -> bool:
    return (isinstance(idx, Const) and isinstance(dim, Const) and isinstance(idx.value, int)
            and 0 <= idx.value < int(dim.value))


class _Guard(Transformer):
    def __init__(self) -> None:
        self.count = 0

    def stmt(self, s: Stmt) -> Stmt | None:
        if isinstance(s, Store) and s.buffer.scope == "global":
            conds = []
            for i, d in zip(s.indices, s.buffer.shape):
                if _in_range_statically(i, d):
                    continue
                conds.append(binop("and", binop(">=", i, const(0)), binop("<", i, d)))
            if not conds:
                return s
            cond = conds[0]
            for c in conds[1:]:
                cond = binop("and", cond, c)
            self.count += 1
            return If(cond, s, None, loc=s.loc)
        return super().stmt(s)


def guard_global_stores(func: PrimFunc) -> PrimFunc:
    g = _Guard()
    body = g.stmt(func.body)
    log.debug("guard_global_stores %s: %d store(s) guarded", func.name, g.count)
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source,
                    getattr(func, "workspace", []), getattr(func, "views", []))
