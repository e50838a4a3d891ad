"""Unswitch masked tile fills: a T.Parallel nest that stores `T.if_then_else(cond, a, b)` into a fragment
tile, with `cond` an affine comparison of the nest's indices and of values that are the same for the whole
tile (loop and block indices, lets), becomes

    if (cond holds at every index of the tile) { store a } else { the nest as written }

Causal attention's mask (`bx * bm + i >= k * bn + j`) holds for the whole tile in every KV block left of
the diagonal, so those iterations store zeros like `T.clear` and only the diagonal ones select per element;
the same for a partial last KV tile (`k * bn + j < seq_len`). The minimum of an affine form over the tile
is at a corner, so the test is one comparison of the uniform part with a constant. Same results: the
fast path runs only where every element's condition is true.

`fold_clears`: `T.clear(C)` (a fill of the whole accumulator with 0) right before a `T.gemm` into the whole
of C becomes `clear_accum=True` on the gemm (the tensor cores' first k step then ignores C: no register
zeroing per iteration; flash attention's non-causal S tile).
"""

from __future__ import annotations

from ...ir.nodes import BinOp, Const, Expr, Fill, For, Gemm, If, Load, PrimFunc, Select, Seq, Stmt, Store, Var
from ...ir.visit import walk_expr
from .common import log

_INT = ("int32", "int64", "index")


def _affine(e: Expr, idx: set[Var]) -> tuple[dict[Var, int], Expr] | None:
    """e = sum(c_v * v for v in idx) + rest, rest free of idx; None when e is not of that form."""
    if isinstance(e, Var) and e in idx:
        return {e: 1}, Const(0, e.dtype)
    if not any(isinstance(x, Var) and x in idx for x in walk_expr(e)):
        return {}, e
    if isinstance(e, BinOp) and e.op in ("+", "-"):
        a, b = _affine(e.a, idx), _affine(e.b, idx)
        if a is None or b is None:
            return None
        sign = 1 if e.op == "+" else -1
        coeffs = dict(a[0])
        for v, c in b[0].items():
            coeffs[v] = coeffs.get(v, 0) + sign * c
        return coeffs, BinOp(e.op, a[1], b[1], e.dtype)
    if isinstance(e, BinOp) and e.op == "*":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(y, Const) and isinstance(y.value, int):
                f = _affine(x, idx)
                if f is None:
                    return None
                return {v: c * y.value for v, c in f[0].items()}, BinOp("*", f[1], y, e.dtype)
    return None


def _all_true(cond: Expr, extents: dict[Var, int]) -> Expr | None:
    """A condition free of the tile's indices that holds iff `cond` holds at every index of the tile."""
    if not (isinstance(cond, BinOp) and cond.op in (">=", ">", "<=", "<")):
        return None
    if getattr(cond.a, "dtype", None) not in _INT or getattr(cond.b, "dtype", None) not in _INT:
        return None
    lo, hi = (cond.a, cond.b) if cond.op in (">=", ">") else (cond.b, cond.a)  # cond: lo >= hi (+1 if strict)
    fa, fb = _affine(lo, set(extents)), _affine(hi, set(extents))
    if fa is None or fb is None:
        return None
    coeffs = dict(fa[0])
    for v, c in fb[0].items():
        coeffs[v] = coeffs.get(v, 0) - c
    # lo - hi = rest + sum(c_v * v): its minimum over the tile puts each v at 0 or at its last index
    cmin = sum(min(0, c * (extents[v] - 1)) for v, c in coeffs.items())
    strict = cond.op in (">", "<")
    rest = BinOp("-", fa[1], fb[1], fa[1].dtype if hasattr(fa[1], "dtype") else "int32")
    return BinOp(">=", BinOp("+", rest, Const(cmin - (1 if strict else 0), "int32"), "int32"), Const(0, "int32"),
                 "bool")


