"""Structural checks on tile IR: scopes, ranks, gemm shapes, static bounds of local buffers, accesses
of global tensors that can never be in bounds, grid and buffer sizes."""

from __future__ import annotations

import tilehal

from ..errors import CompileError, SourceLoc
from .bounds import MAX_GRID, interval
from .nodes import (
    Alloc,
    BinOp,
    Buffer,
    Const,
    Expr,
    For,
    Gemm,
    If,
    Kernel,
    Let,
    Load,
    PrimFunc,
    Region,
    Select,
    Seq,
    Stmt,
    Store,
    TileOp,
    Var,
    While,
    register_rules,
)
from .printer import print_expr
from .thread import (
    ASYNC_COPY_BYTES,
    BARRIER_KINDS,
    INTRINSICS,
    SHUFFLE_KINDS,
    AsyncCommit,
    AsyncCopy,
    AsyncWait,
    Barrier,
    BreakIf,
    Intrinsic,
    RegBuffer,
    Scope,
    Shuffle,
    StridedFor,
    ThreadFor,
    ThreadIdx,
    Uniform,
)
from .visit import child_exprs, stmt_exprs

MAX_BUFFER_BYTES = 2**48  # larger static buffers are a mistake (and their byte counts could wrap in C)


def _loads(e: Expr, guarded: bool = False):
    """(load, guarded) for every Load in `e`; guarded: inside a branch of a Select (T.if_then_else)."""
    stack = [(e, guarded)]
    while stack:
        x, g = stack.pop()
        if isinstance(x, Load):
            yield x, g
        if isinstance(x, Select):
            stack += [(x.cond, g), (x.a, True), (x.b, True)]
        else:
            stack += [(c, g) for c in child_exprs(x)]


