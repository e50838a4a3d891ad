"""Thread-level IR -> CUDA C++ text: the one printer of the CUDA backend's kernel bodies.

The CUDA lowering (codegen.py's KernelCodegen and its rules/, with the node-building primitives of
lower_thread.py) builds a thread-level program: ir/thread.py's nodes, the core statements (Let,
Store, If, For, Alloc, Seq) on thread-level buffers, and the C-spelling nodes below. This module
prints it; each statement class has a "cuda.emit" rule (emitter, stmt, indent), each expression is
printed by the codegen's expression emitter (`CExprEmitter` and the "cexpr" rules of the nodes
here), so the text is exactly what the codegen wrote before it built nodes (the snapshot gate,
tests/test_cuda_snapshot.py).

C-spelling nodes (their meaning is that of the node they spell; the thread interpreter runs them):
- `Bare(op, a, b)`: `a op b` without the parentheses a BinOp prints (index sums / products the
  codegen writes bare), `Paren(e)`: `(e)`.
- `Verbatim(text)` / `VerbatimBlock(head, body)`: CUDA text of a lowering rule that still writes
  strings (not yet nodes; docs/tilelang.md lists which). The interpreter refuses them, naming the
  text, so a kernel is executable on the thread interpreter exactly when none is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tilehal

from ...errors import CompileError
from ...ir import dtypes as dt
from ...ir.nodes import Alloc, Buffer, Expr, For, If, Let, Load, Seq, Stmt, Var, register_rules
from ...ir.thread import (
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
)
from ..interp import _compute, np_dtype
from ..thread_interp import _poison
from .common import cuda_type

# ---------------------------------------------------------------- C-spelling nodes


C_OPS = ("+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=", "&&", "||", "&", "|", "^", "<<", ">>")


@dataclass(eq=False)
class Bare(Expr):
    """`a op b` in C (`op` a C operator, C semantics: integer / and % truncate), printed without
    enclosing parentheses: the index sums, products and conditions the lowering writes bare."""

    op: str
    a: Expr
    b: Expr
    dtype: str = dt.INDEX
    tight: bool = False  # `a+b`: no spaces around the operator

    def children(self) -> list[Expr]:
        return [self.a, self.b]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Bare(self.op, children[0], children[1], self.dtype, self.tight)


@dataclass(eq=False)
class Paren(Expr):
    """`(e)`: the value of `e`."""

    value: Expr

    @property
    def dtype(self) -> str:
        return self.value.dtype

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Paren(children[0])


@dataclass(eq=False)
class VerbatimExpr(Expr):
    """A C expression written as text by a rule not yet lowered to nodes (e.g. a pipeline stage)."""

    text: str
    dtype: str = dt.INDEX


@dataclass(eq=False)
class Ref(Load):
    """Element `indices[0]` of a thread-level buffer (flat: global tensors and shared buffers as
    arrays of elements, registers as (nregs,)), as stored: `name[offset]` (a one-register scalar
    prints `name`). Loading it gives the compute-type value, as Load does."""

    scalar: bool = False

    def rebuild(self, children: list[Expr]) -> Expr:
        return Ref(self.buffer, children, self.scalar)


@dataclass(eq=False)
class NamedRef(Ref):
    """A Ref printed through another name for the same memory (`(((float*)_tl_scratch) + 0)[i]`)."""

    text: str = ""

    def rebuild(self, children: list[Expr]) -> Expr:
        return NamedRef(self.buffer, children, self.scalar, self.text)


@dataclass(eq=False)
class Zero(Expr):
    """The zero of a storage type (`tilehal::from_float<__half>(0.0f)`, `0`)."""

    dtype: str


@dataclass(eq=False)
class ToFloat(Expr):
    """`tilehal::to_float(e)`: a 16/8-bit float element read as float (the compute value)."""

    value: Expr

    @property
    def dtype(self) -> str:
        return dt.compute_type(self.value.dtype)

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return ToFloat(children[0])


@dataclass(eq=False)
class Stored(Expr):
    """`value` converted for a store into a buffer of `to` (rounded to 16/8-bit floats, `!= 0` for bool)."""

    to: str
    value: Expr

    @property
    def dtype(self) -> str:
        return dt.compute_type(self.to)

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Stored(self.to, children[0])


@dataclass(eq=False)
class Conv(Expr):
    """A value stored as `src` converted to storage type `dst` (the codegen's `conv`)."""

    src: str
    to: str
    value: Expr

    @property
    def dtype(self) -> str:
        return dt.compute_type(self.to)

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Conv(self.src, self.to, children[0])


@dataclass(eq=False)
class TStore(Stmt):
    """`ref = value;` on a thread-level buffer, under `cond` when given (`if (cond) ref = value;`:
    a masked edge element, the lead replica)."""

    ref: Ref
    value: Expr
    cond: Expr | None = None
    op: str | None = None  # `ref op= value;` (the element combined with value)

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices, self.value] + ([self.cond] if self.cond is not None else [])

    def writes(self) -> set:
        return {self.ref.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return TStore(tr.expr(self.ref), tr.expr(self.value),
                      tr.expr(self.cond) if self.cond is not None else None, self.op, loc=self.loc)


@dataclass(eq=False)
class Verbatim(Stmt):
    """One line of CUDA written as text by a rule not yet lowered to nodes."""

    text: str

    side_effects = True

    def rebuild(self, tr: Any) -> Stmt:
        return self


@dataclass(eq=False)
class VerbatimBlock(Stmt):
    """`head {` body `}` where the head is CUDA text (a loop or condition not yet lowered to nodes)."""

    head: str
    body: Stmt

    side_effects = True

    def children(self) -> list[Stmt]:
        return [self.body]

    def rebuild(self, tr: Any) -> Stmt:
        return VerbatimBlock(self.head, tr.stmt(self.body) or Seq([]), loc=self.loc)


@dataclass(eq=False)
class CSelect(Expr):
    """`((cond) ? a : b)` as written (no conversions: both sides are already of the result's type)."""

    cond: Expr
    a: Expr
    b: Expr

    @property
    def dtype(self) -> str:
        return self.a.dtype

    def children(self) -> list[Expr]:
        return [self.cond, self.a, self.b]

    def rebuild(self, children: list[Expr]) -> Expr:
        return CSelect(*children)


@dataclass(eq=False)
class VecLoad(Stmt):
    """`tmp = tilehal::load_vec<T, n>(&ref);`: `n` contiguous elements from `ref` into the vector
    registers `tmp` (n registers). With `pred`: zeros where it is false (`if (pred) ... else for
    (...) tmp[_u] = 0;`). With `decl`, `tmp` is declared here (`tilehal::Vec<T, n> tmp = ...`)."""

    tmp: Buffer
    ref: Ref
    pred: Expr | None = None
    decl: bool = False

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices] + ([self.pred] if self.pred is not None else [])

    def reads(self) -> set:
        return {self.ref.buffer}

    def writes(self) -> set:
        return {self.tmp}

    def rebuild(self, tr: Any) -> Stmt:
        return VecLoad(self.tmp, tr.expr(self.ref),
                       tr.expr(self.pred) if self.pred is not None else None, self.decl, loc=self.loc)