def _nest(s: Stmt) -> tuple[list[For], Store] | None:
    loops = []
    while isinstance(s, For) and s.kind == "parallel":
        loops.append(s)
        s = s.body
        if isinstance(s, Seq) and len(s.body) == 1:
            s = s.body[0]
    if not loops or not isinstance(s, Store) or s.buffer.scope != "fragment":
        return None
    if not all(isinstance(lp.start, Const) and lp.start.value == 0 and isinstance(lp.extent, Const) for lp in loops):
        return None
    return loops, s


def _rebuild(loops: list[For], store: Store, value: Expr) -> Stmt:
    fresh = {lp.var: Var(lp.var.name + "_u", lp.var.dtype) for lp in loops}
    from ...ir.visit import substitute

    body: Stmt = Store(store.buffer, [substitute(i, fresh) for i in store.indices], substitute(value, fresh),
                       loc=store.loc)
    for lp in reversed(loops):
        body = For(fresh[lp.var], lp.start, lp.extent, "parallel", Seq([body]), dict(lp.annotations), loc=lp.loc)
    return body


def unswitch_masks(func: PrimFunc) -> PrimFunc:
    from ...ir.visit import Transformer

    def attempt(s: For) -> Stmt | None:
        got = _nest(s)
        if got is None:
            return None
        loops, store = got
        v = store.value
        if not isinstance(v, Select):
            return None
        extents = {lp.var: int(lp.extent.value) for lp in loops}
        if any(isinstance(x, Var) and x in extents for e in (v.a, v.b) for x in walk_expr(e)):
            return None  # the stored values vary over the tile: nothing uniform to hoist
        if any(isinstance(x, Load) for x in walk_expr(v.cond)):
            return None  # a loaded value may differ between threads: the branch must stay uniform
        test = _all_true(v.cond, extents)
        if test is None:
            return None
        log.debug("%s: masked T.Parallel store into %s unswitched (the whole tile takes the first value when the "
                  "condition holds at the tile's corner)", store.loc, store.buffer.name)
        return If(test, _rebuild(loops, store, v.a), s, loc=s.loc)

    class _Top(Transformer):  # outermost T.Parallel nests only: an inner loop's condition varies per thread
        def stmt(self, s: Stmt) -> Stmt | None:
            if isinstance(s, For) and s.kind == "parallel":
                return attempt(s) or s
            return super().stmt(s)

    import dataclasses

    return dataclasses.replace(func, body=_Top().stmt(func.body))


def _whole(r, b) -> bool:
    shape = b.static_shape()
    return (shape is not None and tuple(int(x) for x in r.extents) == tuple(shape)
            and all(isinstance(x, Const) and x.value == 0 for x in r.starts))


def fold_clears(func: PrimFunc) -> PrimFunc:
    import dataclasses

    from ...ir.visit import Transformer

    class _Fold(Transformer):
        def stmt(self, s: Stmt) -> Stmt | None:
            s = super().stmt(s)
            if not isinstance(s, Seq):
                return s
            out: list[Stmt] = []
            for st in s.body:
                prev = out[-1] if out else None
                if (isinstance(st, Gemm) and not st.clear_accum and isinstance(prev, Fill)
                        and prev.dst.buffer is st.C.buffer and st.C.buffer.scope == "fragment"
                        and isinstance(prev.value, Const) and prev.value.value == 0
                        and _whole(prev.dst, prev.dst.buffer) and _whole(st.C, st.C.buffer)):
                    log.debug("%s: T.clear(%s) folded into the next T.gemm (clear_accum)", prev.loc, st.C.buffer.name)
                    out[-1] = dataclasses.replace(st, clear_accum=True)
                    continue
                out.append(st)
            return dataclasses.replace(s, body=out) if len(out) != len(s.body) else s

    return dataclasses.replace(func, body=_Fold().stmt(func.body))


__all__ = ["fold_clears", "unswitch_masks"]