def _walk(e: Expr):
    stack = [e]
    while stack:
        x = stack.pop()
        yield x
        stack += child_exprs(x)


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
        self.bounds: dict[Var, tuple] = {}  # half-open-ended ranges (ir.bounds) of every index variable
        self.conditional = 0  # > 0 inside an IR if / while: an access there may never execute

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
            self.check_never_in_bounds(b, idx, [1] * len(idx), loc, what)
            return
        shape = b.static_shape()
        for d, (i, n) in enumerate(zip(idx, shape)):
            iv = _interval(i, self.ranges)
            if iv is not None and (iv[0] < 0 or iv[1] >= n):
                self.fail(loc, f"{what} {b.name}: index {d} ranges over [{iv[0]}, {iv[1]}] but the dimension has "
                               f"size {n} (out of bounds)")

    def check_never_in_bounds(self, b: Buffer, starts: list[Expr], extents: list[int], loc: SourceLoc | None,
                              what: str) -> None:
        """A global access that no execution has in bounds is a bug (an edge tile is in bounds in part)."""
        if self.conditional:
            return
        for d, (i, n, size) in enumerate(zip(starts, extents, b.shape)):
            lo, hi = interval(i, self.bounds)
            if hi is not None and hi + n - 1 < 0:
                self.fail(loc, f"{what} {b.name}: index {d} ranges over [{lo}, {hi + n - 1}], always negative "
                               f"(out of bounds on every execution)")
            if isinstance(size, Const) and lo is not None and lo >= int(size.value):
                self.fail(loc, f"{what} {b.name}: index {d} is at least {lo} but the dimension has size "
                               f"{int(size.value)} (out of bounds on every execution)")

    def check_size(self, b: Buffer, loc: SourceLoc | None) -> None:
        shape = b.static_shape()
        if shape is None:
            return
        n = 1
        for d in shape:
            n *= int(d)
        nbytes = n * tilehal.get_dtype(b.dtype).itemsize
        if nbytes > MAX_BUFFER_BYTES:
            self.fail(loc, f"buffer {b.name}: shape {tuple(shape)} of {b.dtype} is {nbytes} bytes; expected at most "
                           f"2**48 bytes")

    def check_region(self, r: Region, loc: SourceLoc | None) -> None:
        self.check_buffer(r.buffer, loc)
        if len(r.starts) != r.buffer.ndim:
            self.fail(loc, f"tile of {r.buffer.name}: rank {r.buffer.ndim} buffer given {len(r.starts)} indices")
        if r.buffer.scope == "global":
            self.check_never_in_bounds(r.buffer, r.starts, list(r.extents), loc, "tile of")
        shape = r.buffer.static_shape()
        if r.buffer.scope != "global" and shape is not None:
            for d, (s, n, size) in enumerate(zip(r.starts, r.extents, shape)):
                iv = _interval(s, self.ranges)
                if iv is not None and (iv[0] < 0 or iv[1] + n > size):
                    self.fail(loc, f"tile of {r.buffer.name}: dim {d} covers [{iv[0]}, {iv[1] + n}) but the buffer "
                                   f"has size {size} (out of bounds)")

    def exprs(self, s: Stmt) -> None:
        for e in stmt_exprs(s):
            for x in _walk(e):
                if isinstance(x, Var) and x not in self.defined:
                    self.fail(s.loc, f"variable {x.name} used outside its loop or block")
            for x, guarded in _loads(e):
                self.conditional += guarded
                try:
                    self.check_access(x.buffer, x.indices, s.loc, "load from")
                finally:
                    self.conditional -= guarded

    def stmt(self, s: Stmt, in_kernel: bool) -> None:
        self.exprs(s)
        if not in_kernel and not isinstance(s, (Seq, Kernel)):  # the only statements allowed outside a kernel
            self.fail(s.loc, "statements outside `with T.Kernel(...)` are not supported")
        rule = s.rule("verify")
        if rule is not None:
            rule(self, s, in_kernel)

    # ---------------------------------------------------------------- rules (the "verify" table)

    def seq(self, s: Seq, in_kernel: bool) -> None:
        self.visible.append(set())
        for c in s.body:
            self.stmt(c, in_kernel)
        self.visible.pop()

    def kernel(self, s: Kernel, in_kernel: bool) -> None:
        if in_kernel:
            self.fail(s.loc, "nested T.Kernel")
        for d, g in enumerate(s.grid):
            if isinstance(g, Const) and not 1 <= int(g.value) <= MAX_GRID[min(d, 2)]:
                self.fail(s.loc, f"T.Kernel: grid dimension {d} is {g.value}; expected an integer in "
                                 f"[1, {MAX_GRID[min(d, 2)]}]")
        for v, g in zip(s.block_vars, s.grid):
            hi = interval(g, self.bounds)[1]
            self.bounds[v] = (0, hi - 1 if hi is not None else None)
            self.defined.add(v)
            self.ranges[v] = (0, int(g.value) - 1) if isinstance(g, Const) else None
            if self.ranges[v] is None:
                del self.ranges[v]
        self.stmt(s.body, True)

    def alloc(self, s: Alloc, in_kernel: bool) -> None:
        if s.buffer.scope == "global":
            self.fail(s.loc, "cannot allocate a global buffer inside a kernel")
        self.check_size(s.buffer, s.loc)
        self.visible[-1].add(s.buffer)

    def for_(self, s: For, in_kernel: bool) -> None:
        self.defined.add(s.var)
        st, ex = interval(s.start, self.bounds), interval(s.extent, self.bounds)
        self.bounds[s.var] = (st[0], st[1] + ex[1] - 1 if st[1] is not None and ex[1] is not None else None)
        if isinstance(s.extent, Const) and isinstance(s.start, Const):
            self.ranges[s.var] = (int(s.start.value), int(s.start.value) + int(s.extent.value) - 1)
        self.stmt(s.body, True)
        self.ranges.pop(s.var, None)

    def let(self, s: Let, in_kernel: bool) -> None:
        self.defined.add(s.var)
        if s.var.dtype.startswith("int"):
            self.bounds[s.var] = interval(s.value, self.bounds)

    def store(self, s: Store, in_kernel: bool) -> None:
        self.check_access(s.buffer, s.indices, s.loc, "store to")

    def nested(self, s: Stmt, in_kernel: bool) -> None:  # While, If: what is inside may never execute
        self.conditional += 1
        try:
            for c in s.children():
                self.stmt(c, True)
        finally:
            self.conditional -= 1

    def tile_op(self, s: TileOp, in_kernel: bool) -> None:
        for r in s.regions():
            self.check_region(r, s.loc)
        for b in s.operand_buffers():
            self.check_buffer(b, s.loc)

    def gemm(self, s: Gemm, in_kernel: bool) -> None:
        for r, nm in ((s.A, "A"), (s.B, "B"), (s.C, "C")):
            self.check_region(r, s.loc)
            if r.buffer.scope == "global" and not self.allow_global_gemm:
                self.fail(s.loc, f"T.gemm: operand {nm} ({r.buffer.name}) is a global tensor; copy it into a "
                                 f"shared or fragment buffer first")


    # ---------------------------------------------------------------- thread-level IR (ir/thread.py)

    def reg_buffer(self, s: RegBuffer, in_kernel: bool) -> None:
        b = s.buffer
        if b.scope != "local" or b.ndim != 1 or b.static_shape() is None or b.static_shape()[0] < 1:
            self.fail(s.loc, f"T.alloc_reg {b.name}: expected a scope 'local' buffer of static shape (nregs,), got "
                             f"scope {b.scope!r} shape {b.static_shape() or b.shape}")
        if s.fragment is not None and s.fragment.nregs != s.nregs:
            self.fail(s.loc, f"T.alloc_reg {b.name}: {s.nregs} registers but its fragment {s.fragment!r} has "
                             f"{s.fragment.nregs} per thread")
        self.visible[-1].add(b)

    def barrier(self, s: Barrier, in_kernel: bool) -> None:
        if s.kind not in BARRIER_KINDS:
            self.fail(s.loc, f"barrier kind {s.kind!r}; expected one of {BARRIER_KINDS}")

    def async_copy(self, s: AsyncCopy, in_kernel: bool) -> None:
        if s.dst.scope != "shared" or s.src.scope != "global":
            self.fail(s.loc, f"T.cp_async: copies global -> shared; got {s.src.name} ({s.src.scope}) -> "
                             f"{s.dst.name} ({s.dst.scope})")
        if s.dst.dtype != s.src.dtype:
            self.fail(s.loc, f"T.cp_async: {s.src.name} is {s.src.dtype} but {s.dst.name} is {s.dst.dtype}")
        if s.n < 1 or s.nbytes not in ASYNC_COPY_BYTES:
            self.fail(s.loc, f"T.cp_async: {s.n} elements of {s.dst.dtype} are {s.nbytes} bytes; expected one of "
                             f"{ASYNC_COPY_BYTES} bytes")
        self.check_access(s.src, s.src_idx, s.loc, "cp.async from")
        self.check_access(s.dst, s.dst_idx, s.loc, "cp.async to")
        shape = s.dst.static_shape()
        iv = _interval(s.dst_idx[-1], self.ranges) if shape is not None else None
        if iv is not None and iv[1] + s.n > shape[-1]:
            self.fail(s.loc, f"T.cp_async to {s.dst.name}: last index up to {iv[1]} + {s.n} elements passes the "
                             f"dimension's size {shape[-1]} (out of bounds)")

    def async_wait(self, s: AsyncWait, in_kernel: bool) -> None:
        if s.n < 0:
            self.fail(s.loc, f"T.cp_async_wait({s.n}): expected a group count >= 0")

    def intrinsic(self, s: Intrinsic, in_kernel: bool) -> None:
        spec = INTRINSICS.get(s.name)
        if spec is None:
            self.fail(s.loc, f"T.intrinsic {s.name!r}: unknown; expected one of {sorted(INTRINSICS)}")
        if len(s.ins) != spec.n_in or len(s.outs) != spec.n_out:
            self.fail(s.loc, f"T.intrinsic {s.name!r}: takes {spec.n_in} operands and {spec.n_out} results, got "
                             f"{len(s.ins)} and {len(s.outs)}")
        missing = [a for a in spec.attrs if a not in s.attrs]
        if missing:
            self.fail(s.loc, f"T.intrinsic {s.name!r}: missing attribute(s) {missing}")
        for o in s.outs:
            self.check_access(o.buffer, o.indices, s.loc, f"T.intrinsic {s.name!r} result")

    def thread_for(self, s: ThreadFor, in_kernel: bool) -> None:
        if s.trips < 1:
            self.fail(s.loc, f"T.thread_for({s.trips}): expected a trip count >= 1")
        self.defined.add(s.var)
        self.bounds[s.var] = (0, s.trips - 1)
        self.ranges[s.var] = (0, s.trips - 1)
        self.stmt(s.body, True)
        self.ranges.pop(s.var, None)

    def uniform(self, s: Uniform, in_kernel: bool) -> None:
        self.stmt(s.body, True)

    def scope(self, s: Scope, in_kernel: bool) -> None:
        self.stmt(s.body, in_kernel)

    def strided_for(self, s: StridedFor, in_kernel: bool) -> None:
        if s.step < 1:
            self.fail(s.loc, f"strided loop {s.var.name}: expected a step >= 1, got {s.step}")
        self.defined.add(s.var)
        self.nested(s, in_kernel)

    def break_if(self, s: BreakIf, in_kernel: bool) -> None:
        pass  # its condition is checked with every statement's expressions


