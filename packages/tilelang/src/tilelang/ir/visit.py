"""Generic traversal: `walk_*` yields nodes, `Transformer` rebuilds a tree bottom-up."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .nodes import (
    BinOp,
    Buffer,
    Call,
    Cast,
    Const,
    Expr,
    Load,
    Not,
    Region,
    Select,
    Stmt,
    Var,
)


def child_stmts(s: Stmt) -> list[Stmt]:
    return s.children()


def walk_stmts(s: Stmt) -> Iterator[Stmt]:
    yield s
    for c in s.children():
        yield from walk_stmts(c)


def child_exprs(e: Expr) -> list[Expr]:
    if isinstance(e, BinOp):
        return [e.a, e.b]
    if isinstance(e, Not):
        return [e.a]
    if isinstance(e, Call):
        return list(e.args)
    if isinstance(e, Cast):
        return [e.value]
    if isinstance(e, Select):
        return [e.cond, e.a, e.b]
    if isinstance(e, Load):
        return list(e.indices)
    return []


def walk_expr(e: Expr) -> Iterator[Expr]:
    yield e
    for c in child_exprs(e):
        yield from walk_expr(c)


def region_exprs(r: Region) -> list[Expr]:
    return list(r.starts)


def stmt_exprs(s: Stmt) -> list[Expr]:
    """Expressions directly held by `s` (not those of nested statements)."""
    return s.exprs()


def all_exprs(s: Stmt) -> Iterator[Expr]:
    for st in walk_stmts(s):
        for e in st.exprs():
            yield from walk_expr(e)


def _loaded(st: Stmt) -> set[Buffer]:
    return {x.buffer for e in st.exprs() for x in walk_expr(e) if isinstance(x, Load)}


def buffers_read(s: Stmt) -> set[Buffer]:
    out: set[Buffer] = set()
    for st in walk_stmts(s):
        out |= st.reads()
        out |= _loaded(st)
    return out


def buffers_written(s: Stmt) -> set[Buffer]:
    out: set[Buffer] = set()
    for st in walk_stmts(s):
        out |= st.writes()
    return out


class Transformer:
    """Rebuilds statements and expressions; override `expr`/`stmt` hooks and call super()."""

    def expr(self, e: Expr) -> Expr:
        if isinstance(e, (Const, Var)):
            return e
        if isinstance(e, BinOp):
            return BinOp(e.op, self.expr(e.a), self.expr(e.b), e.dtype)
        if isinstance(e, Not):
            return Not(self.expr(e.a))
        if isinstance(e, Call):
            return Call(e.fn, [self.expr(a) for a in e.args], e.dtype)
        if isinstance(e, Cast):
            return Cast(self.expr(e.value), e.dtype)
        if isinstance(e, Select):
            return Select(self.expr(e.cond), self.expr(e.a), self.expr(e.b), e.dtype)
        if isinstance(e, Load):
            return Load(e.buffer, [self.expr(i) for i in e.indices])
        raise TypeError(f"Transformer: unknown expression {type(e).__name__}")

    def region(self, r: Region) -> Region:
        return Region(r.buffer, [self.expr(x) for x in r.starts], list(r.extents), r.loc)

    def stmt(self, s: Stmt) -> Stmt | None:
        """The rebuilt statement (each statement class rebuilds itself, calling back expr/region/stmt)."""
        return s.rebuild(self)


def substitute(e: Expr, mapping: dict[Var, Expr]) -> Expr:
    class _Sub(Transformer):
        def expr(self, x: Expr) -> Expr:
            if isinstance(x, Var) and x in mapping:
                return mapping[x]
            return super().expr(x)

    return _Sub().expr(e)


def map_stmt(s: Stmt, fn: Callable[[Stmt], Stmt | None]) -> Stmt | None:
    """Post-order statement rewrite with `fn` applied to every rebuilt statement."""

    class _Map(Transformer):
        def stmt(self, x: Stmt) -> Stmt | None:
            y = super().stmt(x)
            return fn(y) if y is not None else None

    return _Map().stmt(s)
