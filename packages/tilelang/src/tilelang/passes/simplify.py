"""Constant folding and algebraic identities (x+0, x*1, x*0 for ints, x//1, constant conditions)."""

from __future__ import annotations

import operator

from ..ir import dtypes as dt
from ..ir.nodes import BinOp, Cast, Const, Expr, For, If, Not, PrimFunc, Select, Seq, Stmt
from ..ir.visit import Transformer

_FOLD = {"+": operator.add, "-": operator.sub, "*": operator.mul, "max": max, "min": min,
         "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
         "!=": operator.ne}


def _c(e: Expr) -> object:
    return e.value if isinstance(e, Const) else None


def _is(e: Expr, v: object) -> bool:
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value == v


class Simplifier(Transformer):
    def expr(self, e: Expr) -> Expr:
        e = super().expr(e)
        if isinstance(e, BinOp):
            return self.binop(e)
        if isinstance(e, Not) and isinstance(e.a, Const):
            return Const(not e.a.value, "bool")
        if isinstance(e, Select) and isinstance(e.cond, Const):
            chosen = e.a if e.cond.value else e.b
            return chosen if chosen.dtype == e.dtype else Cast(chosen, e.dtype)
        if isinstance(e, Cast) and isinstance(e.value, Const) and e.dtype in ("float32", "float64", "int32", "int64"):
            v = e.value.value
            return Const(float(v) if dt.is_float(e.dtype) else int(v), e.dtype)
        return e

    def binop(self, e: BinOp) -> Expr:
        a, b, op = e.a, e.b, e.op
        is_int = dt.is_int(e.dtype)
        if isinstance(a, Const) and isinstance(b, Const):
            x, y = a.value, b.value
            if op in ("and", "or"):
                return Const(bool(x and y) if op == "and" else bool(x or y), "bool")
            if op in _FOLD and (is_int or op in ("<", "<=", ">", ">=", "==", "!=")):
                v = _FOLD[op](x, y)
                return Const(v, e.dtype, a.weak and b.weak) if e.dtype != "bool" else Const(bool(v), "bool")
            if is_int and op in ("//", "%") and y != 0:
                return Const(x // y if op == "//" else x % y, e.dtype, a.weak and b.weak)
            return e  # float folding would round differently from the target: leave it to the target
        if op == "and":
            if isinstance(a, Const):
                return b if a.value else Const(False, "bool")
            if isinstance(b, Const):
                return a if b.value else Const(False, "bool")
        if op == "or":
            if isinstance(a, Const):
                return Const(True, "bool") if a.value else b
            if isinstance(b, Const):
                return Const(True, "bool") if b.value else a
        if not is_int:
            return e
        if op == "+":
            if _is(a, 0):
                return b
            if _is(b, 0):
                return a
        if op == "-" and _is(b, 0):
            return a
        if op == "*":
            if _is(a, 1):
                return b
            if _is(b, 1):
                return a
            if _is(a, 0) or _is(b, 0):
                return Const(0, e.dtype)
        if op == "//" and _is(b, 1):
            return a
        if op == "%" and _is(b, 1):
            return Const(0, e.dtype)
        # (x * c) // c -> x and (x * c) % c -> 0 for positive c
        if op in ("//", "%") and isinstance(b, Const) and b.value > 0 and isinstance(a, BinOp) and a.op == "*" \
                and (_is(a.b, b.value) or _is(a.a, b.value)):
            return (a.a if _is(a.b, b.value) else a.b) if op == "//" else Const(0, e.dtype)
        return e

    def stmt(self, s: Stmt) -> Stmt | None:
        s = super().stmt(s)
        if isinstance(s, If) and isinstance(s.cond, Const):
            return s.then if s.cond.value else (s.orelse or Seq([]))
        if isinstance(s, For) and _is(s.extent, 0):
            return None
        if isinstance(s, For) and _is(s.extent, 1) and s.kind != "parallel":
            start = s.start

            class _Sub(Transformer):
                def expr(self, x: Expr) -> Expr:
                    return start if x is s.var else super().expr(x)

            return _Sub().stmt(s.body)
        if isinstance(s, Seq):
            flat: list[Stmt] = []
            for c in s.body:
                if isinstance(c, Seq) and not _declares(c):
                    flat.extend(c.body)
                else:
                    flat.append(c)
            return Seq(flat, loc=s.loc)
        return s


def _declares(s: Seq) -> bool:
    from ..ir.nodes import Alloc, Let

    return any(isinstance(c, (Alloc, Let)) for c in s.body)


def simplify_expr(e: Expr) -> Expr:
    return Simplifier().expr(e)


def simplify(func: PrimFunc) -> PrimFunc:
    body = Simplifier().stmt(func.body) or Seq([])
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source)


__all__ = ["Simplifier", "simplify", "simplify_expr"]