@dataclass(eq=False)
class VecStore(Stmt):
    """`tilehal::store_vec<T, n>(&ref, tmp);` (under `cond`): the vector registers `tmp` to `n`
    contiguous elements from `ref`."""

    ref: Ref
    tmp: Buffer
    cond: Expr | None = None

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices] + ([self.cond] if self.cond is not None else [])

    def reads(self) -> set:
        return {self.tmp}

    def writes(self) -> set:
        return {self.ref.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return VecStore(tr.expr(self.ref), self.tmp,
                        tr.expr(self.cond) if self.cond is not None else None, loc=self.loc)


@dataclass(eq=False)
class PackedStore2(Stmt):
    """Two fp32 values rounded to a 16-bit pair and stored with one 32-bit store at `ref` (and the
    element after it): `*reinterpret_cast<unsigned*>(&ref) = tilehal::from_float2<T>(a, b);`."""

    ref: Ref
    a: Expr
    b: Expr
    cond: Expr | None = None

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices, self.a, self.b] + ([self.cond] if self.cond is not None else [])

    def writes(self) -> set:
        return {self.ref.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return PackedStore2(tr.expr(self.ref), tr.expr(self.a),
                            tr.expr(self.b), tr.expr(self.cond) if self.cond is not None else None, loc=self.loc)


@dataclass(eq=False)
class Comment(Stmt):
    """`// text` (what a lowered tile op was; no effect)."""

    text: str

    def rebuild(self, tr: Any) -> Stmt:
        return self


@dataclass(eq=False)
class IntLit(Expr):
    """An integer printed as its digits whatever its type (an accumulator's start value)."""

    value: int
    dtype: str = dt.INDEX


@dataclass(eq=False)
class CastC(Expr):
    """`((T)e)`: `e` converted to `to`'s C arithmetic type."""

    to: str
    value: Expr

    @property
    def dtype(self) -> str:
        return dt.compute_type(self.to)

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return CastC(self.to, children[0])


@dataclass(eq=False)
class MinMax(Expr):
    """`tl_max<T>(a, b)` / `tl_min<T>(a, b)` (`op` max or min) in the arithmetic type of `dtype`."""

    op: str
    a: Expr
    b: Expr
    dtype: str

    def children(self) -> list[Expr]:
        return [self.a, self.b]

    def rebuild(self, children: list[Expr]) -> Expr:
        return MinMax(self.op, children[0], children[1], self.dtype)


@dataclass(eq=False)
class Abs(Expr):
    """`fabsf(e)` (floats) / `abs(e)` (integers)."""

    value: Expr

    @property
    def dtype(self) -> str:
        return self.value.dtype

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Abs(children[0])


@dataclass(eq=False)
class AtomicAdd(Stmt):
    """`atomicAdd(&ref, value);` (under `cond`): value added to the element, every thread's add
    counted (the interpreter accumulates lanes that hit one element one after another)."""

    ref: Ref
    value: Expr
    cond: Expr | None = None

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices, self.value] + ([self.cond] if self.cond is not None else [])

    def writes(self) -> set:
        return {self.ref.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return AtomicAdd(tr.expr(self.ref), tr.expr(self.value),
                         tr.expr(self.cond) if self.cond is not None else None, loc=self.loc)


@dataclass(eq=False)
class VecAtomicAdd(Stmt):
    """`atomicAdd(reinterpret_cast<vt*>(&ref) + part, make((float)(v0), ...));`: one vector atomic
    adding `values` to the elements from `ref + part * len(values)` on."""

    ref: Ref
    part: int
    values: list[Expr]
    vtype: str  # float2, float4, __half2, __nv_bfloat162
    make: str  # its constructor from floats
    cond: Expr | None = None

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices, *self.values] + ([self.cond] if self.cond is not None else [])

    def writes(self) -> set:
        return {self.ref.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return VecAtomicAdd(tr.expr(self.ref), self.part,
                            [tr.expr(v) for v in self.values], self.vtype, self.make,
                            tr.expr(self.cond) if self.cond is not None else None, loc=self.loc)


@dataclass(eq=False)
class RegArray(Stmt):
    """Per-thread registers of a C type (`tilehal::u32 _a[4][4];`: the packed operands of mma.sync);
    `buffer` has the array's shape and the type of what the interpreter keeps in them (uint32)."""

    buffer: Buffer
    ctype: str

    def rebuild(self, tr: Any) -> Stmt:
        return self


@dataclass(eq=False)
class ElemRef(Load):
    """Element of a register array, C-indexed: `_a[_mi][2]`."""

    def rebuild(self, children: list[Expr]) -> Expr:
        return ElemRef(self.buffer, children)

    @property
    def dtype(self) -> str:
        return self.buffer.dtype


@dataclass(eq=False)
class Decl(Stmt):
    """`const int a = x, b = y;`: lets in order, on one line."""

    vars: list
    values: list[Expr]

    def exprs(self) -> list[Expr]:
        return list(self.values)

    def rebuild(self, tr: Any) -> Stmt:
        return Decl(list(self.vars), [tr.expr(v) for v in self.values], loc=self.loc)


@dataclass(eq=False)
class OneLine(Stmt):
    """Statements printed on one line (`_b[0][0] = _t[0]; _b[0][1] = _t[1];`); they run in order."""

    body: Stmt

    def children(self) -> list[Stmt]:
        return [self.body]

    def rebuild(self, tr: Any) -> Stmt:
        return OneLine(tr.stmt(self.body) or Seq([]), loc=self.loc)


# ---------------------------------------------------------------- mbarriers and TMA (sm_90)


@dataclass(eq=False)
class MbarArray(Stmt):
    """`n` mbarriers at mbarrier slot `offset` of the kernel's dynamic shared memory (`buffer`: shape (n,))."""

    buffer: Buffer
    offset: int

    def rebuild(self, tr: Any) -> Stmt:
        return self


@dataclass(eq=False)
class MbarInitAll(Stmt):
    """Thread 0 initializes every mbarrier of `buffer` to expect `count` arrivals (then fences the init)."""

    buffer: Buffer
    count: int = 1

    side_effects = True

    def rebuild(self, tr: Any) -> Stmt:
        return self


@dataclass(eq=False)
class MbarRef(Expr):
    """`&bar[index]`: one mbarrier (an address operand)."""

    buffer: Buffer
    index: Expr
    dtype: str = dt.INDEX

    def children(self) -> list[Expr]:
        return [self.index]

    def rebuild(self, children: list[Expr]) -> Expr:
        return MbarRef(self.buffer, children[0])


@dataclass(eq=False)
class MbarArriveExpectTx(Stmt):
    """Each executing thread arrives on `bar` and adds `nbytes` to the bytes its phase waits for."""

    bar: MbarRef
    nbytes: int

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [self.bar]

    def rebuild(self, tr: Any) -> Stmt:
        return MbarArriveExpectTx(tr.expr(self.bar), self.nbytes, loc=self.loc)


@dataclass(eq=False)
class MbarWait(Stmt):
    """Wait until the phase of `bar` with parity `parity` has completed (all arrivals, all bytes)."""

    bar: MbarRef
    parity: Expr

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [self.bar, self.parity]

    def rebuild(self, tr: Any) -> Stmt:
        return MbarWait(tr.expr(self.bar), tr.expr(self.parity), loc=self.loc)


@dataclass(eq=False)
class TmaLoad(Stmt):
    """`cp.async.bulk.tensor.2d` by the executing thread: the box (spec.box_rows x spec.box_cols) at
    (`row`, `col`) of the 2-D view of tensor `src` (leading dims as rows; zeros past its edges), into
    shared memory from `dst` on, in the descriptor's swizzle mode; its bytes complete on `bar`.
    `desc` is the index of the kernel's descriptor parameter."""

    dst: Ref
    desc: int
    spec: Any  # rules.tma.TmaSpec
    src: Buffer
    cols: int  # the tensor's last dim
    bar: Expr
    col: Expr
    row: Expr
    multicast: int = 0  # a CTA mask: the box lands at the same offset in each of those CTAs of the cluster

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.dst.indices, self.bar, self.col, self.row]

    def reads(self) -> set:
        return {self.src}

    def writes(self) -> set:
        return {self.dst.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return TmaLoad(tr.expr(self.dst), self.desc, self.spec, self.src,
                       self.cols, tr.expr(self.bar), tr.expr(self.col), tr.expr(self.row), self.multicast, loc=self.loc)


# ---------------------------------------------------------------- wgmma (sm_90)


@dataclass(eq=False)
class SmemDesc(Stmt):
    """`var` = the shared-memory matrix descriptor of the operand tile at `ref` (swizzle mode 1 / 2 / 3 =
    128 / 64 / 32-byte, leading and stride byte offsets: tilehal::make_smem_desc)."""

    var: Var
    ref: Ref
    swizzle: int
    lbo: int
    sbo: int

    def exprs(self) -> list[Expr]:
        return [*self.ref.indices]

    def rebuild(self, tr: Any) -> Stmt:
        return SmemDesc(self.var, tr.expr(self.ref), self.swizzle, self.lbo,
                        self.sbo, loc=self.loc)


@dataclass(eq=False)
class DescAdvance(Expr):
    """Descriptor `desc` with its start address moved on by `units` 16-byte units (tilehal::desc_advance)."""

    desc: Var
    units: Expr
    dtype: str = "int64"

    def children(self) -> list[Expr]:
        return [self.desc, self.units]

    def rebuild(self, children: list[Expr]) -> Expr:
        return DescAdvance(children[0], children[1])


@dataclass(eq=False)
class Wgmma(Stmt):
    """One wgmma.mma_async m64n{n}k16 (k32 for fp8) of the executing warpgroup: acc (the warpgroup's
    m64 x n accumulator block from register `acc` on, in the wgmma D layout) = A @ B + (scale ? acc : 0).
    A: descriptor `a` (`ta` 1: MN-major) or the registers `a_regs` (each warp's m16n8k16 A fragment);
    B: descriptor `b` (`tb` 1: MN-major). `form`: ss, rs, e4m3 (both K-major)."""

    form: str
    n: int
    ta: int
    tb: int
    tag: str
    dtype: str
    acc: Ref
    a: Expr | None
    a_regs: Buffer | None
    b: Expr
    scale: Expr
    a_index: Expr | None = None  # rs: the row of a 2-D `a_regs` (all k steps packed before the first wgmma)

    side_effects = True

    def exprs(self) -> list[Expr]:
        return [*self.acc.indices, *([self.a] if self.a is not None else []), self.b, self.scale,
                *([self.a_index] if self.a_index is not None else [])]

    def writes(self) -> set:
        return {self.acc.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return Wgmma(self.form, self.n, self.ta, self.tb, self.tag, self.dtype,
                     tr.expr(self.acc),
                     tr.expr(self.a) if self.a is not None else None, self.a_regs, tr.expr(self.b), tr.expr(self.scale),
                     tr.expr(self.a_index) if self.a_index is not None else None, loc=self.loc)


# ---------------------------------------------------------------- the printer


class Emitter:
    """Prints statements through the "cuda.emit" table; `cx` prints expressions (the codegen, a
    CExprEmitter with the "cexpr" methods of ThreadBuilder)."""

    def __init__(self, cx: Any) -> None:
        self.cx = cx
        self.lines: list[str] = []

    def line(self, ind: int, text: str) -> None:
        self.lines.append("  " * ind + text)

    def stmt(self, s: Stmt, ind: int) -> None:
        rule = s.rule("cuda.emit")
        if rule is None:
            raise TypeError(f"cuda emit: no rule for {type(s).__name__}")
        rule(self, s, ind)

    def block(self, head: str, body: Stmt, ind: int) -> None:
        self.line(ind, head + " {")
        self.stmt(body, ind + 1)
        self.line(ind, "}")

    def one_line(self, s: Stmt) -> str:
        sub = Emitter(self.cx)
        sub.stmt(s, 0)
        if len(sub.lines) != 1:
            raise TypeError(f"cuda emit: a one-line loop body printed {len(sub.lines)} lines")
        return sub.lines[0]


def emit_body(cx: Any, body: Stmt, ind: int = 1) -> list[str]:
    """The CUDA lines of a kernel body."""
    e = Emitter(cx)
    e.stmt(body, ind)
    return e.lines


def _seq(em: Emitter, s: Seq, ind: int) -> None:
    for c in s.body:
        em.stmt(c, ind)


def _let(em: Emitter, s: Let, ind: int) -> None:
    em.line(ind, f"const {em.cx.value_ctype(s.var.dtype)} {s.var.name} = {em.cx.expr(s.value)};")


def _tstore(em: Emitter, s: TStore, ind: int) -> None:
    line = f"{em.cx.expr(s.ref)} {s.op or ''}= {em.cx.expr(s.value)};"
    em.line(ind, f"if ({em.cx.expr(s.cond)}) {line}" if s.cond is not None else line)


def _if(em: Emitter, s: If, ind: int) -> None:
    em.block(f"if ({em.cx.expr(s.cond)})", s.then, ind)
    if s.orelse is not None:
        em.block("else", s.orelse, ind)


def _for(em: Emitter, s: For, ind: int) -> None:
    v, cx = s.var.name, em.cx
    if s.kind == "unroll":
        em.line(ind, "#pragma unroll")
    start, ext = cx.expr(s.start), cx.expr(s.extent)
    stop = ext if s.annotations.get("c_extent_bound") else f"{start} + {ext}"
    head = f"for (int {v} = {start}; {v} < {stop}; ++{v})"
    if s.annotations.get("c_one_line"):
        em.line(ind, f"{head} {em.one_line(s.body)}")
    else:
        em.block(head, s.body, ind)


def _thread_for(em: Emitter, s: ThreadFor, ind: int) -> None:
    em.line(ind, "#pragma unroll")
    em.block(f"for (int {s.var.name} = 0; {s.var.name} < {s.trips}; ++{s.var.name})", s.body, ind)


def _strided_for(em: Emitter, s: StridedFor, ind: int) -> None:
    v = s.var.name
    head = f"for (int {v} = {em.cx.expr(s.start)}; {v} < {em.cx.expr(s.stop)}; {v} += {s.step})"
    if s.one_line:
        em.line(ind, f"{head} {em.one_line(s.body)}")
    else:
        em.block(head, s.body, ind)


def _reg_buffer(em: Emitter, s: RegBuffer, ind: int) -> None:
    b, cx = s.buffer, em.cx
    t = cuda_type(b.dtype)
    init = cx.expr(s.init) if s.init is not None else cx.zero(b.dtype)
    if s.scalar:
        em.line(ind, f"{t} {b.name} = {init};")
        return
    if s.vec:
        em.line(ind, f"{_vec_type(b)} {b.name};")
        return
    em.line(ind, f"{t} {b.name}[{s.nregs}];")
    if s.init is not None:
        if s.unroll_init:
            em.line(ind, "#pragma unroll")
        em.line(ind, f"for (int _i = 0; _i < {s.nregs}; ++_i) {b.name}[_i] = {init};")


def _row(cx: Any, r: Load) -> str:
    """The register row an mma operand names: `_a[_mi]` (an element's indices but the last), `_t`."""
    return r.buffer.name + "".join(f"[{cx.expr(i)}]" for i in r.indices[:-1])


def _ldmatrix(em: Emitter, s: Intrinsic) -> str:
    return f"tilehal::{s.name}({_row(em.cx, s.outs[0])}, &{em.cx.expr(s.ins[0])});"


def _mma(em: Emitter, s: Intrinsic) -> str:
    cx = em.cx
    return (f"tilehal::{s.name}(tilehal::{s.attrs['tag']}(), *reinterpret_cast<{s.attrs['acc_ctype']}(*)[4]>"
            f"(&{cx.expr(s.outs[0])}), {_row(cx, s.ins[0])}, {_row(cx, s.ins[4])});")


# intrinsic -> its CUDA spelling: a format over the printed operands, or a function of (emitter, node)
INTRINSIC_SPELLING = {
    "wgmma_fence": "tilehal::wgmma_fence();", "wgmma_commit": "tilehal::wgmma_commit();",
    "wgmma_wait": lambda em, s: f"tilehal::wgmma_wait<{s.attrs['n']}>();",
    "wgmma_fence_operands": lambda em, s: f"tilehal::wgmma_fence_operands({s.attrs['buffer']});",
    "fence_proxy_async": "tilehal::fence_proxy_async_shared();",
    "ldmatrix_x4": _ldmatrix, "ldmatrix_x4_trans": _ldmatrix, "mma_m16n8k16": _mma, "mma_m16n8k32": _mma,
    "pack2_bits": lambda em, s: f"{em.cx.expr(s.outs[0])} = tilehal::pack2_bits({em.cx.expr(s.ins[0])}, "
                                f"{em.cx.expr(s.ins[1])});",
}


def _intrinsic(em: Emitter, s: Intrinsic, ind: int) -> None:
    spelling = INTRINSIC_SPELLING.get(s.name)
    if spelling is None:
        raise TypeError(f"cuda emit: intrinsic {s.name!r} has no CUDA spelling")
    if callable(spelling):
        em.line(ind, spelling(em, s))
        return
    em.line(ind, spelling.format(*[em.cx.expr(i) for i in s.ins], *[em.cx.expr(o) for o in s.outs]))


def _decl(em: Emitter, s: Decl, ind: int) -> None:
    parts = ", ".join(f"{v.name} = {em.cx.expr(x)}" for v, x in zip(s.vars, s.values))
    em.line(ind, f"const {em.cx.value_ctype(s.vars[0].dtype)} {parts};")


def _one_line(em: Emitter, s: OneLine, ind: int) -> None:
    body = s.body.body if isinstance(s.body, Seq) else [s.body]
    em.line(ind, " ".join(em.one_line(x) for x in body))


def _guarded(em: Emitter, cond: Expr | None, line: str) -> str:
    return f"if ({em.cx.expr(cond)}) {line}" if cond is not None else line


def _vec_type(b: Buffer) -> str:
    return f"tilehal::Vec<{cuda_type(b.dtype)}, {int(b.shape[0].value)}>"


def _vec_load(em: Emitter, s: VecLoad, ind: int) -> None:
    t, n, tmp = cuda_type(s.tmp.dtype), int(s.tmp.shape[0].value), s.tmp.name
    load = f"tilehal::load_vec<{t}, {n}>(&{em.cx.expr(s.ref)})"
    if s.decl:
        em.line(ind, f"{_vec_type(s.tmp)} {tmp} = {load};")
    elif s.pred is not None:
        em.line(ind, f"if ({em.cx.expr(s.pred)}) {tmp} = {load}; else for (int _u = 0; _u < {n}; ++_u) {tmp}[_u] = "
                     f"{em.cx.zero(s.tmp.dtype)};")
    else:
        em.line(ind, f"{tmp} = {load};")


def _vec_store(em: Emitter, s: VecStore, ind: int) -> None:
    t, n = cuda_type(s.tmp.dtype), int(s.tmp.shape[0].value)
    em.line(ind, _guarded(em, s.cond, f"tilehal::store_vec<{t}, {n}>(&{em.cx.expr(s.ref)}, {s.tmp.name});"))


def _packed_store2(em: Emitter, s: PackedStore2, ind: int) -> None:
    t = cuda_type(s.ref.buffer.dtype)
    line = (f"*reinterpret_cast<unsigned*>(&{em.cx.expr(s.ref)}) = tilehal::from_float2<{t}>({em.cx.expr(s.a)}, "
            f"{em.cx.expr(s.b)});")
    em.line(ind, _guarded(em, s.cond, line))


def _async_copy(em: Emitter, s: AsyncCopy, ind: int) -> None:
    cx = em.cx
    sref = f"&{s.src.name}[{cx.expr(s.src_idx[0])}]"
    dref = f"&{s.dst.name}[{cx.expr(s.dst_idx[0])}]"
    pred = ""
    if s.pred is not None:
        p = cx.expr(s.pred)
        sref = f"(({p}) ? (const void*)({sref}) : (const void*){s.src.name})"
        pred = ", " + p
    em.line(ind, f"tilehal::cp_async_{s.nbytes}({dref}, {sref}{pred});")


def _atomic_add(em: Emitter, s: AtomicAdd, ind: int) -> None:
    em.line(ind, _guarded(em, s.cond, f"atomicAdd(&{em.cx.expr(s.ref)}, {em.cx.expr(s.value)});"))


def _vec_atomic_add(em: Emitter, s: VecAtomicAdd, ind: int) -> None:
    vals = ", ".join(f"(float)({em.cx.expr(v)})" for v in s.values)
    line = f"atomicAdd(reinterpret_cast<{s.vtype}*>(&{em.cx.expr(s.ref)}) + {s.part}, {s.make}({vals}));"
    em.line(ind, _guarded(em, s.cond, line))


def _mbar_array(em: Emitter, s: MbarArray, ind: int) -> None:
    n = int(s.buffer.shape[0].value)
    em.line(ind, f"tilehal::u64* {s.buffer.name} = _tl_mbar + {s.offset};  // {n} mbarriers in dynamic shared memory")


def _mbar_init_all(em: Emitter, s: MbarInitAll, ind: int) -> None:
    n, bar = int(s.buffer.shape[0].value), s.buffer.name
    em.line(ind, f"if (_tx == 0) {{ for (int _s = 0; _s < {n}; ++_s) tilehal::mbarrier_init(&{bar}[_s], {s.count}); "
                 f"tilehal::fence_barrier_init(); }}")


def _tma_load(em: Emitter, s: TmaLoad, ind: int) -> None:
    cx = em.cx
    if s.multicast:
        em.line(ind, f"tilehal::tma_load_2d_multicast(&{cx.expr(s.dst)}, &_tma{s.desc}, {cx.expr(s.bar)}, "
                     f"{cx.expr(s.col)}, {cx.expr(s.row)}, {s.multicast});")
        return
    em.line(ind, f"tilehal::tma_load_2d(&{cx.expr(s.dst)}, &_tma{s.desc}, {cx.expr(s.bar)}, {cx.expr(s.col)}, "
                 f"{cx.expr(s.row)});")


def _smem_desc(em: Emitter, s: SmemDesc, ind: int) -> None:
    em.line(ind, f"const tilehal::u64 {s.var.name} = tilehal::make_smem_desc(&{em.cx.expr(s.ref)}, "
                 f"tilehal::SmemSwizzle({s.swizzle}), {s.lbo}, {s.sbo});")


def _wgmma(em: Emitter, s: Wgmma, ind: int) -> None:
    cx = em.cx
    acc, b, scale = f"&{cx.expr(s.acc)}", cx.expr(s.b), cx.expr(s.scale)
    if s.form == "rs":
        regs = s.a_regs.name if s.a_index is None else f"{s.a_regs.name}[{cx.expr(s.a_index)}]"
        em.line(ind, f"tilehal::Wgmma16<{s.n}>::rs<{s.tb}>({s.tag}, {acc}, {regs}, {b}, {scale});")
    elif s.form == "e4m3":
        em.line(ind, f"tilehal::WgmmaE4M3<{s.n}>::mma({acc}, {cx.expr(s.a)}, {b}, {scale});")
    else:
        em.line(ind, f"tilehal::Wgmma16<{s.n}>::ss<{s.ta}, {s.tb}>({s.tag}, {acc}, {cx.expr(s.a)}, {b}, {scale});")


def _alloc(em: Emitter, s: Alloc, ind: int) -> None:
    if s.buffer.scope != "shared":  # shared buffers live in the kernel's arena (declared at its top)
        raise TypeError(f"cuda emit: Alloc of a {s.buffer.scope} buffer in a thread-level program")


register_rules("cuda.emit", {
    Seq: _seq,
    Verbatim: lambda em, s, ind: em.line(ind, s.text),
    VerbatimBlock: lambda em, s, ind: em.block(s.head, s.body, ind),
    Scope: lambda em, s, ind: em.block("", s.body, ind),
    Let: _let, TStore: _tstore, If: _if, For: _for, ThreadFor: _thread_for, StridedFor: _strided_for,
    BreakIf: lambda em, s, ind: em.line(ind, f"if ({em.cx.expr(s.cond)}) break;"),
    Barrier: lambda em, s, ind: em.line(ind, "__syncthreads();"),
    RegBuffer: _reg_buffer, Intrinsic: _intrinsic, Alloc: _alloc, VecLoad: _vec_load, VecStore: _vec_store,
    PackedStore2: _packed_store2, AsyncCopy: _async_copy,
    AsyncCommit: lambda em, s, ind: em.line(ind, "tilehal::cp_async_commit();"),
    AsyncWait: lambda em, s, ind: em.line(ind, f"tilehal::cp_async_wait<{s.n}>();"),
    Comment: lambda em, s, ind: em.line(ind, f"// {s.text}"),
    AtomicAdd: _atomic_add, VecAtomicAdd: _vec_atomic_add, Decl: _decl, OneLine: _one_line,
    MbarArray: _mbar_array, MbarInitAll: _mbar_init_all, TmaLoad: _tma_load, SmemDesc: _smem_desc, Wgmma: _wgmma,
    MbarArriveExpectTx: lambda em, s, ind: em.line(ind, f"tilehal::mbarrier_arrive_expect_tx({em.cx.expr(s.bar)}, "
                                                        f"{s.nbytes});"),
    MbarWait: lambda em, s, ind: em.line(ind, f"tilehal::mbarrier_wait({em.cx.expr(s.bar)}, {em.cx.expr(s.parity)});"),
    RegArray: lambda em, s, ind: em.line(ind, f"{s.ctype} {s.buffer.name}"
                                              f"{''.join(f'[{int(d.value)}]' for d in s.buffer.shape)};"),
})

# expressions: the codegen's methods that print them (lower_thread.ThreadBuilder)
register_rules("cexpr", {Bare: "bare", Paren: "paren", VerbatimExpr: "verbatim_expr", Ref: "ref_", Zero: "zero_",
                         ToFloat: "to_float_", Stored: "stored_", Conv: "conv_", ThreadIdx: "thread_idx",
                         CSelect: "cselect", IntLit: "int_lit", CastC: "cast_c", MinMax: "min_max", Abs: "abs_",
                         Shuffle: "shuffle_", ElemRef: "elem_ref", NamedRef: "named_ref", MbarRef: "mbar_ref",
                         DescAdvance: "desc_advance"})


# ---------------------------------------------------------------- the thread interpreter's rules for these nodes


def _c_binop(op: str, a: Any, b: Any) -> Any:
    a, b = np.asarray(a), np.asarray(b)
    if op in ("&&", "||"):
        return np.logical_and(a, b) if op == "&&" else np.logical_or(a, b)
    cmp = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
           "!=": np.not_equal}.get(op)
    if cmp is not None:
        return cmp(a, b)
    if a.dtype.kind in "iub" and b.dtype.kind in "iub":
        a, b = a.astype(np.int64), b.astype(np.int64)
        if op == "/":
            return (a - np.fmod(a, b)) // b  # C: truncate toward zero
        if op == "%":
            return np.fmod(a, b)
    fn = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "&": np.bitwise_and, "|": np.bitwise_or,
          "^": np.bitwise_xor, "<<": np.left_shift, ">>": np.right_shift}[op]
    return fn(a, b)


