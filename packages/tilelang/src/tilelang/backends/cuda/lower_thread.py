"""Tile IR -> thread-level IR (issue 14 item 2, step 2 of the plan in docs/tilelang.md).

The CUDA lowering (KernelCodegen in codegen.py and its per-op rules/) walks a T.Kernel once, with
its plans (layouts, swizzles, stages, barriers); `ThreadBuilder` here is what it builds with: a
thread-level program (ir/thread.py's nodes and the core statements on thread-level buffers)
instead of lines of text. backends/cuda/emit.py prints that program as the kernel body, and
backends/thread_interp.py runs it with the block's threads as numpy lanes, so the lowering is
checked against the tile interpreter on the CPU (tests/test_thread_lowering.py).

Rules still writing text go through `emit(line)` / `open(head)` / `close()`, which build
Verbatim / VerbatimBlock nodes (printed as written, refused by the interpreter); a rule lowered to
nodes appends them with `add(node)` / `begin()` ... `end()`. docs/tilelang.md lists which rules
are nodes.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import CompileError
from ...ir import dtypes as dt
from ...ir.layout import Axis, Fragment
from ...ir.nodes import (
    Alloc,
    Buffer,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Let,
    Load,
    Select,
    Seq,
    Stmt,
    Store,
    Var,
)
from ...ir.thread import (
    Barrier,
    BreakIf,
    Intrinsic,
    RegBuffer,
    Scope,
    Shuffle,
    StridedFor,
    ThreadFor,
    ThreadIdx,
)
from ..interp import np_dtype
from .common import _LOW, SMEM_ALIGN, ParCtx, cuda_type, value_type
from .emit import (
    Abs,
    Bare,
    CastC,
    Conv,
    CSelect,
    ElemRef,
    IntLit,
    MinMax,
    Paren,
    Ref,
    Stored,
    ToFloat,
    TStore,
    Verbatim,
    VerbatimBlock,
    VerbatimExpr,
    Zero,
)

TX = ThreadIdx()


def C(v: int) -> Const:
    """An int constant (printed as its digits)."""
    return Const(int(v), dt.INDEX)


def B(a: Expr, op: str, b: Expr, dtype: str = dt.INDEX) -> Bare:
    return Bare(op, a, b, dtype)


def P(e: Expr) -> Paren:
    return Paren(e)


def conj(conds: list[Expr]) -> Expr | None:
    """`a && b && ...` (None for no condition)."""
    out = None
    for c in conds:
        out = c if out is None else B(out, "&&", c, "bool")
    return out


def total(terms: list[Expr], op: str = "+") -> Expr | None:
    out = None
    for t in terms:
        out = t if out is None else B(out, op, t)
    return out


class ThreadBuilder:
    """Node-building state of the CUDA lowering (a mixin of KernelCodegen)."""

    def _builder_init(self) -> None:
        self._blocks: list[list[Stmt]] = [[]]
        self._heads: list[str | None] = []
        self._vars: dict[str, Var] = {}  # C names the lowering made (fresh / loop / let) -> their Var
        self._tbufs: dict[Buffer, Buffer] = {}  # tile-level buffer -> its thread-level (flat / register) buffer
        self._scratch_views: dict[tuple[str, str], Buffer] = {}
        self._scratch_offsets: dict[str, int] = {}  # a scratch view's base text -> its byte offset in the scratch area

    # ------------------------------------------------------------ building nodes

    def add(self, node: Stmt) -> None:
        self._blocks[-1].append(node)

    def begin(self) -> None:
        """Start collecting the body of a node; `end()` returns it."""
        self._blocks.append([])
        self._heads.append(None)

    def end(self) -> Seq:
        if self._heads.pop() is not None:
            raise RuntimeError("cuda lowering: end() closes an open() block")
        return Seq(self._blocks.pop())

    def thread_kernel(self) -> Kernel:
        """The kernel as a thread-level program (after `generate()`): its shared scratch views, the lets
        of the enclosing function, then the body the CUDA text was printed from. (A T.use_swizzle block
        remap is left out: the blocks run in grid order, each computing the same tile.)"""
        k = self.kernel
        scratch_off = -(-self.smem_end // SMEM_ALIGN) * SMEM_ALIGN  # where plan_smem puts _tl_scratch
        head: list[Stmt] = []
        for (_, base), b in self._scratch_views.items():  # a view holds at most the scratch area's bytes
            off = self._scratch_offsets.get(base, 0)
            b.shape = (C(max(1, (self.scratch_bytes - off) // np.dtype(np_dtype(b.dtype)).itemsize)),)
            head.append(Alloc(b, options={"arena_offset": scratch_off + off}))
        head += [Let(let.var, self.lower_expr(let.value)) for let in self.lets]
        return Kernel(list(k.grid), list(k.block_vars), tuple(k.threads), Seq(head + [self.body_root()]),
                      attrs={"smem_arena_bytes": scratch_off + self.scratch_bytes}, loc=k.loc)

    def body_root(self) -> Seq:
        """The kernel body built so far (the outermost block)."""
        if len(self._blocks) != 1:
            raise RuntimeError(f"cuda lowering: {len(self._blocks) - 1} blocks left open")
        return Seq(self._blocks[0])

    # ------------------------------------------------------------ text (rules not lowered to nodes yet)

    def emit(self, line: str) -> None:
        self.add(Verbatim(line))

    def open(self, head: str) -> None:
        self._blocks.append([])
        self._heads.append(head)

    def close(self) -> None:
        head = self._heads.pop()
        if head is None:
            raise RuntimeError("cuda lowering: close() ends a begin() block")
        body = Seq(self._blocks.pop())
        self.add(Scope(body) if head == "" else VerbatimBlock(head, body))

    # ------------------------------------------------------------ the C-spelling expressions ("cexpr" rules)

    def bare(self, e: Bare) -> str:
        sep = "" if e.tight else " "
        return f"{self.expr(e.a)}{sep}{e.op}{sep}{self.expr(e.b)}"

    def paren(self, e: Paren) -> str:
        return f"({self.expr(e.value)})"

    def verbatim_expr(self, e: VerbatimExpr) -> str:
        return e.text

    def ref_(self, e: Ref) -> str:
        return e.buffer.name if e.scalar else f"{e.buffer.name}[{self.expr(e.indices[0])}]"

    def zero_(self, e: Zero) -> str:
        return self.zero(e.dtype)

    def to_float_(self, e: ToFloat) -> str:
        return f"tilehal::to_float({self.expr(e.value)})"

    def stored_(self, e: Stored) -> str:
        if e.to in _LOW:
            return f"tilehal::from_float<{cuda_type(e.to)}>((float)({self.expr(e.value)}))"
        if e.to == "bool":
            return f"(({self.expr(e.value)}) != 0)"
        return self.cast_to(e.value, e.to)

    def conv_(self, e: Conv) -> str:
        return self.conv(self.expr(e.value), e.src, e.to)

    def thread_idx(self, e: ThreadIdx) -> str:
        return "_tx"

    def int_lit(self, e: IntLit) -> str:
        return str(int(e.value))

    def cast_c(self, e: CastC) -> str:
        return f"(({value_type(e.to)}){self.expr(e.value)})"

    def min_max(self, e: MinMax) -> str:
        return f"tl_{e.op}<{value_type(e.dtype)}>({self.expr(e.a)}, {self.expr(e.b)})"

    def abs_(self, e: Abs) -> str:
        return f"{'abs' if dt.is_int(e.dtype) else 'fabsf'}({self.expr(e.value)})"

    def shuffle_(self, e: Shuffle) -> str:
        fn = {"xor": "__shfl_xor_sync", "down": "__shfl_down_sync", "up": "__shfl_up_sync", "idx": "__shfl_sync"}[e.kind]
        width = f", {e.width}" if e.width != 32 else ""
        return f"{fn}(0xffffffffu, {self.expr(e.value)}, {self.expr(e.lane)}{width})"

    def desc_advance(self, e) -> str:
        return f"tilehal::desc_advance({self.expr(e.desc)}, {self.expr(e.units)})"

    def mbar_ref(self, e) -> str:
        return f"&{e.buffer.name}[{self.expr(e.index)}]"

    def named_ref(self, e) -> str:
        return f"{e.text}[{self.expr(e.indices[0])}]"

    def elem_ref(self, e: ElemRef) -> str:
        return e.buffer.name + "".join(f"[{self.expr(i)}]" for i in e.indices)

    def cselect(self, e: CSelect) -> str:
        return f"(({self.expr(e.cond)}) ? {self.expr(e.a)} : {self.expr(e.b)})"

    # ------------------------------------------------------------ names and thread-level buffers

    def v(self, name: str | Expr, dtype: str = dt.INDEX) -> Expr:
        """The Var of a C name the lowering made (one object per name); digits give a constant."""
        if isinstance(name, Expr):
            return name
        if name.isdigit():
            return C(int(name))
        var = self._vars.get(name)
        if var is None:
            var = self._vars[name] = Var(name, dtype)
        return var

    def tbuf(self, buf: Buffer) -> Buffer:
        """The thread-level buffer of `buf`: global tensors and shared buffers flat (elements; shared
        with every stage), fragments (nregs,) and local buffers (n,) per thread, a var one register."""
        tb = self._tbufs.get(buf)
        if tb is None:
            if buf.scope == "fragment":
                n: Expr = C(self.inf.layouts[buf].nregs)
            elif buf.scope == "var":
                n = C(1)
            elif buf.scope == "shared":
                n = C(int(np.prod(buf.static_shape())) * self.stages.get(buf, 1))
            elif buf.static_shape() is not None:
                n = C(int(np.prod(buf.static_shape(), dtype=np.int64)))
            else:
                n = total([s if isinstance(s, Expr) else C(s) for s in buf.shape], "*")
            scope = "local" if buf.scope in ("fragment", "var") else buf.scope
            tb = self._tbufs[buf] = Buffer(buf.name, (n,), buf.dtype, scope)
        return tb

    def lower_expr(self, e: Expr) -> Expr:
        """A tile-level expression with its loads as thread-level element reads (printed identically)."""
        if isinstance(e, (Ref, ThreadIdx)):
            return e
        if isinstance(e, Load):
            return self.load_x(e)
        kids = e.children()
        if not kids:
            return e
        return e.rebuild([self.lower_expr(c) for c in kids])

    # ------------------------------------------------------------ memory references (thread-level expressions)

    def dim_x(self, s: Expr) -> Expr:
        return C(int(s.value)) if isinstance(s, Const) else s

    def flat_index_x(self, buf: Buffer, idx: list[Expr]) -> Expr:
        if not idx:
            return C(0)
        wide = buf.static_shape() is None or int(np.prod(buf.static_shape(), dtype=np.int64)) >= 2**31
        from ...ir.nodes import Cast

        code: Expr = Cast(idx[0], "int64") if wide else P(idx[0])
        for d in range(1, buf.ndim):
            code = P(B(B(code, "*", self.dim_x(buf.shape[d])), "+", P(idx[d])))
        return code

    def flat_index(self, buf: Buffer, idx: list[str]) -> str:
        return self.expr(self.flat_index_x(buf, [VerbatimExpr(i) for i in idx]))

    def smem_offset_x(self, buf: Buffer, idx: list[Expr]) -> Expr:
        shape = buf.static_shape()
        swz = self.swizzled.get(buf)
        if swz is None:
            off = self.flat_index_x(buf, idx)
        else:
            sh, mask, lv, atom = swz
            row = idx[0] if buf.ndim == 2 else C(0)
            xor = P(B(P(B(P(B(P(row), ">>", C(sh))), "&", C(mask))), "<<", C(lv)))
            if atom:
                la = int(math.log2(atom))
                col = idx[-1]
                off = P(B(B(P(B(P(B(P(col), ">>", C(la))), "*", C(shape[0] * atom))), "+", B(P(row), "*", C(atom))), "+",
                          P(B(P(B(P(col), "&", C(atom - 1))), "^", xor))))
            else:
                off = P(B(B(P(row), "*", C(shape[-1])), "+", P(B(P(idx[-1]), "^", xor))))
        stage = self.stage_expr.get(buf)
        if stage is not None and self.stages.get(buf, 1) > 1:
            st = VerbatimExpr(stage) if isinstance(stage, str) else stage
            off = P(B(B(P(st), "*", C(int(np.prod(shape)))), "+", off))
        return off

    def smem_offset(self, buf: Buffer, idx: list[str]) -> str:
        return self.expr(self.smem_offset_x(buf, [VerbatimExpr(i) for i in idx]))

    def thread_val_x(self, a: Axis) -> Expr:
        ts, e = a.tstride, a.extent
        if ts & (ts - 1) == 0 and e & (e - 1) == 0:
            sh = int(math.log2(ts))
            inner = P(B(TX, ">>", C(sh))) if sh else TX
            return P(B(inner, "&", C(e - 1))) if ts * e < self.threads else inner
        return P(B(P(B(TX, "/", C(ts))), "%", C(e)))

    def thread_val(self, a: Axis) -> str:
        return self.expr(self.thread_val_x(a))

    def frag_reg_x(self, buf: Buffer, idx: list[Expr]) -> Expr:
        f = self.inf.layouts.get(buf)
        if f is None:
            raise CompileError(f"fragment {buf.name}: no layout was inferred", self.kernel.loc)
        terms: list[Expr] = []
        for d, ix in enumerate(idx):
            axes = f.dims[d]
            par = self.par
            if (par is not None and par.layout is not None and isinstance(ix, Var) and ix in par.var_pos
                    and set(par.layout.dims[par.var_pos[ix]]) == set(axes)):
                p = par.var_pos[ix]
                for dd, a in f.reg_order:
                    if dd == d:
                        terms.append(B(self.v(par.regvars[(p, a)]), "*", C(f.reg_stride(d, a))))
            elif f.register_only(d):
                x = self.lower_expr(ix)
                for a in axes:
                    terms.append(B(P(B(P(B(P(x), "/", C(a.coeff))), "%", C(a.extent))), "*", C(f.reg_stride(d, a))))
            else:
                raise CompileError(f"fragment {buf.name}: element index {d} ({ix}) may be held by another thread "
                                   f"(layout {f}); access fragments in T.Parallel loops over their own shape",
                                   self.kernel.loc)
        return total(terms) or C(0)

    def frag_reg(self, buf: Buffer, idx: list[Expr]) -> str:
        return self.expr(self.frag_reg_x(buf, idx))

    def ref_x(self, buf: Buffer, idx: list[Expr]) -> Ref:
        """The element `buf[idx]` (tile-level indices; uniform or in the current T.Parallel context)."""
        tb = self.tbuf(buf)
        if buf.scope == "var":
            return Ref(tb, [C(0)], True)
        if buf.scope == "fragment":
            return Ref(tb, [self.frag_reg_x(buf, idx)])
        cidx = [self.lower_expr(i) for i in idx]
        if buf.scope == "shared":
            return Ref(tb, [self.smem_offset_x(buf, cidx)])
        return Ref(tb, [self.flat_index_x(buf, cidx)])

    def ref(self, buf: Buffer, idx: list[Expr]) -> str:
        """C lvalue of one element (uniform or inside the current T.Parallel context)."""
        return self.expr(self.ref_x(buf, idx))

    def global_guard_x(self, buf: Buffer, idx: list[Expr]) -> Expr | None:
        """That an element access of a global tensor is in bounds (None when every index is a constant
        inside its dim): element loads past the end read zero and stores are dropped, as on the
        interpreter and the C backend, instead of touching other memory."""
        from .common import _nonneg

        conds: list[Expr] = []
        for i, n in zip(idx, buf.shape):
            iv = self.interval(i)
            if iv is not None and isinstance(n, Const) and 0 <= iv[0] and iv[1] < int(n.value):
                continue
            c = self.lower_expr(i)
            conds.append(B(P(c), "<", self.dim_x(n), "bool"))
            if not _nonneg(i) and not (iv is not None and iv[0] >= 0):
                conds.append(B(P(c), ">=", C(0), "bool"))
        return conj(conds)

    def global_guard(self, buf: Buffer, idx: list[Expr]) -> str | None:
        g = self.global_guard_x(buf, idx)
        return self.expr(g) if g is not None else None

    def load_x(self, e: Load) -> Expr:
        out: Expr = self.ref_x(e.buffer, e.indices)
        if e.buffer.scope == "global":
            g = self.global_guard_x(e.buffer, e.indices)
            if g is not None:
                out = Select(g, out, Zero(e.buffer.dtype), e.buffer.dtype)
        if e.buffer.dtype in _LOW:
            out = ToFloat(out)
        return out

    def load(self, e: Load) -> str:
        return self.expr(self.load_x(e))

    def store_value_x(self, buf: Buffer, value: Expr) -> Expr:
        return Stored(buf.dtype, self.lower_expr(value))

    def store_value(self, buf: Buffer, value: Expr) -> str:
        return self.expr(self.store_value_x(buf, value))

    def init_x(self, b: Buffer, init: Expr | None) -> Expr:
        return self.store_value_x(b, init) if init is not None else Zero(b.dtype)

    # ------------------------------------------------------------ regions (the tile ops' element references)

    def region_idx_x(self, r, coords: list[Expr]) -> list[Expr]:
        """Buffer indices of the tile element whose non-unit coordinates are `coords`."""
        it = iter(coords)
        out = []
        for st, n in zip(r.starts, r.extents):
            x = self.lower_expr(st)
            out.append(P(B(x, "+", next(it))) if n != 1 else x)
        return out

    def region_idx(self, r, coords: list[str]) -> list[str]:
        return [self.expr(x) for x in self.region_idx_x(r, [VerbatimExpr(c) for c in coords])]

    def in_bounds_x(self, r, idx: list[Expr]) -> Expr | None:
        """That element `idx` of tile `r` of a global tensor is inside it (None: every element is)."""
        from .common import _nonneg

        if r.buffer.scope != "global":
            return None
        conds: list[Expr] = []
        for d, (i, n) in enumerate(zip(idx, r.buffer.shape)):
            st = r.starts[d]
            iv = self.interval(st)
            if iv is not None and isinstance(n, Const) and iv[0] >= 0 and iv[1] + r.extents[d] <= int(n.value):
                continue  # every element of the tile is inside the tensor
            conds.append(B(P(i), "<", self.dim_x(n), "bool"))
            if not _nonneg(st) and not (iv is not None and iv[0] >= 0):
                conds.append(B(P(i), ">=", C(0), "bool"))
        return conj(conds)

    def in_bounds(self, r, idx: list[str]) -> str | None:
        c = self.in_bounds_x(r, [VerbatimExpr(i) for i in idx])
        return self.expr(c) if c is not None else None

    def mem_ref_x(self, buf: Buffer, idx: list[Expr]) -> Ref:
        """The element of a memory buffer at thread-level indices `idx`."""
        tb = self.tbuf(buf)
        if buf.scope == "shared":
            return Ref(tb, [self.smem_offset_x(buf, idx)])
        if buf.scope == "var":
            return Ref(tb, [C(0)], True)
        return Ref(tb, [self.flat_index_x(buf, idx)])

    def mem_ref(self, buf: Buffer, idx: list[str]) -> str:
        return self.expr(self.mem_ref_x(buf, [VerbatimExpr(i) for i in idx]))

    def _reg_by_axes_x(self, f: Fragment, driver: Fragment, regvars) -> Expr:
        return total([B(self.v(regvars[(d, a)]), "*", C(f.reg_stride(d, a))) for d, a in f.reg_order]) or C(0)

    def _reg_by_axes(self, f: Fragment, driver: Fragment, regvars) -> str:
        return self.expr(self._reg_by_axes_x(f, driver, regvars))

    def reg_ref(self, buf: Buffer, reg: Expr) -> Ref:
        """Register `reg` of fragment / local `buf`."""
        return Ref(self.tbuf(buf), [reg])

    def reg_ref_b(self, tb: Buffer, reg: Expr) -> Ref:
        """Register `reg` of thread-level register buffer `tb`."""
        return Ref(tb, [reg])

    def vec_temp(self, dtype: str, n: int) -> Buffer:
        """A fresh vector temporary of `n` registers (`tilehal::Vec<T, n> _vK`)."""
        return Buffer(self.fresh("v"), (C(n),), dtype, "local")

    def scratch_buf(self, ctype_dtype: str, base: str) -> Buffer:
        """The shared scratch area at C address `base` seen as elements of `ctype_dtype` (printed
        `((float*)base)`: a staging area between two layouts)."""
        key = (ctype_dtype, base)
        tb = self._scratch_views.get(key)
        if tb is None:  # sized to the kernel's scratch area by thread_kernel() (its size is known after lowering)
            tb = self._scratch_views[key] = Buffer(f"(({value_type(ctype_dtype)}*){base})", (C(1),), ctype_dtype,
                                                   "shared")
        return tb

    def stage_fragment(self, buf: Buffer, to_scratch: bool, base: str) -> None:
        """fragment <-> scratch (row-major, compute type): the way between two layouts."""
        f = self.inf.layouts[buf]
        names = [self.fresh("i") for _ in f.shape]
        shape = list(f.shape)
        ct = dt.compute_type(buf.dtype)
        sb = self.scratch_buf(ct, base)

        def body(regvars):
            reg = self._reg_by_axes_x(f, f, regvars)
            flat: Expr = self.v(names[0]) if names else C(0)
            for d in range(1, len(names)):
                flat = B(B(P(flat), "*", C(shape[d])), "+", self.v(names[d]))
            sref = Ref(sb, [flat])
            fref = self.reg_ref(buf, reg)
            if to_scratch:
                self.add(TStore(sref, ToFloat(fref) if buf.dtype in _LOW else fref))
            else:
                self.add(TStore(fref, Conv(ct, buf.dtype, sref)))

        self.layout_loop(f, names, body)

    def loop_nest(self, names: list[str], extents: list[str], body) -> None:
        """A scope of serial loops `for (int n = 0; n < e; ++n)` (every thread runs all of them) around `body()`."""
        self.begin()
        for _ in names:
            self.begin()
        body()
        for n, e in reversed(list(zip(names, extents))):
            self.add(For(self.v(n), C(0), self.v(e), "serial", self.end(), annotations={"c_extent_bound": True}))
        self.add(Scope(self.end()))

    # ------------------------------------------------------------ statements (the "cuda" table's core rules)

    def sync(self) -> None:
        if self.has_wgmma:  # shared memory written by ordinary / cp.async stores is read next by wgmma
            self.add(Intrinsic("fence_proxy_async", [], []))
        self.add(Barrier())
        self.pending_w.clear()
        self.pending_r.clear()

    def let(self, s: Let) -> None:
        self.add(Let(s.var, self.lower_expr(s.value), loc=s.loc))

    def if_(self, s: If) -> None:
        r, w = self.tracked(s)
        if ((r | w) & self.pending_w) or (w & self.pending_r):
            self.sync()
        saved = (set(self.pending_r), set(self.pending_w))
        cond = self.lower_expr(s.cond)
        self.begin()
        self.stmt(s.then)
        then = self.end()
        after_then = (self.pending_r, self.pending_w)
        self.pending_r, self.pending_w = set(saved[0]), set(saved[1])
        orelse = None
        if s.orelse is not None:
            self.begin()
            self.stmt(s.orelse)
            orelse = self.end()
        self.add(If(cond, then, orelse, loc=s.loc))
        self.pending_r |= after_then[0]
        self.pending_w |= after_then[1]

    def for_(self, s: For) -> None:
        if s.kind == "parallel":
            self.hazard(s)
            return self.parallel(self.inf.nests[id(s)])
        return self.serial_loop(s)

    def store(self, s: Store) -> None:
        self.hazard(s)
        g = self.global_guard_x(s.buffer, s.indices) if s.buffer.scope == "global" else None
        self.add(TStore(self.ref_x(s.buffer, s.indices), self.store_value_x(s.buffer, s.value), g, loc=s.loc))

    def alloc(self, s: Alloc) -> None:
        b = s.buffer
        if b.scope == "shared":
            # placed in the shared-memory arena (prints nothing; the thread interpreter views the arena's bytes at
            # the planned offset, so buffers the planner lets share bytes share them there too)
            self.add(Alloc(self.tbuf(b), options={"arena_offset": self.smem[b].offset}, loc=s.loc))
            if b in self.zero_init:  # read before fully written: zero, as the interpreter allocates
                w = self.alias.get(b, {b})
                if (w & self.pending_w) or (w & self.pending_r):
                    self.sync()
                self.pending_w |= w
                n = int(np.prod(b.static_shape()))
                e = self.v(self.fresh("z"))
                # every element (the swizzle only permutes them)
                self.add(StridedFor(e, TX, C(n), self.threads, TStore(Ref(self.tbuf(b), [e]), Zero(b.dtype)),
                                    one_line=True, loc=s.loc))
            return
        if b.scope == "var":
            self.add(RegBuffer(self.tbuf(b), None, self.init_x(b, s.init), scalar=True, loc=s.loc))
            return
        if b.scope != "fragment" and b.static_shape() is None:
            raise CompileError(f"local buffer {b.name} needs a static shape", s.loc)
        frag = self.inf.layouts[b] if b.scope == "fragment" else None
        self.add(RegBuffer(self.tbuf(b), frag, self.init_x(b, s.init), loc=s.loc))

    def serial_loop(self, s: For) -> None:
        r, w = self.tracked(s)
        if (r | w) and (self.pending_r or self.pending_w):
            self.sync()
        if id(s) in self.pipes:
            return self.pipelined(s)
        self.begin()
        self.stmt(s.body)
        if w:
            self.sync()
        body = self.end()
        kind = "unroll" if s.kind == "unroll" else "serial"  # T.Pipelined without a pipeline plan: a serial loop
        self.add(For(s.var, self.lower_expr(s.start), self.lower_expr(s.extent), kind, body, loc=s.loc))
        if w:
            self.pending_r.clear()
            self.pending_w.clear()

    # ------------------------------------------------------------ T.Parallel

    def dim_exprs_x(self, f: Fragment, regvars: dict[tuple[int, Axis], str]) -> list[Expr]:
        out = []
        for d, axes in enumerate(f.dims):
            terms: list[Expr] = []
            for a in axes:
                val = self.thread_val_x(a) if a.kind == "t" else self.v(regvars[(d, a)])
                terms.append(B(val, "*", C(a.coeff)) if a.coeff != 1 else val)
            out.append(total(terms) or C(0))
        return out

    def dim_exprs(self, f: Fragment, regvars: dict[tuple[int, Axis], str]) -> list[str]:
        return [self.expr(x) for x in self.dim_exprs_x(f, regvars)]

    def lead_cond_x(self, f: Fragment) -> Expr | None:
        return conj([B(P(B(P(B(TX, "/", C(ts))), "%", C(e))), "==", C(0), "bool") for ts, e in f.replication()])

    def lead_cond(self, f: Fragment) -> str | None:
        c = self.lead_cond_x(f)
        return self.expr(c) if c is not None else None

    def layout_loop(self, f: Fragment, names: list[str], body, bounds: list[int] | None = None,
                    vec: tuple[int, Axis] | None = None) -> None:
        """Run `body(regvars)` for every element of layout `f` this thread holds, with C ints `names` bound
        to the element's index (elements past `bounds`, the padding of the layout, are skipped). With `vec`
        (the innermost register axis), that axis is not looped: body() handles its elements as a vector."""
        regvars: dict[tuple[int, Axis], str] = {}
        loops: list[tuple[Var, int]] = []
        self.begin()  # the scope
        for d, a in f.reg_order:
            if vec is not None and (d, a) == vec:
                regvars[(d, a)] = "0"
                continue
            nm = self.fresh("r")
            regvars[(d, a)] = nm
            loops.append((self.v(nm), a.extent))
            self.begin()
        for nm, ex in zip(names, self.dim_exprs_x(f, regvars)):
            self.add(Let(self.v(nm), ex))
        bounds = list(f.shape) if bounds is None else bounds
        cond = conj([B(self.v(nm), "<", C(n), "bool") for d, (nm, n) in enumerate(zip(names, bounds))
                     if f.covered(d) > n])
        if cond is not None:
            self.begin()
        body(regvars)
        if cond is not None:
            self.add(If(cond, self.end()))
        for var, ext in reversed(loops):
            self.add(For(var, C(0), C(ext), "unroll", self.end(), annotations={"c_extent_bound": True}))
        self.add(Scope(self.end()))

    def parallel(self, nest) -> None:
        names = [v.name for v in nest.vars]
        for v in nest.vars:
            self._vars[v.name] = v  # the loop's own variables: the body's expressions name them
        if nest.layout is None:
            return self.flat_loop([self._extent_x(nest, i) for i in range(len(names))], names,
                                  lambda: self.par_body(nest.body, ParCtx(None, {}, {}, None)))
        f = nest.layout
        lead = self.lead_cond_x(f)
        self.begin()
        if lead is not None:
            self.add(Let(self.v("_lead", "bool"), lead))

        def body(regvars):
            self.par_body(nest.body, ParCtx(f, {v: i for i, v in enumerate(nest.vars)}, regvars,
                                            "_lead" if lead is not None else None))

        self.layout_loop(f, names, body)
        self.add(Scope(self.end()))

    def _extent_x(self, nest, i: int) -> Expr:
        e = nest.extents[i]
        if e is not None:
            return C(e)
        s = nest.loop
        for _ in range(i):
            s = s.body if not isinstance(s.body, Seq) else s.body.body[0]
        return self.lower_expr(s.extent)

    def flat_loop(self, extents: list, names: list[str], body, step: int = 1) -> None:
        """Spread the index space `extents` (ints, digit strings or expressions) over the block's threads,
        element by element."""
        ext = [self.v(x) if isinstance(x, str) and x.isdigit() else x if isinstance(x, Expr) else VerbatimExpr(str(x))
               for x in extents]
        static = all(isinstance(x, Const) for x in ext)
        e = self.v(self.fresh("e"))
        if static:
            ints = [int(x.value) for x in ext]
            n = int(np.prod(ints))
            if n <= self.threads:
                self.begin()
                self.add(Let(e, TX))
                self._split_index(e, ext, names)
                body()
                self.add(If(B(TX, "<", C(n), "bool"), self.end()))
                return
            if -(-n // self.threads) <= 32:
                # A constant trip count (not `e = _tx; e < n; e += threads`, whose count depends on
                # _tx): nvcc unrolls it fully, each element's address is a base plus a constant and
                # no remainder loop or branch sits between the pipeline's copies and the MMAs.
                trips, j = -(-n // self.threads), self.v(self.fresh("j"))
                self.begin()
                # Trailing dims that the thread count steps over whole take their index from _tx alone
                # (the same for every j) and the leading one moves by a constant per j: nvcc then sees
                # each element's address as one base plus an immediate (e = _tx + j*T, T % E == 0:
                # e % E = _tx % E, e / E = _tx / E + j * (T / E)).
                rest: Expr = TX
                stride, i, split = self.threads, len(names) - 1, []
                while i > 0 and stride % ints[i] == 0:
                    split.append(Let(self.v(names[i]), B(rest, "%", C(ints[i]))))
                    rest, stride, i = P(B(rest, "/", C(ints[i]))), stride // ints[i], i - 1
                if n % self.threads or not split:
                    self.add(Let(e, B(TX, "+", B(j, "*", C(self.threads)))))
                if n % self.threads:
                    self.add(BreakIf(B(e, ">=", C(n), "bool")))
                for x in split:
                    self.add(x)
                if split:
                    if i == 0:
                        self.add(Let(self.v(names[0]), B(rest, "+", B(j, "*", C(stride)))))
                    else:  # general split of what is left: the leading dims' flat index
                        lead = self.v(self.fresh("q"))
                        self.add(Let(lead, B(rest, "+", B(j, "*", C(stride)))))
                        self._split_index(lead, [C(x) for x in ints[:i + 1]], names[:i + 1])
                else:
                    self._split_index(e, ext, names)
                body()
                self.add(ThreadFor(j, trips, self.end()))
                return
            stop: Expr = C(n)
        else:
            stop = total([P(x) for x in ext], "*") or C(1)
        self.begin()
        self._split_index(e, ext, names)
        body()
        self.add(StridedFor(e, TX, stop, self.threads, self.end()))

    def _split_index(self, flat: Expr, extents: list[Expr], names: list[str]) -> None:
        """`names` (row-major over `extents`) from the flat index `flat`."""
        rest = flat
        for i in range(len(names) - 1, -1, -1):
            if i == 0:
                self.add(Let(self.v(names[i]), rest))
            else:
                self.add(Let(self.v(names[i]), B(rest, "%", P(extents[i]))))
                nr = self.v(self.fresh("q"))
                self.add(Let(nr, B(rest, "/", P(extents[i]))))
                rest = nr

    # ------------------------------------------------------------ rules (the "cuda.parallel" table)

    def par_store(self, s: Store) -> None:
        conds = [self.v(self.par.lead, "bool")] if s.buffer.scope in ("global", "shared") and self.par.lead else []
        if s.buffer.scope == "global":
            conds += [g for g in [self.global_guard_x(s.buffer, s.indices)] if g is not None]
        self.add(TStore(self.ref_x(s.buffer, s.indices), self.store_value_x(s.buffer, s.value), conj(conds), loc=s.loc))

    def par_if(self, s: If) -> None:
        cond = self.lower_expr(s.cond)
        self.begin()
        self.par_stmt(s.then)
        then = self.end()
        orelse = None
        if s.orelse is not None:
            self.begin()
            self.par_stmt(s.orelse)
            orelse = self.end()
        self.add(If(cond, then, orelse, loc=s.loc))

    def par_for(self, s: For) -> None:
        self.begin()
        self.par_stmt(s.body)
        self.add(For(s.var, self.lower_expr(s.start), self.lower_expr(s.extent), s.kind, self.end(), loc=s.loc))

    def par_alloc(self, s: Alloc) -> None:
        b = s.buffer
        init = self.init_x(b, s.init)
        if b.scope == "var":
            self.add(RegBuffer(self.tbuf(b), None, init, scalar=True, loc=s.loc))
        else:
            self.add(RegBuffer(self.tbuf(b), None, init, unroll_init=False, loc=s.loc))


__all__ = ["ThreadBuilder"]
