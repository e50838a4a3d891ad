"""Structural checks on tile IR: scopes, ranks, gemm shapes, static bounds of local buffers."""

from __future__ import annotations

from ..errors import CompileError, SourceLoc
from .nodes import (
    Alloc,
    AtomicAdd,
    BinOp,
    Buffer,
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
    PrimFunc,
    Reduce,
    Region,
    Seq,
    Stmt,
    Store,
    Var,
    While,
)
from .visit import stmt_exprs, walk_expr


def _interval(e: Expr, ranges: dict[Var, tuple[int, int]]) -> tuple[int, int] | None:
    """Inclusive [lo, hi] of an integer expression, when loop ranges make it static."""
    if isinstance(e, Const) and isinstance(e.value, int):
        return (e.value, e.value)
    if isinstance(e, Var):
        return ranges.get(e)
    if isinstance(e, BinOp) and e.op in ("+", "-", "*"):
        a, b = _interval(e.a, ranges), _interval(e.b, ranges)
        if a is None or b is None:
            return None
        if e.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        prods = [x * y for x in a for y in b]
        return (min(prods), max(prods))
    if isinstance(e, BinOp) and e.op in ("//", "%") and isinstance(e.b, Const) and e.b.value > 0:
        a = _interval(e.a, ranges)
        if a is None or a[0] < 0:
            return None
        c = int(e.b.value)
        return (a[0] // c, a[1] // c) if e.op == "//" else (0, min(c - 1, a[1]))
    return None


class _Verifier:
    def __init__(self, func: PrimFunc, allow_global_gemm: bool = False) -> None:
        self.func = func
        self.allow_global_gemm = allow_global_gemm
        self.visible: list[set[Buffer]] = [set(func.params)]
        self.ranges: dict[Var, tuple[int, int]] = {}
        self.defined: set[Var] = set(func.dynamic_vars)

    def fail(self, loc: SourceLoc | None, msg: str) -> None:
        raise CompileError(msg, loc or self.func.loc)

    def check_buffer(self, b: Buffer, loc: SourceLoc | None) -> None:
        if not any(b in s for s in self.visible):
            self.fail(loc, f"buffer {b.name} used outside the block that allocates it")

    def check_access(self, b: Buffer, idx: list[Expr], loc: SourceLoc | None, what: str) -> None:
        self.check_buffer(b, loc)
        if len(idx) != b.ndim:
            self.fail(loc, f"{what} {b.name}: rank {b.ndim} buffer accessed with {len(idx)} indices")
        if b.scope == "global":
            return
        shape = b.static_shape()
        for d, (i, n) in enumerate(zip(idx, shape)):
            iv = _interval(i, self.ranges)
            if iv is not None and (iv[0] < 0 or iv[1] >= n):
                self.fail(loc, f"{what} {b.name}: index {d} ranges over [{iv[0]}, {iv[1]}] but the dimension has "
                               f"size {n} (out of bounds)")

    def check_region(self, r: Region, loc: SourceLoc | None) -> None:
        self.check_buffer(r.buffer, loc)
        if len(r.starts) != r.buffer.ndim:
            self.fail(loc, f"tile of {r.buffer.name}: rank {r.buffer.ndim} buffer given {len(r.starts)} indices")
        shape = r.buffer.static_shape()
        if r.buffer.scope != "global" and shape is not None:
            for d, (s, n, size) in enumerate(zip(r.starts, r.extents, shape)):
                iv = _interval(s, self.ranges)
                if iv is not None and (iv[0] < 0 or iv[1] + n > size):
                    self.fail(loc, f"tile of {r.buffer.name}: dim {d} covers [{iv[0]}, {iv[1] + n}) but the buffer "
                                   f"has size {size} (out of bounds)")

    def exprs(self, s: Stmt) -> None:
        for e in stmt_exprs(s):
            for x in walk_expr(e):
                if isinstance(x, Load):
                    self.check_access(x.buffer, x.indices, s.loc, "load from")
                elif isinstance(x, Var) and x not in self.defined:
                    self.fail(s.loc, f"variable {x.name} used outside its loop or block")

    def stmt(self, s: Stmt, in_kernel: bool) -> None:
        if isinstance(s, Seq):
            self.visible.append(set())
            for c in s.body:
                self.stmt(c, in_kernel)
            self.visible.pop()
            return
        self.exprs(s)
        if isinstance(s, Kernel):
            if in_kernel:
                self.fail(s.loc, "nested T.Kernel")
            for v, g in zip(s.block_vars, s.grid):
                self.defined.add(v)
                self.ranges[v] = (0, int(g.value) - 1) if isinstance(g, Const) else None
                if self.ranges[v] is None:
                    del self.ranges[v]
            self.stmt(s.body, True)
        elif not in_kernel:
            self.fail(s.loc, "statements outside `with T.Kernel(...)` are not supported")
        elif isinstance(s, Alloc):
            if s.buffer.scope == "global":
                self.fail(s.loc, "cannot allocate a global buffer inside a kernel")
            self.visible[-1].add(s.buffer)
        elif isinstance(s, For):
            self.defined.add(s.var)
            if isinstance(s.extent, Const) and isinstance(s.start, Const):
                self.ranges[s.var] = (int(s.start.value), int(s.start.value) + int(s.extent.value) - 1)
            self.stmt(s.body, True)
            self.ranges.pop(s.var, None)
        elif isinstance(s, Let):
            self.defined.add(s.var)
        elif isinstance(s, Store):
            self.check_access(s.buffer, s.indices, s.loc, "store to")
        elif isinstance(s, While):
            self.stmt(s.body, True)
        elif isinstance(s, If):
            self.stmt(s.then, True)
            if s.orelse is not None:
                self.stmt(s.orelse, True)
        elif isinstance(s, Copy):
            self.check_region(s.src, s.loc)
            self.check_region(s.dst, s.loc)
        elif isinstance(s, Gemm):
            for r, nm in ((s.A, "A"), (s.B, "B"), (s.C, "C")):
                self.check_region(r, s.loc)
                if r.buffer.scope == "global" and not self.allow_global_gemm:
                    self.fail(s.loc, f"T.gemm: operand {nm} ({r.buffer.name}) is a global tensor; copy it into a "
                                     f"shared or fragment buffer first")
        elif isinstance(s, Fill):
            self.check_region(s.dst, s.loc)
        elif isinstance(s, (Reduce, CumSum)):
            self.check_buffer(s.src, s.loc)
            self.check_buffer(s.dst, s.loc)
        elif isinstance(s, AtomicAdd):
            self.check_region(s.dst, s.loc)
            if isinstance(s.src, Region):
                self.check_region(s.src, s.loc)


def verify(func: PrimFunc, allow_global_gemm: bool = False) -> PrimFunc:
    """Raise CompileError (with the source location) on the first structural problem; return func."""
    _Verifier(func, allow_global_gemm).stmt(func.body, False)
    return func
