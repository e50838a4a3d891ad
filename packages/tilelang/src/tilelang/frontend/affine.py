"""Affine forms over integer expressions: used to prove slice extents (stop - start) constant."""

from __future__ import annotations

from ..ir.nodes import BinOp, Cast, Const, Expr, Load, Var


def affine(e: Expr) -> dict[object, int] | None:
    """{Var or opaque expr id: coeff, 1: const} if `e` is affine in its variables, else None."""
    if isinstance(e, Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return {1: e.value}
    if isinstance(e, Var):
        return {e: 1}
    if isinstance(e, BinOp) and e.op in ("+", "-"):
        a, b = affine(e.a), affine(e.b)
        if a is None or b is None:
            return None
        sign = 1 if e.op == "+" else -1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + sign * v
        return {k: v for k, v in out.items() if v != 0 or k == 1}
    if isinstance(e, BinOp) and e.op == "*":
        a, b = affine(e.a), affine(e.b)
        if a is None or b is None:
            return None
        if set(a) <= {1}:
            c = a.get(1, 0)
            return {k: v * c for k, v in b.items()}
        if set(b) <= {1}:
            c = b.get(1, 0)
            return {k: v * c for k, v in a.items()}
        return None
    key = _structural_key(e)
    return None if key is None else {key: 1}


def _structural_key(e: Expr) -> object | None:
    """A hashable key equal for structurally identical loads / index expressions (the two ends of one
    slice are evaluated at the same point, so `x[0] + i` and `x[0] + i + 4` differ by 4)."""
    if isinstance(e, Const):
        return ("const", e.value, e.dtype)
    if isinstance(e, Var):
        return ("var", id(e))
    if isinstance(e, Load):
        idx = [_structural_key(i) for i in e.indices]
        return None if any(k is None for k in idx) else ("load", id(e.buffer), tuple(idx))
    if isinstance(e, BinOp):
        a, b = _structural_key(e.a), _structural_key(e.b)
        return None if a is None or b is None else ("binop", e.op, a, b)
    if isinstance(e, Cast):
        v = _structural_key(e.value)
        return None if v is None else ("cast", e.dtype, v)
    return None


def constant_difference(hi: Expr, lo: Expr) -> int | None:
    """hi - lo when it is provably a constant, else None."""
    a, b = affine(hi), affine(lo)
    if a is None or b is None:
        return _structural_difference(hi, lo)
    keys = set(a) | set(b)
    diff = {k: a.get(k, 0) - b.get(k, 0) for k in keys}
    if any(v != 0 for k, v in diff.items() if k != 1):
        return None
    return diff.get(1, 0)


def _structural_difference(hi: Expr, lo: Expr) -> int | None:
    # hi = lo + c written literally (lo may be non-affine, e.g. a floordiv)
    if isinstance(hi, BinOp) and hi.op == "+" and hi.a is lo and isinstance(hi.b, Const):
        return int(hi.b.value)
    return None
