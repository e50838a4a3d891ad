"""Tile IR: expressions, buffers, statements (loops, stores, tile ops) and the PrimFunc.

Nodes are plain dataclasses compared by identity. Expressions carry a dtype; buffers carry a
scope (global/shared/fragment/local/var) and an optional layout annotation, and kernels carry
their thread count, so a GPU backend lowers the same IR the CPU backends run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SourceLoc
from . import dtypes as dt

# ---------------------------------------------------------------- expressions


class Expr:
    dtype: str

    # Operator overloads let meta-level Python (e.g. `T.dynamic("M") * 2` in a factory) build IR.
    def __add__(self, o): return binop("+", self, o)
    def __radd__(self, o): return binop("+", o, self)
    def __sub__(self, o): return binop("-", self, o)
    def __rsub__(self, o): return binop("-", o, self)
    def __mul__(self, o): return binop("*", self, o)
    def __rmul__(self, o): return binop("*", o, self)
    def __floordiv__(self, o): return binop("//", self, o)
    def __rfloordiv__(self, o): return binop("//", o, self)
    def __mod__(self, o): return binop("%", self, o)
    def __truediv__(self, o): return binop("/", self, o)
    def __neg__(self): return binop("-", const(0, self.dtype), self)


@dataclass(eq=False)
class Const(Expr):
    value: Any
    dtype: str
    weak: bool = False  # a bare Python literal: adopts the type of the other operand

    def __repr__(self) -> str:
        return f"Const({self.value!r}, {self.dtype})"


@dataclass(eq=False)
class Var(Expr):
    name: str
    dtype: str = dt.INDEX

    def __repr__(self) -> str:
        return f"Var({self.name})"

    def __hash__(self) -> int:
        return id(self)


@dataclass(eq=False)
class BinOp(Expr):
    op: str  # + - * / // % max min < <= > >= == != and or
    a: Expr
    b: Expr
    dtype: str


@dataclass(eq=False)
class Not(Expr):
    a: Expr
    dtype: str = "bool"


@dataclass(eq=False)
class Call(Expr):
    fn: str  # exp exp2 log log2 sqrt rsqrt tanh abs sin cos floor ceil pow sigmoid
    args: list[Expr]
    dtype: str


@dataclass(eq=False)
class Cast(Expr):
    value: Expr
    dtype: str


@dataclass(eq=False)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr
    dtype: str


@dataclass(eq=False)
class Load(Expr):
    buffer: Buffer
    indices: list[Expr]

    @property
    def dtype(self) -> str:  # arithmetic type of the loaded value
        return dt.compute_type(self.buffer.dtype)


COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_OPS = ("and", "or")
BITWISE_OPS = ("&", "|", "^", "<<", ">>")  # on integers (on bools, & | ^ are and / or / !=)
FLOAT_FNS = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sin", "cos", "sigmoid", "floor", "ceil",
             "round", "pow")
ANY_FNS = ("abs",)


def const(value: Any, dtype: str | None = None, weak: bool | None = None) -> Const:
    if dtype is None:
        if isinstance(value, bool):
            dtype = "bool"
        elif isinstance(value, int):
            dtype = dt.INDEX
        else:
            dtype = "float32"
        weak = True if weak is None else weak
    return Const(value, dt.canonical(dtype), bool(weak))


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (bool, int, float)):
        return const(x)
    if isinstance(x, np.generic):
        return const(x.item())
    raise TypeError(f"expected an expression or a Python number, got {type(x).__name__} {x!r}")


def _result_type(a: Expr, b: Expr) -> str:
    wa = isinstance(a, Const) and a.weak
    wb = isinstance(b, Const) and b.weak
    if wa and not wb:
        return b.dtype if (dt.is_float(b.dtype) or not dt.is_float(a.dtype)) else dt.promote("float32", b.dtype)
    if wb and not wa:
        return a.dtype if (dt.is_float(a.dtype) or not dt.is_float(b.dtype)) else dt.promote(a.dtype, "float32")
    return dt.promote(a.dtype, b.dtype)


def binop(op: str, a: Any, b: Any) -> Expr:
    """Build a typed binary op (no folding here; see passes.simplify)."""
    a, b = as_expr(a), as_expr(b)
    if op in BITWISE_OPS:
        if a.dtype == "bool" and b.dtype == "bool" and op in ("&", "|", "^"):
            op = {"&": "and", "|": "or", "^": "!="}[op]
        elif dt.is_float(a.dtype) or dt.is_float(b.dtype):
            raise TypeError(f"bitwise {op} needs integer operands, got {a.dtype} and {b.dtype}")
    if op in COMPARE_OPS or op in LOGIC_OPS:
        return BinOp(op, a, b, "bool")
    ty = _result_type(a, b)
    if op == "/" and not dt.is_float(ty):
        ty = "float32"
    node = BinOp(op, a, b, ty)
    if isinstance(a, Const) and a.weak and isinstance(b, Const) and b.weak:
        return Const(_fold_weak(op, a.value, b.value), ty, True)
    return node


def _fold_weak(op: str, x: Any, y: Any) -> Any:
    import operator as o

    table = {"+": o.add, "-": o.sub, "*": o.mul, "/": o.truediv, "//": o.floordiv, "%": o.mod, "max": max, "min": min,
             "&": o.and_, "|": o.or_, "^": o.xor, "<<": o.lshift, ">>": o.rshift}
    return table[op](x, y)


# ---------------------------------------------------------------- buffers and regions

SCOPES = ("global", "shared", "fragment", "local", "var")
_buf_ids = itertools.count()


@dataclass(eq=False)
class Buffer:
    name: str
    shape: tuple[Expr, ...]
    dtype: str
    scope: str = "global"
    layout: Any = None  # from T.annotate_layout; meaningful to GPU backends
    uid: int = field(default_factory=lambda: next(_buf_ids))

    def __hash__(self) -> int:
        return id(self)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def static_shape(self) -> tuple[int, ...] | None:
        if all(isinstance(s, Const) for s in self.shape):
            return tuple(int(s.value) for s in self.shape)
        return None

    def __repr__(self) -> str:
        return f"Buffer({self.name}, {self.scope})"


@dataclass(eq=False)
class Region:
    """A rectangular tile of a buffer: `starts` per dim and static `extents`."""

    buffer: Buffer
    starts: list[Expr]
    extents: list[int]
    loc: SourceLoc | None = None

    @staticmethod
    def full(buf: Buffer, loc: SourceLoc | None = None) -> Region:
        shape = buf.static_shape()
        if shape is None:
            from ..errors import CompileError

            raise CompileError(f"buffer {buf.name} has a symbolic shape; give an explicit tile slice", loc)
        return Region(buf, [const(0) for _ in shape], list(shape), loc)

    def squeezed(self) -> list[int]:
        return [e for e in self.extents if e != 1]

    def as_2d(self) -> list[int]:
        """(rows, cols) of a matrix tile: the non-unit extents, or the last two when fewer are non-unit."""
        sq = self.squeezed()
        if len(sq) == 2:
            return sq
        ext = list(self.extents)
        return ext[-2:] if len(ext) >= 2 else [1, *ext]

    def matrix_dims(self) -> tuple[int, int]:
        """Which buffer dims are the tile's rows and cols (for strided access in backends)."""
        sq = [d for d, e in enumerate(self.extents) if e != 1]
        if len(sq) == 2:
            return sq[0], sq[1]
        if len(sq) == 1:
            d = sq[0]
            n = len(self.extents)
            if self.as_2d()[0] == 1:
                return (d - 1 if d > 0 else -1), d
            return d, (d + 1 if d + 1 < n else -1)
        n = len(self.extents)
        return (n - 2 if n >= 2 else -1), n - 1


