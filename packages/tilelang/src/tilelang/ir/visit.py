"""Generic traversal: `walk_*` yields nodes, `Transformer` rebuilds a tree bottom-up."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .nodes import (
    Alloc,
    AtomicAdd,
    BinOp,
    Buffer,
    Call,
    Cast,
    Const,
    Copy,
    CumSum,
    Expr,
    Fill,
    For,
    Gemm,
    If,
    Kernel,
    Let,
    Load,
    Not,
    Reduce,
    Region,
    Select,
    Seq,
    Stmt,
    Store,
    Var,
    While,
)


def child_stmts(s: Stmt) -> list[Stmt]:
    if isinstance(s, Seq):
        return list(s.body)
    if isinstance(s, (Kernel, For, While)):
        return [s.body]
    if isinstance(s, If):
        return [s.then] + ([s.orelse] if s.orelse is not None else [])
    return []


def walk_stmts(s: Stmt) -> Iterator[Stmt]:
    yield s
    for c in child_stmts(s):
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
    if isinstance(s, Kernel):
        return list(s.grid)
    if isinstance(s, Alloc):
        return [s.init] if s.init is not None else []
    if isinstance(s, For):
        return [s.start, s.extent]
    if isinstance(s, Let):
        return [s.value]
    if isinstance(s, Store):
        return [*s.indices, s.value]
    if isinstance(s, (If, While)):
        return [s.cond]
    if isinstance(s, Copy):
        return region_exprs(s.src) + region_exprs(s.dst)
    if isinstance(s, Gemm):
        return region_exprs(s.A) + region_exprs(s.B) + region_exprs(s.C)
    if isinstance(s, Fill):
        return region_exprs(s.dst) + [s.value]
    if isinstance(s, AtomicAdd):
        return region_exprs(s.dst) + (region_exprs(s.src) if isinstance(s.src, Region) else [s.src])
    return []


def all_exprs(s: Stmt) -> Iterator[Expr]:
    for st in walk_stmts(s):
        for e in stmt_exprs(st):
            yield from walk_expr(e)


def buffers_read(s: Stmt) -> set[Buffer]:
    out: set[Buffer] = set()
    for st in walk_stmts(s):
        if isinstance(st, Copy):
            out.add(st.src.buffer)
        elif isinstance(st, Gemm):
            out |= {st.A.buffer, st.B.buffer, st.C.buffer}
        elif isinstance(st, Reduce):
            out.add(st.src.buffer if isinstance(st.src, Region) else st.src)
            if not st.clear:
                out.add(st.dst)
        elif isinstance(st, CumSum):
            out.add(st.src)
        elif isinstance(st, AtomicAdd):
            out.add(st.dst.buffer)
            if isinstance(st.src, Region):
                out.add(st.src.buffer)
        for e in stmt_exprs(st):
            for x in walk_expr(e):
                if isinstance(x, Load):
                    out.add(x.buffer)
    return out


def buffers_written(s: Stmt) -> set[Buffer]:
    out: set[Buffer] = set()
    for st in walk_stmts(s):
        if isinstance(st, Store):
            out.add(st.buffer)
        elif isinstance(st, Copy):
            out.add(st.dst.buffer)
        elif isinstance(st, Gemm):
            out.add(st.C.buffer)
        elif isinstance(st, Fill):
            out.add(st.dst.buffer)
        elif isinstance(st, (Reduce, CumSum)):
            out.add(st.dst)
        elif isinstance(st, AtomicAdd):
            out.add(st.dst.buffer)
        elif isinstance(st, Alloc) and st.init is not None:
            out.add(st.buffer)
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
        loc = s.loc
        if isinstance(s, Seq):
            body = [t for t in (self.stmt(c) for c in s.body) if t is not None]
            return Seq(body, loc=loc)
        if isinstance(s, Kernel):
            return Kernel([self.expr(g) for g in s.grid], s.block_vars, s.threads, self.stmt(s.body) or Seq([]),
                          dict(s.attrs), loc=loc)
        if isinstance(s, Alloc):
            return Alloc(s.buffer, self.expr(s.init) if s.init is not None else None, loc=loc)
        if isinstance(s, For):
            return For(s.var, self.expr(s.start), self.expr(s.extent), s.kind, self.stmt(s.body) or Seq([]),
                       dict(s.annotations), loc=loc)
        if isinstance(s, Let):
            return Let(s.var, self.expr(s.value), loc=loc)
        if isinstance(s, Store):
            return Store(s.buffer, [self.expr(i) for i in s.indices], self.expr(s.value), loc=loc)
        if isinstance(s, If):
            orelse = self.stmt(s.orelse) if s.orelse is not None else None
            return If(self.expr(s.cond), self.stmt(s.then) or Seq([]), orelse, loc=loc)
        if isinstance(s, While):
            return While(self.expr(s.cond), self.stmt(s.body) or Seq([]), loc=loc)
        if isinstance(s, Copy):
            return Copy(self.region(s.src), self.region(s.dst), dict(s.options), loc=loc)
        if isinstance(s, Gemm):
            return Gemm(self.region(s.A), self.region(s.B), self.region(s.C), s.transpose_A, s.transpose_B,
                        s.clear_accum, s.policy, dict(s.options), loc=loc)
        if isinstance(s, Fill):
            return Fill(self.region(s.dst), self.expr(s.value), loc=loc)
        if isinstance(s, (Reduce, CumSum)):
            return s
        if isinstance(s, AtomicAdd):
            src = self.region(s.src) if isinstance(s.src, Region) else self.expr(s.src)
            return AtomicAdd(self.region(s.dst), src, loc=loc)
        raise TypeError(f"Transformer: unknown statement {type(s).__name__}")


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
