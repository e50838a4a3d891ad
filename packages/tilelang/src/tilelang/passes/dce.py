"""Dead-code elimination: buffers never read (and their writes), unused lets, empty loops and ifs."""

from __future__ import annotations

from ..ir.nodes import (
    Alloc,
    Buffer,
    For,
    If,
    Let,
    PrimFunc,
    Seq,
    Stmt,
    Var,
)
from ..ir.visit import all_exprs, buffers_read, map_stmt


def _empty(s: Stmt | None) -> bool:
    return s is None or (isinstance(s, Seq) and not s.body)


def _writes_only(s: Stmt, dead: set[Buffer]) -> bool:
    """A statement whose only effect is writing dead buffers (an allocation of one counts)."""
    if isinstance(s, Alloc):
        return s.buffer in dead
    if s.children() or s.side_effects:
        return False
    w = s.writes()
    return bool(w) and w <= dead


def dce(func: PrimFunc) -> PrimFunc:
    body = func.body
    for _ in range(4):  # removing one dead buffer can make another dead
        read = buffers_read(body)
        allocated = {s.buffer for s in _allocs(body)}
        dead = {b for b in allocated if b not in read}
        used_vars = {e for e in all_exprs(body) if isinstance(e, Var)}

        def rewrite(s: Stmt, dead: set[Buffer] = dead, used_vars: set = used_vars) -> Stmt | None:
            if _writes_only(s, dead):
                return None
            if isinstance(s, Let) and s.var not in used_vars:
                return None
            if isinstance(s, For) and _empty(s.body):
                return None
            if isinstance(s, If) and _empty(s.then) and _empty(s.orelse):
                return None
            return s

        new = map_stmt(body, rewrite) or Seq([])
        if not dead and _same_size(new, body):
            body = new
            break
        body = new
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source)


def _allocs(s: Stmt) -> list[Alloc]:
    from ..ir.visit import walk_stmts

    return [x for x in walk_stmts(s) if isinstance(x, Alloc)]


def _same_size(a: Stmt, b: Stmt) -> bool:
    from ..ir.visit import walk_stmts

    return sum(1 for _ in walk_stmts(a)) == sum(1 for _ in walk_stmts(b))


__all__ = ["dce"]