def _verbatim(it: Any, s: Any) -> None:
    text = s.text if isinstance(s, (Verbatim, VerbatimExpr)) else s.head
    raise CompileError(f"thread interp: CUDA text not lowered to thread-level nodes yet: {text.strip()!r}",
                       getattr(s, "loc", None))


def _storage(v: Any, to: str) -> Any:
    """`v` stored as `to` and read back (rounded to 16/8-bit floats, truncated to integers)."""
    a = np.asarray(v)
    if dt.is_int(to) and a.dtype.kind == "f":
        a = np.trunc(a)
    if to == "bool":
        return a != 0
    out = _compute(a.astype(np_dtype(to)), to)
    return out if out.ndim else out[()]


def _tstore_interp(it: Any, s: TStore) -> None:
    saved = it.mask
    if s.cond is not None:
        c = np.asarray(it.expr(s.cond), dtype=bool)
        it.mask = c if saved is None else (np.asarray(saved) & c)
    try:
        idx = [it.expr(i) for i in s.ref.indices]
        val = it.expr(s.value)
        if s.op is not None:
            val = _c_binop(s.op, it.load(s.ref.buffer, idx), val)
        it.store(s.ref.buffer, idx, val, s.loc)
    finally:
        it.mask = saved


def _masked(it: Any, cond: Expr | None):
    """The lanes a conditional statement writes: the active lanes where `cond` holds."""
    on = it.active()
    return on if cond is None else on & it.lanes_of(it.expr(cond), bool)


