"""Generic traversal: `walk_*` yields nodes, `Transformer` rebuilds a tree bottom-up."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .nodes import (
    Buffer,
    Expr,
    Load,
    Region,
    Stmt,
    Var,
)


def child_stmts(s: Stmt) -> list[Stmt]:
    return s.children()


def walk_stmts(s: Stmt) -> Iterator[Stmt]:
    yield s
    for c in s.children():
        yield from walk_stmts(c)


def seq_rule(walker, s: Stmt) -> None:
    """The Seq rule of every walker with a `stmt(s)` entry: its statements in order."""
    for c in s.body:
        walker.stmt(c)


def child_exprs(e: Expr) -> list[Expr]:
    return e.children()


def walk_expr(e: Expr) -> Iterator[Expr]:
    yield e
    for c in e.children():
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
        """The rebuilt expression (each expression class rebuilds itself from its rebuilt children)."""
        return e.rebuild([self.expr(c) for c in e.children()])

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