register_rules("verify", {RegBuffer: _Verifier.reg_buffer, Barrier: _Verifier.barrier, AsyncCopy: _Verifier.async_copy,
                          AsyncWait: _Verifier.async_wait, Intrinsic: _Verifier.intrinsic,
                          ThreadFor: _Verifier.thread_for, Uniform: _Verifier.uniform, Scope: _Verifier.scope,
                          StridedFor: _Verifier.strided_for, BreakIf: _Verifier.break_if})


register_rules("verify", {Seq: _Verifier.seq, Kernel: _Verifier.kernel, Alloc: _Verifier.alloc, For: _Verifier.for_,
                          Let: _Verifier.let, Store: _Verifier.store, While: _Verifier.nested, If: _Verifier.nested,
                          TileOp: _Verifier.tile_op, Gemm: _Verifier.gemm})


def verify(func: PrimFunc, allow_global_gemm: bool = False) -> PrimFunc:
    """Raise CompileError (with the source location) on the first structural problem; return func."""
    v = _Verifier(func, allow_global_gemm)
    for p in func.params:
        v.check_size(p, func.loc)
    v.stmt(func.body, False)
    return func


# ---------------------------------------------------------------- thread-level programs


class _ThreadChecks:
    """What makes a program thread-level: no tile ops, registers only through T.alloc_reg, serial
    loops on bounds every thread agrees on; barriers and shuffles where every thread of the block
    (warp) reaches them; uniform regions free of per-thread values."""

    def __init__(self, func: PrimFunc) -> None:
        self.func = func
        self.lane_vars: set[Var] = set()  # Let-bound variables whose value differs between threads
        self.regs: set[Buffer] = set()
        self.divergent: list[Expr] = []  # the enclosing per-thread conditions
        self.uniform = 0
        self.in_kernel = False

    def fail(self, s: Stmt, msg: str) -> None:
        raise CompileError(msg, s.loc or self.func.loc)

    def per_thread(self, e: Expr) -> bool:
        """True when `e` may differ between the threads of a block."""
        for x in _walk(e):
            if isinstance(x, (ThreadIdx, Shuffle)) or (isinstance(x, Var) and x in self.lane_vars) or \
                    (isinstance(x, Load) and x.buffer in self.regs):
                return True
        return False

    def exprs(self, s: Stmt) -> None:
        for e in stmt_exprs(s):
            for x in _walk(e):
                if isinstance(x, ThreadIdx) and not self.in_kernel:
                    self.fail(s, "T.get_thread_binding() outside `with T.Kernel(...)`")
                if isinstance(x, Shuffle):
                    if x.kind not in SHUFFLE_KINDS:
                        self.fail(s, f"T.shfl_{x.kind}: expected a kind in {SHUFFLE_KINDS}")
                    if x.width not in (1, 2, 4, 8, 16, 32):
                        self.fail(s, f"T.shfl_{x.kind}(width={x.width}): expected a power of two <= 32")
                    if self.divergent:
                        self.fail(s, f"T.shfl_{x.kind} under a condition that differs between threads "
                                     f"({print_expr(self.divergent[-1])}): every lane of the warp must take part")
            if self.uniform and self.per_thread(e):
                self.fail(s, f"T.uniform() region holds a per-thread value ({print_expr(e)})")

    def stmt(self, s: Stmt) -> None:
        self.exprs(s)
        rule = s.rule("thread.verify")
        if rule is not None:
            rule(self, s)
        else:
            self.children(s)

    def children(self, s: Stmt) -> None:
        for c in s.children():
            self.stmt(c)

    def scalar_only(self, s: Stmt) -> None:
        if self.uniform:
            self.fail(s, f"{type(s).__name__} inside a T.uniform() region (it holds scalar code only)")

    # ---------------------------------------------------------------- rules (the "thread.verify" table)

    def tile_op(self, s: TileOp) -> None:
        self.fail(s, f"tile op {type(s).__name__} in a thread-level program (lower it first)")

    def kernel(self, s: Kernel) -> None:
        self.in_kernel = True
        self.stmt(s.body)
        self.in_kernel = False

    def alloc(self, s: Alloc) -> None:
        if s.buffer.scope in ("fragment", "local"):
            self.fail(s, f"{s.buffer.name}: per-thread storage in a thread-level program is T.alloc_reg, not "
                         f"alloc_{s.buffer.scope}")

    def reg_buffer(self, s: RegBuffer) -> None:
        self.scalar_only(s)
        self.regs.add(s.buffer)

    def barrier(self, s: Barrier) -> None:
        self.scalar_only(s)
        if self.divergent:
            self.fail(s, f"T.sync_threads() under a condition that differs between threads "
                         f"({print_expr(self.divergent[-1])}): the threads that skip it never arrive")

    def per_thread_op(self, s: Stmt) -> None:  # AsyncCopy / Commit / Wait, Intrinsic, ThreadFor
        self.scalar_only(s)
        self.children(s)

    def for_(self, s: For) -> None:
        if s.kind not in ("serial", "unroll"):
            self.fail(s, f"T.{s.kind} loop in a thread-level program (lower it to serial loops / T.thread_for)")
        if self.per_thread(s.start) or self.per_thread(s.extent):
            self.fail(s, "loop bounds differ between threads; use T.thread_for with a guard")
        self.children(s)

    def while_(self, s: While) -> None:
        if self.per_thread(s.cond):
            self.fail(s, "while condition differs between threads")
        self.children(s)

    def let(self, s: Let) -> None:
        if self.per_thread(s.value):
            self.lane_vars.add(s.var)

    def if_(self, s: If) -> None:
        lane = self.per_thread(s.cond)
        if lane:
            self.divergent.append(s.cond)
        try:
            self.children(s)
        finally:
            if lane:
                self.divergent.pop()

    def strided_for(self, s: StridedFor) -> None:  # each thread its own trip count: the body is divergent
        self.scalar_only(s)
        self.lane_vars.add(s.var)
        self.divergent.append(s.start)
        try:
            self.children(s)
        finally:
            self.divergent.pop()

    def uniform_(self, s: Uniform) -> None:
        self.uniform += 1
        try:
            self.children(s)
        finally:
            self.uniform -= 1


register_rules("thread.verify", {
    TileOp: _ThreadChecks.tile_op, Kernel: _ThreadChecks.kernel, Alloc: _ThreadChecks.alloc,
    RegBuffer: _ThreadChecks.reg_buffer, Barrier: _ThreadChecks.barrier, AsyncCopy: _ThreadChecks.per_thread_op,
    AsyncCommit: _ThreadChecks.per_thread_op, AsyncWait: _ThreadChecks.per_thread_op,
    Intrinsic: _ThreadChecks.per_thread_op, ThreadFor: _ThreadChecks.per_thread_op, For: _ThreadChecks.for_,
    While: _ThreadChecks.while_, Let: _ThreadChecks.let, If: _ThreadChecks.if_, Uniform: _ThreadChecks.uniform_,
    Scope: _ThreadChecks.children, StridedFor: _ThreadChecks.strided_for, BreakIf: _ThreadChecks.scalar_only,
})


def verify_thread(func: PrimFunc) -> PrimFunc:
    """`verify` plus the checks of a thread-level program (ir/thread.py); CompileError naming the
    statement's location on the first problem; return func."""
    verify(func)
    _ThreadChecks(func).stmt(func.body)
    return func