def _elements(it: Any, ref: Ref, n: int) -> np.ndarray:
    """(threads, n) flat element indices from `ref` on."""
    return it.lanes_of(it.expr(ref.indices[0]), np.int64)[:, None] + np.arange(n, dtype=np.int64)


def _vec_load_interp(it: Any, s: VecLoad) -> None:
    n = int(s.tmp.shape[0].value)
    if s.decl:
        it.bufs[s.tmp] = np.zeros((it.threads, n), dtype=np_dtype(s.tmp.dtype))
        it.regs.add(s.tmp)
    on = it.active()
    take = on & (it.lanes_of(it.expr(s.pred), bool) if s.pred is not None else True)
    src = it.bufs[s.ref.buffer]
    idx = _elements(it, s.ref, n)
    regs = it.bufs[s.tmp]
    if take.any():
        sel = idx[take]
        if sel.min() < 0 or sel.max() >= src.shape[0]:
            raise tilehal.LaunchError(f"{s.loc or ''}: load_vec from {s.ref.buffer.name}: elements [{sel.min()}, "
                                      f"{sel.max()}] outside its {src.shape[0]}")
        if s.ref.buffer.scope in ("shared", "global"):
            it.track(s.ref.buffer, sel, False, s.loc, lanes=np.broadcast_to(np.nonzero(take)[0][:, None], sel.shape))
        regs[take] = src[sel]
    regs[on & ~take] = 0


