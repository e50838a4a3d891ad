"""Fuse adjacent T.Parallel loop nests with the same extents when no iteration reads another's result.

Legal when every buffer that one nest writes and the other touches is accessed with the same
index expressions (after renaming the loop variables) in both: then iteration i of the second
nest depends only on iteration i of the first.
"""

from __future__ import annotations

from ...ir.nodes import Alloc, Buffer, Const, Expr, For, If, Let, Load, PrimFunc, Seq, Stmt, Store, Var
from ...ir.printer import print_expr
from ...ir.visit import Transformer, map_stmt, stmt_exprs, walk_expr, walk_stmts


def _nest(s: Stmt) -> tuple[list[Var], list[int], Stmt] | None:
    vars_, exts = [], []
    while isinstance(s, For) and s.kind == "parallel" and isinstance(s.extent, Const) and \
            isinstance(s.start, Const) and s.start.value == 0:
        vars_.append(s.var)
        exts.append(int(s.extent.value))
        s = s.body
        if isinstance(s, Seq) and len(s.body) == 1 and isinstance(s.body[0], For):
            s = s.body[0]
    return (vars_, exts, s) if vars_ else None


def _simple(body: Stmt) -> bool:
    return all(isinstance(x, (Seq, Store, Let, If, Alloc, For)) for x in walk_stmts(body))


def _accesses(body: Stmt) -> tuple[dict[Buffer, set[str]], set[Buffer], set[Buffer]]:
    idx: dict[Buffer, set[str]] = {}
    reads: set[Buffer] = set()
    writes: set[Buffer] = set()
    for st in walk_stmts(body):
        if isinstance(st, Store):
            writes.add(st.buffer)
            idx.setdefault(st.buffer, set()).add(",".join(print_expr(i) for i in st.indices))
        if isinstance(st, Alloc):
            writes.add(st.buffer)
        for e in stmt_exprs(st):
            for x in walk_expr(e):
                if isinstance(x, Load):
                    reads.add(x.buffer)
                    idx.setdefault(x.buffer, set()).add(",".join(print_expr(i) for i in x.indices))
    return idx, reads, writes


def _rename(body: Stmt, mapping: dict[Var, Expr]) -> Stmt:
    class _R(Transformer):
        def expr(self, e: Expr) -> Expr:
            return mapping.get(e, e) if isinstance(e, Var) else super().expr(e)

    return _R().stmt(body)


def _try_fuse(a: Stmt, b: Stmt) -> Stmt | None:
    na, nb = _nest(a), _nest(b)
    if na is None or nb is None or na[1] != nb[1] or not _simple(na[2]) or not _simple(nb[2]):
        return None
    body_b = _rename(nb[2], dict(zip(nb[0], na[0])))
    ia, ra, wa = _accesses(na[2])
    ib, rb, wb = _accesses(body_b)
    for buf in (wa & (rb | wb)) | (ra & wb):
        pats = ia.get(buf, set()) | ib.get(buf, set())
        if len(pats) != 1 or buf.scope == "var":
            return None
        # a full-rank access by every loop var: distinct iterations touch distinct elements
        (pat,) = pats
        if not all(v.name in pat.split(",") for v in na[0]):
            return None
    fused: Stmt = Seq([na[2], body_b])
    for v, n in reversed(list(zip(na[0], na[1]))):
        fused = For(v, Const(0, "int32"), Const(n, "int32"), "parallel", fused, loc=a.loc)
    return fused


def fuse_parallel(func: PrimFunc) -> PrimFunc:
    def visit(s: Stmt) -> Stmt:
        if not isinstance(s, Seq):
            return s
        out: list[Stmt] = []
        for c in s.body:
            if out:
                f = _try_fuse(out[-1], c)
                if f is not None:
                    out[-1] = f
                    continue
            out.append(c)
        return Seq(out, loc=s.loc)

    body = map_stmt(func.body, visit) or Seq([])
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source)


__all__ = ["fuse_parallel"]