# ---------------------------------------------------------------- statements


@dataclass(eq=False)
class Stmt:
    loc: SourceLoc | None = field(default=None, kw_only=True)


@dataclass(eq=False)
class Seq(Stmt):
    body: list[Stmt]


@dataclass(eq=False)
class Kernel(Stmt):
    grid: list[Expr]
    block_vars: list[Var]
    threads: tuple[int, ...]
    body: Stmt
    attrs: dict = field(default_factory=dict)  # e.g. swizzle from T.use_swizzle


@dataclass(eq=False)
class Alloc(Stmt):
    buffer: Buffer
    init: Expr | None = None  # alloc_var(..., init=)


LOOP_KINDS = ("serial", "parallel", "pipelined", "unroll", "vectorized")


@dataclass(eq=False)
class For(Stmt):
    var: Var
    start: Expr
    extent: Expr
    kind: str
    body: Stmt
    annotations: dict = field(default_factory=dict)


@dataclass(eq=False)
class Let(Stmt):
    """Bind `var` to `value` for the rest of the enclosing block."""

    var: Var
    value: Expr


@dataclass(eq=False)
class Store(Stmt):
    buffer: Buffer
    indices: list[Expr]
    value: Expr


@dataclass(eq=False)
class If(Stmt):
    cond: Expr
    then: Stmt
    orelse: Stmt | None = None


@dataclass(eq=False)
class While(Stmt):
    """`while cond: body` on an IR condition (a serial loop of unknown trip count)."""

    cond: Expr
    body: Stmt


@dataclass(eq=False)
class Copy(Stmt):
    src: Region
    dst: Region
    options: dict = field(default_factory=dict)  # keywords a backend may use: coalesced_width, disable_tma, ...


@dataclass(eq=False)
class Gemm(Stmt):
    A: Region
    B: Region
    C: Region
    transpose_A: bool = False
    transpose_B: bool = False
    clear_accum: bool = False
    policy: str = "Square"
    options: dict = field(default_factory=dict)  # k_pack, wg_wait, use_wgmma (kept; backends say what they ignore)


@dataclass(eq=False)
class Fill(Stmt):
    dst: Region
    value: Expr


REDUCE_KINDS = ("sum", "max", "min", "abssum", "absmax")


@dataclass(eq=False)
class Reduce(Stmt):
    kind: str
    src: Buffer
    dst: Buffer
    dim: int
    clear: bool = True


@dataclass(eq=False)
class CumSum(Stmt):
    src: Buffer
    dst: Buffer
    dim: int
    reverse: bool = False


@dataclass(eq=False)
class AtomicAdd(Stmt):
    """dst[region] += src (a Region of the same squeezed shape, or a scalar Expr for a 1-element dst)."""

    dst: Region
    src: Region | Expr


@dataclass(eq=False)
class PrimFunc:
    name: str
    params: list[Buffer]
    body: Stmt
    dynamic_vars: list[Var]
    loc: SourceLoc | None = None
    source: str = ""
    workspace: list[Buffer] = field(default_factory=list)  # T.alloc_global: trailing params the runtime allocates
    views: list[tuple[Buffer, Buffer]] = field(default_factory=list)  # (view param, the param it reshapes)

    def script(self) -> str:
        from .printer import print_func

        return print_func(self)

    def __str__(self) -> str:
        return self.script()

    def __repr__(self) -> str:
        return f"<PrimFunc {self.name}({', '.join(p.name for p in self.params)})>"