def _vec_store_interp(it: Any, s: VecStore) -> None:
    n = int(s.tmp.shape[0].value)
    on = _masked(it, s.cond)
    idx = _elements(it, s.ref, n)[on]
    it._check_bounds(s.ref.buffer, [idx.ravel()], it.bufs[s.ref.buffer].shape, s.loc)
    if s.ref.buffer.scope in ("shared", "global"):
        it.track(s.ref.buffer, idx, True, s.loc, lanes=np.broadcast_to(np.nonzero(on)[0][:, None], idx.shape))
    it.bufs[s.ref.buffer][idx] = it.bufs[s.tmp][on]


def _packed_store2_interp(it: Any, s: PackedStore2) -> None:
    on = _masked(it, s.cond)
    dst = it.bufs[s.ref.buffer]
    idx = _elements(it, s.ref, 2)[on]
    it._check_bounds(s.ref.buffer, [idx.ravel()], dst.shape, s.loc)
    if s.ref.buffer.scope in ("shared", "global"):
        it.track(s.ref.buffer, idx, True, s.loc, lanes=np.broadcast_to(np.nonzero(on)[0][:, None], idx.shape))
    vals = np.stack([it.lanes_of(it.expr(s.a)), it.lanes_of(it.expr(s.b))], axis=1)[on]
    dst[idx] = vals.astype(dst.dtype)


