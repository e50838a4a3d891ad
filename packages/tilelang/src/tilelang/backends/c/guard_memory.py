"""Memory safety of element accesses on the cpu target, with the interpreter's semantics.

The interpreter defines what an access past the end of a buffer means: a load reads zero, an
element store to a global tensor is dropped, a store past the end of an on-chip buffer raises
LaunchError. Two passes give the generated C the same meaning (the C code would otherwise read
and write neighbouring memory):

- `guard_global_accesses` (before lowering; tile ops guard their own edge tiles when lowered):
  each user-written load `T[idx]` of a global tensor becomes `in_bounds ? T[idx] : 0` and each
  store is wrapped in `if (in_bounds)`. The public TileLang legalizes accesses the same way by
  default (a top-k whose blk_m does not divide M drops the last tile's extra rows).
- `check_local_accesses` (after lowering): loads of shared/fragment/local buffers read zero past
  the end; a store or an element `T.atomic_add` past the end records which access failed, is
  skipped, and the launch raises LaunchError naming the buffer and the source line (`BoundsFail`,
  emitted by the codegen). Element adds to global tensors are dropped like their stores; a tile
  add (several elements) drops its edge elements like T.copy (lower_tile_ops.lower_atomic_add).

Accesses proved in bounds are left alone: an interval analysis over block indices (grid
sizes), loop ranges and lets, plus `i < N` for a loop `for i in range(N)` over a T.dynamic N.
Accesses that can never be in bounds are CompileErrors (ir/verifier.py).
`pass_configs={"tl.disable_safe_memory_legalize": True}` removes both passes' guards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...ir.bounds import Interval, interval
from ...ir.nodes import (
    AtomicAdd,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Let,
    Load,
    PrimFunc,
    Select,
    Stmt,
    Store,
    Var,
    binop,
)
from ...ir.visit import Transformer

log = logging.getLogger("tilelang.backends.c")

LOCAL_SCOPES = ("shared", "shared.dyn", "fragment", "local")


@dataclass(eq=False)
class BoundsFail(Stmt):
    """Record out-of-bounds access number `code` (see PrimFunc.bounds_checks) in the kernel status.
    Emitted by the C codegen (its "cpu" rule); created after the last pass that could drop it."""

    code: int
    side_effects = True

    def rebuild(self, tr) -> Stmt:
        return self


class _Ranged(Transformer):
    """A Transformer that knows the integer range of every block index, loop variable and let."""

    def __init__(self) -> None:
        self.ranges: dict[Var, Interval] = {}
        self.below: dict[Var, Expr] = {}  # v -> X with 0 <= v < X (loops over a T.dynamic extent)
        self.count = 0

    def stmt(self, s: Stmt) -> Stmt | None:
        if isinstance(s, Kernel):
            for v, g in zip(s.block_vars, s.grid):
                hi = interval(g, self.ranges)[1]
                self.ranges[v] = (0, hi - 1 if hi is not None else None)
                self.below[v] = g
        elif isinstance(s, For):
            st, ex = interval(s.start, self.ranges), interval(s.extent, self.ranges)
            hi = st[1] + ex[1] - 1 if st[1] is not None and ex[1] is not None else None
            self.ranges[s.var] = (st[0], hi)
            if isinstance(s.start, Const) and s.start.value == 0:
                self.below[s.var] = s.extent
        elif isinstance(s, Let) and s.var.dtype.startswith("int"):
            self.ranges[s.var] = interval(s.value, self.ranges)
        return super().stmt(s)

    def in_bounds(self, buf, idx: list[Expr]) -> Expr | None:
        """The condition that `buf[idx]` is in bounds, without the parts proved; None if all are."""
        conds = []
        for i, d in zip(idx, buf.shape):
            lo, hi = interval(i, self.ranges)
            if lo is None or lo < 0:
                conds.append(binop(">=", i, 0))
            if isinstance(d, Const):
                proved = hi is not None and hi < int(d.value)
            else:
                proved = isinstance(i, Var) and self.below.get(i) is d
            if not proved:
                conds.append(binop("<", i, d))
        if not conds:
            return None
        cond = conds[0]
        for c in conds[1:]:
            cond = binop("and", cond, c)
        return cond

    def guarded_load(self, e: Load) -> Expr:
        idx = [self.expr(i) for i in e.indices]
        load = Load(e.buffer, idx)
        cond = self.in_bounds(e.buffer, idx)
        if cond is None:
            return load
        self.count += 1
        return Select(cond, load, Const(0, load.dtype), load.dtype)


class _GlobalGuard(_Ranged):
    def expr(self, e: Expr) -> Expr:
        if isinstance(e, Load) and e.buffer.scope == "global":
            return self.guarded_load(e)
        return super().expr(e)

    def stmt(self, s: Stmt) -> Stmt | None:
        if isinstance(s, Store) and s.buffer.scope == "global":
            st = super().stmt(s)
            cond = self.in_bounds(st.buffer, st.indices)
            if cond is None:
                return st
            self.count += 1
            return If(cond, st, None, loc=s.loc)
        return super().stmt(s)


class _LocalCheck(_Ranged):
    def __init__(self) -> None:
        super().__init__()
        self.checks: list[tuple[str, str, tuple]] = []

    def expr(self, e: Expr) -> Expr:
        if isinstance(e, Load) and e.buffer.scope in LOCAL_SCOPES:
            return self.guarded_load(e)
        return super().expr(e)

    def stmt(self, s: Stmt) -> Stmt | None:
        if isinstance(s, BoundsFail):
            return s
        if isinstance(s, If) and isinstance(s.orelse, BoundsFail):
            return If(self.expr(s.cond), self.stmt(s.then), s.orelse, loc=s.loc)
        if isinstance(s, Store) and s.buffer.scope in LOCAL_SCOPES:
            st = super().stmt(s)
            return self.checked(st, st.buffer, st.indices)
        if isinstance(s, AtomicAdd) and s.dst.buffer.scope in LOCAL_SCOPES:  # an element add (lowered)
            st = super().stmt(s)
            return self.checked(st, st.dst.buffer, st.dst.starts)
        return super().stmt(s)

    def checked(self, st: Stmt, buf, idx: list[Expr]) -> Stmt:
        """`st` (writing buf[idx]) if proved in bounds, else run only in bounds, recording a failure."""
        cond = self.in_bounds(buf, idx)
        if cond is None:
            return st
        code = len(self.checks)
        shape = tuple(int(d.value) if isinstance(d, Const) else d.name for d in buf.shape)
        self.checks.append((str(st.loc) if st.loc else "", buf.name, shape))
        return If(cond, st, BoundsFail(code, loc=st.loc), loc=st.loc)


def _rebuild(func: PrimFunc, body: Stmt) -> PrimFunc:
    out = PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source,
                   getattr(func, "workspace", []), getattr(func, "views", []))
    out.bounds_checks = list(getattr(func, "bounds_checks", []))
    return out


def guard_global_accesses(func: PrimFunc) -> PrimFunc:
    g = _GlobalGuard()
    body = g.stmt(func.body)
    log.debug("guard_global_accesses %s: %d access(es) guarded", func.name, g.count)
    return _rebuild(func, body)


def check_local_accesses(func: PrimFunc) -> PrimFunc:
    g = _LocalCheck()
    g.checks = list(getattr(func, "bounds_checks", []))
    body = g.stmt(func.body)
    out = _rebuild(func, body)
    out.bounds_checks = g.checks
    log.debug("check_local_accesses %s: %d access(es) guarded, %d store check(s)", func.name, g.count,
              len(g.checks))
    return out
