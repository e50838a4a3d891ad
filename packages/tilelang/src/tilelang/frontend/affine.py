"""Affine forms over integer expressions: used to prove slice extents (stop - start) constant."""

from __future__ import annotations

from ..ir.nodes import BinOp, Const, Expr, Var


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