def _atomic_interp(it: Any, ref: Ref, first: int, values: list[Any], cond: Expr | None, loc: Any) -> None:
    on = _masked(it, cond)
    arr = it.bufs[ref.buffer]
    base = it.lanes_of(it.expr(ref.indices[0]), np.int64)[on]
    for k, v in enumerate(values):
        idx = base + first + k
        it._check_bounds(ref.buffer, [idx], arr.shape, loc)
        np.add.at(arr, idx, np.asarray(it.lanes_of(v))[on].astype(arr.dtype))


def _reg_array_interp(it: Any, s: RegArray) -> None:
    it.bufs[s.buffer] = np.zeros((it.threads, *[int(d.value) for d in s.buffer.shape]), dtype=np_dtype(s.buffer.dtype))
    it.regs.add(s.buffer)


def _decl_interp(it: Any, s: Decl) -> None:
    for v, x in zip(s.vars, s.values):
        it.env[v] = it.expr(x)


class _Mbar:
    """One mbarrier's state: arrivals and transaction bytes of its current phase, the TMA copies that
    complete on it (landing when a wait completes the phase), the phase count."""

    def __init__(self, count: int) -> None:
        self.count, self.arrived, self.expect, self.phase, self.copies = count, 0, 0, 0, []


def _one_lane(it: Any, e: Expr, what: str, loc: Any) -> int:
    """The value of `e` in the executing lanes (they must agree)."""
    on = it.active()
    vals = np.unique(it.lanes_of(it.expr(e), np.int64)[on])
    if vals.size != 1:
        raise tilehal.LaunchError(f"{loc or ''}: {what}: the executing threads disagree ({vals.tolist()})")
    return int(vals[0])


def _mbar(it: Any, ref: Expr, loc: Any) -> _Mbar:
    if not isinstance(ref, MbarRef):
        _verbatim(it, ref)
    states = it.bufs[ref.buffer]
    i = _one_lane(it, ref.index, f"mbarrier {ref.buffer.name}", loc)
    if not 0 <= i < len(states) or states[i] is None:
        raise tilehal.LaunchError(f"{loc or ''}: mbarrier {ref.buffer.name}[{i}] used before its init")
    return states[i]


def _mbar_arrive_interp(it: Any, s: MbarArriveExpectTx) -> None:
    n = int(it.active().sum())
    if n:
        st = _mbar(it, s.bar, s.loc)
        st.arrived += n
        st.expect += n * s.nbytes


_SWZ_BITS = {"none": 0, "32B": 1, "64B": 2, "128B": 3}


def _tma_load_interp(it: Any, s: TmaLoad) -> None:
    on = it.active()
    for _ in range(int(on.sum())):  # each executing thread issues one copy
        st = _mbar(it, s.bar, s.loc)
        src, dst = it.bufs[s.src], it.bufs[s.dst.buffer]
        rows, cols = src.size // s.cols, s.cols
        view = src.reshape(rows, cols)
        r0, c0 = _one_lane(it, s.row, "tma row", s.loc), _one_lane(it, s.col, "tma col", s.loc)
        br, bc = s.spec.box_rows, s.spec.box_cols
        box = np.zeros((br, bc), dtype=src.dtype)
        rr, cc = np.arange(r0, r0 + br), np.arange(c0, c0 + bc)
        ri, ci = (rr >= 0) & (rr < rows), (cc >= 0) & (cc < cols)
        box[np.ix_(ri, ci)] = view[np.ix_(rr[ri], cc[ci])]
        es = dst.dtype.itemsize
        base = _one_lane(it, s.dst.indices[0], "tma destination", s.loc) * es
        bits = _SWZ_BITS[s.spec.swizzle]
        if bits and base % 1024:
            raise tilehal.LaunchError(f"{s.loc or ''}: tma_load_2d into {s.dst.buffer.name}: a {s.spec.swizzle} "
                                      f"swizzled destination at byte {base} (not 1024-byte aligned)")
        addr = base + (np.arange(br)[:, None] * (bc * es) + np.arange(bc)[None, :] * es)
        if bits:  # the hardware's swizzle: 16-byte chunk bits [4, 4 + bits) ^= address bits [7, 7 + bits)
            addr = addr ^ (((addr >> 7) & ((1 << bits) - 1)) << 4)
        if addr.min() < 0 or addr.max() + es > dst.size * es:
            raise tilehal.LaunchError(f"{s.loc or ''}: tma_load_2d box outside {s.dst.buffer.name}")
        elem = (addr // es).ravel()
        it.wgmma_hazard(s.dst.buffer, elem, "overwritten by TMA", s.loc)
        _poison(dst, (elem,))
        st.copies.append((s.dst.buffer, dst, elem, box.ravel().copy(), br * bc * es))


def _mbar_wait_interp(it: Any, s: MbarWait) -> None:
    if not it.active().any():
        return
    st = _mbar(it, s.bar, s.loc)
    parity = _one_lane(it, s.parity, "mbarrier wait parity", s.loc)
    if st.phase % 2 != parity:
        return  # that phase has completed
    got = sum(c[4] for c in st.copies)
    if st.arrived < st.count or got != st.expect:
        raise tilehal.LaunchError(f"{s.loc or ''}: mbarrier_wait on {s.bar.buffer.name} (phase {st.phase}) never "
                                  f"returns: {st.arrived} of {st.count} arrivals, {got} of {st.expect} bytes issued")
    for buf, dst, elem, vals, _ in st.copies:
        dst[elem] = vals
        hit = it.accessed(buf, elem)  # the box was written asynchronously: no thread may have touched it since
        if hit is not None:              # the last barrier
            it._race(buf, hit, "overwritten by a TMA load while threads accessed it", s.loc)
    st.arrived, st.expect, st.copies, st.phase = 0, 0, [], st.phase + 1


def _mbar_init_interp(it: Any, s: MbarInitAll) -> None:
    states = it.bufs[s.buffer]
    for i in range(len(states)):
        states[i] = _Mbar(s.count)


class _Desc:
    """A shared-memory matrix descriptor as the interpreter keeps it: the tile's buffer, its start (bytes,
    per lane), swizzle mode, leading and stride byte offsets."""

    def __init__(self, buffer: Buffer, start: np.ndarray, swizzle: int, lbo: int, sbo: int) -> None:
        self.buffer, self.start, self.swizzle, self.lbo, self.sbo = buffer, start, swizzle, lbo, sbo


_DESC_SWZ = {1: (3, 128), 2: (2, 64), 3: (1, 32)}  # mode -> (swizzle bits, K-major row pitch in bytes)


def _smem_desc_interp(it: Any, s: SmemDesc) -> None:
    mem = it.bufs[s.ref.buffer]
    start = it.lanes_of(it.expr(s.ref.indices[0]), np.int64) * mem.dtype.itemsize
    it.env[s.var] = _Desc(s.ref.buffer, start, s.swizzle, s.lbo, s.sbo)


def _desc_advance_interp(it: Any, e: DescAdvance) -> _Desc:
    d = it.expr(e.desc)
    units = it.lanes_of(it.expr(e.units), np.int64)
    return _Desc(d.buffer, d.start + 16 * units, d.swizzle, d.lbo, d.sbo)


def _operand(it: Any, d: _Desc, lane: int, rows: int, kbytes: int, mn_major: bool, dtype: str, loc: Any,
             used: list | None = None) -> np.ndarray:
    """The (rows x K) operand a descriptor names (rows along M or N), in the compute type (its elements
    appended to `used`: what the in-flight wgmma reads)."""
    if d.swizzle not in _DESC_SWZ:
        raise tilehal.LaunchError(f"{loc or ''}: wgmma descriptor without a swizzle mode is not interpreted")
    bits, pitch = _DESC_SWZ[d.swizzle]
    es = np_dtype(dtype).itemsize
    start = int(d.start[lane])
    if start % 16:
        raise tilehal.LaunchError(f"{loc or ''}: wgmma descriptor start {start} not 16-byte aligned")
    r = np.arange(rows)[:, None]
    k = np.arange(kbytes // es)[None, :]
    if mn_major:
        addr = start + (r // 64) * d.lbo + (k // 8) * d.sbo + (k % 8) * 128 + (r % 64) * es
    else:
        addr = start + (r // 8) * d.sbo + (r % 8) * pitch + k * es
    addr = addr ^ (((addr >> 7) & ((1 << bits) - 1)) << 4)
    byt = it.bufs[d.buffer].view(np.uint8)
    if addr.min() < 0 or addr.max() + es > byt.size:
        raise tilehal.LaunchError(f"{loc or ''}: wgmma operand outside {d.buffer.name}")
    raw = byt[addr[..., None] + np.arange(es)]
    if used is not None:
        itemsize = it.bufs[d.buffer].dtype.itemsize
        used.append((d.buffer, np.unique(addr // itemsize)))
    return _compute(np.ascontiguousarray(raw).view(np_dtype(dtype))[..., 0], dtype).astype(np.float64)


def _wgmma_interp(it: Any, s: Wgmma) -> None:
    if it.threads % 128 or not it.active().all():
        raise tilehal.LaunchError(f"{s.loc or ''}: wgmma needs every thread of whole warpgroups")
    es = np_dtype(s.dtype).itemsize
    kbytes = 32  # k16 of 16-bit types, k32 of fp8
    K = kbytes // es
    regs = it.bufs[s.acc.buffer]
    base = it.lanes_of(it.expr(s.acc.indices[0]), np.int64)
    scale = it.lanes_of(it.expr(s.scale), bool)
    da = it.expr(s.a) if s.a is not None else None
    db = it.expr(s.b)
    lane = np.arange(128)
    w, g, t = lane // 32, (lane % 32) // 4, lane % 4
    used: list = []
    for grp in range(it.threads // 128):
        l0 = grp * 128
        B = _operand(it, db, l0, s.n, kbytes, bool(s.tb), s.dtype, s.loc, used)  # (n, K)
        if da is not None:
            A = _operand(it, da, l0, 64, kbytes, bool(s.ta), s.dtype, s.loc, used)  # (64, K)
        else:  # each warp's m16n8k16 A fragment in 4 packed registers
            words = it.bufs[s.a_regs][l0:l0 + 128]
            if s.a_index is not None:  # a uniform row of the packed k steps
                words = words[:, int(it.lanes_of(it.expr(s.a_index), np.int64)[l0])]
            words = words.astype(np.uint32)  # (128, 4)
            vals = _compute(np.ascontiguousarray(words).view(np_dtype(s.dtype)), s.dtype).reshape(128, 4, 2)
            A = np.zeros((64, K))
            for r, (row0, col0) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                for e in range(2):
                    A[16 * w + g + row0, col0 + 2 * t + e] = vals[:, r, e]
        D = A @ B.T  # (64, n), exact in fp64
        sel = slice(l0, l0 + 128)
        b0 = base[sel]
        keep = scale[sel]
        for j in range(s.n // 8):
            for q, (row0, col) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                idx = b0 + 4 * j + q
                old = regs[sel][lane, idx].astype(np.float64)
                val = np.where(keep, old, 0.0) + D[16 * w + g + row0, 8 * j + 2 * t + col]
                regs[l0 + lane, idx] = val.astype(regs.dtype)
    # in flight until a wgmma_wait retires its group: its accumulators and operand tiles are the tensor cores'
    it.wg_open.append((s.acc.buffer, used))


register_rules("thread.interp", {
    SmemDesc: _smem_desc_interp, DescAdvance: _desc_advance_interp, Wgmma: _wgmma_interp,
    MbarArray: lambda it, s: it.bufs.__setitem__(s.buffer, [None] * int(s.buffer.shape[0].value)),
    MbarInitAll: _mbar_init_interp, MbarRef: lambda it, e: it.expr(e.index), MbarArriveExpectTx: _mbar_arrive_interp,
    TmaLoad: _tma_load_interp, MbarWait: _mbar_wait_interp,
    RegArray: _reg_array_interp, Decl: _decl_interp, OneLine: lambda it, s: it.stmt(s.body),
    ElemRef: lambda it, e: it.load(e.buffer, [it.expr(i) for i in e.indices]),
    AtomicAdd: lambda it, s: _atomic_interp(it, s.ref, 0, [it.expr(s.value)], s.cond, s.loc),
    VecAtomicAdd: lambda it, s: _atomic_interp(it, s.ref, s.part * len(s.values), [it.expr(v) for v in s.values],
                                               s.cond, s.loc),
    Comment: lambda it, s: None,
    IntLit: lambda it, e: np_dtype(dt.compute_type(e.dtype)).type(e.value),
    CastC: lambda it, e: _storage(it.expr(e.value), dt.compute_type(e.to)),
    MinMax: lambda it, e: (np.maximum if e.op == "max" else np.minimum)(it.expr(e.a), it.expr(e.b)),
    Abs: lambda it, e: np.abs(it.expr(e.value)),
    CSelect: lambda it, e: np.where(it.expr(e.cond), it.expr(e.a), it.expr(e.b)),
    VecLoad: _vec_load_interp, VecStore: _vec_store_interp, PackedStore2: _packed_store2_interp,
    Bare: lambda it, e: _c_binop(e.op, it.expr(e.a), it.expr(e.b)),
    Paren: lambda it, e: it.expr(e.value),
    VerbatimExpr: _verbatim, Verbatim: _verbatim, VerbatimBlock: _verbatim,
    Zero: lambda it, e: np_dtype(dt.compute_type(e.dtype)).type(0),
    ToFloat: lambda it, e: it.expr(e.value),
    Stored: lambda it, e: _storage(it.expr(e.value), e.to),
    Conv: lambda it, e: _storage(it.expr(e.value), e.to),
    TStore: _tstore_interp,
})

__all__ = ["DescAdvance", "SmemDesc", "Wgmma", "MbarArray", "MbarArriveExpectTx", "MbarInitAll", "MbarRef", "MbarWait", "TmaLoad", "NamedRef", "Decl", "ElemRef", "OneLine", "RegArray", "Abs", "AtomicAdd", "VecAtomicAdd", "Bare", "CSelect", "CastC", "Comment", "IntLit", "MinMax", "Conv", "PackedStore2", "VecLoad", "VecStore", "Emitter", "Paren", "Ref", "Stored", "TStore", "ToFloat", "Verbatim", "VerbatimBlock",
           "VerbatimExpr", "Zero", "emit_body"]


# ---------------------------------------------------------------- verifier rules for these nodes ("verify": structure,
# "thread.verify": the thread-level checks of verify_thread)


def _verify_decl(v: Any, s: Decl, in_kernel: bool) -> None:
    for var, x in zip(s.vars, s.values):
        v.let(Let(var, x), in_kernel)


def _verify_children(v: Any, s: Stmt, in_kernel: bool) -> None:
    for c in s.children():
        v.stmt(c, in_kernel)


def _verify_regs(v: Any, s: RegArray, in_kernel: bool) -> None:
    v.visible[-1].add(s.buffer)


def _thread_decl(c: Any, s: Decl) -> None:
    for var, x in zip(s.vars, s.values):
        c.let(Let(var, x))


def _thread_regs(c: Any, s: RegArray) -> None:
    c.scalar_only(s)
    c.regs.add(s.buffer)


def _thread_verbatim(c: Any, s: Stmt) -> None:
    text = s.text if isinstance(s, Verbatim) else s.head
    c.fail(s, f"CUDA text not lowered to thread-level nodes yet: {text.strip()!r}")


def _verify_desc(v: Any, s: SmemDesc, in_kernel: bool) -> None:
    v.defined.add(s.var)


def _thread_desc(c: Any, s: SmemDesc) -> None:
    c.scalar_only(s)
    c.lane_vars.add(s.var)  # each warpgroup's own tile


register_rules("verify", {Decl: _verify_decl, OneLine: _verify_children, RegArray: _verify_regs, SmemDesc: _verify_desc})
register_rules("thread.verify", {Decl: _thread_decl, RegArray: _thread_regs, Verbatim: _thread_verbatim,
                                 VerbatimBlock: _thread_verbatim, SmemDesc: _thread_desc})


# ---------------------------------------------------------------- the IR printer's rules for these nodes (ir/printer.py:
# the thread-level program as readable text, `PrimFunc.script()`; CUDA text is printed as T.cuda(...))


def _p(e: Expr) -> str:
    from ...ir.printer import print_expr

    return print_expr(e)


def _pl(lines: list[str], ind: int, text: str, cond: Expr | None = None) -> None:
    lines.append("    " * ind + (f"if {_p(cond)}: {text}" if cond is not None else text))


def _print_block(lines: list[str], head: str, body: Stmt, ind: int) -> None:
    from ...ir.printer import _block

    lines.append("    " * ind + head)
    _block(lines, body, ind + 1)


def _print_one_line(lines: list[str], s: OneLine, ind: int) -> None:
    from ...ir.printer import _stmt

    sub: list[str] = []
    for c in (s.body.body if isinstance(s.body, Seq) else [s.body]):
        _stmt(sub, c, 0)
    lines.append("    " * ind + "; ".join(sub))


def _print_wgmma(lines: list[str], s: Wgmma, ind: int) -> None:
    a = s.a_regs.name if s.a_regs is not None else _p(s.a)
    _pl(lines, ind, f"T.wgmma_{s.form}({_p(s.acc)}, {a}, {_p(s.b)}, n={s.n}, trans_a={s.ta}, trans_b={s.tb}, "
                    f"dtype={s.dtype!r}, scale={_p(s.scale)})")


def _print_tma(lines: list[str], s: TmaLoad, ind: int) -> None:
    _pl(lines, ind, f"T.tma_load({_p(s.dst)}, {s.src.name}, row={_p(s.row)}, col={_p(s.col)}, box=({s.spec.box_rows}, "
                    f"{s.spec.box_cols}), swizzle={s.spec.swizzle!r}, mbarrier={_p(s.bar)}, desc={s.desc})")


register_rules("print", {
    Bare: lambda e, prec: f"({_p(e.a)} {e.op} {_p(e.b)})" if prec else f"{_p(e.a)} {e.op} {_p(e.b)}",
    Paren: lambda e, prec: f"({_p(e.value)})",
    VerbatimExpr: lambda e, prec: f"T.cuda({e.text!r})",
    Zero: lambda e, prec: f"T.zero({e.dtype!r})",
    ToFloat: lambda e, prec: f"T.to_float({_p(e.value)})",
    Stored: lambda e, prec: f"T.stored({_p(e.value)}, {e.to!r})",
    Conv: lambda e, prec: f"T.conv({_p(e.value)}, {e.src!r}, {e.to!r})",
    CSelect: lambda e, prec: f"T.if_then_else({_p(e.cond)}, {_p(e.a)}, {_p(e.b)})",
    IntLit: lambda e, prec: str(int(e.value)),
    CastC: lambda e, prec: f"T.cast({_p(e.value)}, {e.to!r})",
    MinMax: lambda e, prec: f"T.{e.op}({_p(e.a)}, {_p(e.b)})",
    Abs: lambda e, prec: f"T.abs({_p(e.value)})",
    MbarRef: lambda e, prec: f"{e.buffer.name}[{_p(e.index)}]",
    DescAdvance: lambda e, prec: f"T.desc_advance({e.desc.name}, {_p(e.units)})",
    Verbatim: lambda lines, s, ind: _pl(lines, ind, f"T.cuda({s.text!r})"),
    VerbatimBlock: lambda lines, s, ind: _print_block(lines, f"with T.cuda({s.head!r}):", s.body, ind),
    TStore: lambda lines, s, ind: _pl(lines, ind, f"{_p(s.ref)} {s.op or ''}= {_p(s.value)}", s.cond),
    VecLoad: lambda lines, s, ind: _pl(lines, ind, f"{s.tmp.name}[:] = T.load_vec({_p(s.ref)}, "
                                                   f"{int(s.tmp.shape[0].value)}" +
                                       (f", pred={_p(s.pred)})" if s.pred is not None else ")")),
    VecStore: lambda lines, s, ind: _pl(lines, ind, f"T.store_vec({_p(s.ref)}, {s.tmp.name})", s.cond),
    PackedStore2: lambda lines, s, ind: _pl(lines, ind, f"T.store_pair({_p(s.ref)}, {_p(s.a)}, {_p(s.b)})", s.cond),
    AtomicAdd: lambda lines, s, ind: _pl(lines, ind, f"T.atomic_add({_p(s.ref)}, {_p(s.value)})", s.cond),
    VecAtomicAdd: lambda lines, s, ind: _pl(lines, ind, f"T.atomic_add_vec({_p(s.ref)}, {s.part}, "
                                                        f"[{', '.join(_p(v) for v in s.values)}])", s.cond),
    Comment: lambda lines, s, ind: _pl(lines, ind, f"# {s.text}"),
    RegArray: lambda lines, s, ind: _pl(lines, ind, f"{s.buffer.name} = T.alloc_reg(("
                                                    f"{', '.join(_p(d) for d in s.buffer.shape)},), 'uint32')"),
    Decl: lambda lines, s, ind: _pl(lines, ind, "; ".join(f"{v.name} = {_p(x)}" for v, x in zip(s.vars, s.values))),
    OneLine: _print_one_line,
    MbarArray: lambda lines, s, ind: _pl(lines, ind, f"{s.buffer.name} = T.alloc_mbarriers("
                                                     f"{int(s.buffer.shape[0].value)}, slot={s.offset})"),
    MbarInitAll: lambda lines, s, ind: _pl(lines, ind, f"T.mbarrier_init({s.buffer.name}, {s.count})"),
    MbarArriveExpectTx: lambda lines, s, ind: _pl(lines, ind, f"T.mbarrier_arrive_expect_tx({_p(s.bar)}, {s.nbytes})"),
    MbarWait: lambda lines, s, ind: _pl(lines, ind, f"T.mbarrier_wait({_p(s.bar)}, parity={_p(s.parity)})"),
    TmaLoad: _print_tma,
    SmemDesc: lambda lines, s, ind: _pl(lines, ind, f"{s.var.name} = T.smem_desc({_p(s.ref)}, swizzle={s.swizzle}, "
                                                    f"lbo={s.lbo}, sbo={s.sbo})"),
    Wgmma: _print_wgmma,
})
