"""Tile IR: expressions, buffers, statements (loops, stores, tile ops) and the PrimFunc.

Nodes are plain dataclasses compared by identity. Expressions carry a dtype; buffers carry a
scope (global/shared/fragment/local/var) and an optional layout annotation, and kernels carry
their thread count, so a GPU backend lowers the same IR the CPU backends run.
"""

from __future__ import annotations

import builtins
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CompileError, SourceLoc
from . import dtypes as dt

# ---------------------------------------------------------------- expressions


class Ruled:
    """A node class with a table of rules, one per backend or analysis (JAX style: a rule per
    backend in a table on the primitive). Every subclass gets its own table."""

    rules = {}  # {table: rule}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.rules = {}

    @classmethod
    def rule_for(cls, table: str) -> Any:
        """The rule `table` registered for this class (or the nearest base class), else None."""
        for k in cls.__mro__:
            r = k.__dict__.get("rules", {}).get(table)
            if r is not None:
                return r
        return None

    def rule(self, table: str) -> Any:
        return type(self).rules.get(table) or type(self).rule_for(table)


class Expr(Ruled):
    """An expression. Each class owns its structure: `children()` and `rebuild(children)` (a copy
    with new children; leaves return themselves), so walkers never test expression classes."""

    dtype: str

    def children(self) -> list[Expr]:
        return []

    def rebuild(self, children: list[Expr]) -> Expr:
        return self

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

    def children(self) -> list[Expr]:
        return [self.a, self.b]

    def rebuild(self, children: list[Expr]) -> Expr:
        return BinOp(self.op, children[0], children[1], self.dtype)


@dataclass(eq=False)
class Not(Expr):
    a: Expr
    dtype: str = "bool"

    def children(self) -> list[Expr]:
        return [self.a]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Not(children[0])


@dataclass(eq=False)
class Call(Expr):
    fn: str  # a FUNCTIONS name
    args: list[Expr]
    dtype: str

    def children(self) -> list[Expr]:
        return list(self.args)

    def rebuild(self, children: list[Expr]) -> Expr:
        return Call(self.fn, children, self.dtype)


@dataclass(eq=False)
class Cast(Expr):
    value: Expr
    dtype: str

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Cast(children[0], self.dtype)


@dataclass(eq=False)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr
    dtype: str

    def children(self) -> list[Expr]:
        return [self.cond, self.a, self.b]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Select(children[0], children[1], children[2], self.dtype)


@dataclass(eq=False)
class Load(Expr):
    buffer: Buffer
    indices: list[Expr]

    @property
    def dtype(self) -> str:  # arithmetic type of the loaded value
        return dt.compute_type(self.buffer.dtype)

    def children(self) -> list[Expr]:
        return list(self.indices)

    def rebuild(self, children: list[Expr]) -> Expr:
        return Load(self.buffer, children)


COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_OPS = ("and", "or")
BITWISE_OPS = ("&", "|", "^", "<<", ">>")  # on integers (on bools, & | ^ are and / or / !=)


@dataclass(frozen=True)
class Function:
    """A `T.<name>` math function: the one table every layer reads (language folding, interpreter,
    printer; the C-family spellings are backends/cexpr.py's C_MATH, checked against this table)."""

    name: str
    arity: int
    fold: Any  # meta level: Python numbers -> Python number
    numpy: Any  # the interpreter: arrays of the compute type -> array
    keeps_type: bool = False  # abs keeps integer types; the others compute in float (ints -> float32)


def _np_rsqrt(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(1) / np.sqrt(x)


def _np_sigmoid(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(1) / (x.dtype.type(1) + np.exp(-x))


FUNCTIONS = {f.name: f for f in [
    Function("exp", 1, math.exp, np.exp),
    Function("exp2", 1, lambda v: 2.0**v, np.exp2),
    Function("log", 1, math.log, np.log),
    Function("log2", 1, math.log2, np.log2),
    Function("sqrt", 1, math.sqrt, np.sqrt),
    Function("rsqrt", 1, lambda v: 1.0 / math.sqrt(v), _np_rsqrt),
    Function("tanh", 1, math.tanh, np.tanh),
    Function("sin", 1, math.sin, np.sin),
    Function("cos", 1, math.cos, np.cos),
    Function("sigmoid", 1, lambda v: 1.0 / (1.0 + math.exp(-v)), _np_sigmoid),
    Function("floor", 1, math.floor, np.floor),
    Function("ceil", 1, math.ceil, np.ceil),
    Function("round", 1, lambda v: float(builtins.round(v)), np.rint),
    Function("pow", 2, lambda a, b: a**b, np.power),
    Function("abs", 1, lambda v: v if v >= 0 else -v, np.abs, keeps_type=True),
]}


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
#
# Every statement class owns its structure: `children()` (nested statements), `exprs()` (the
# expressions it holds itself), `reads()` / `writes()` (buffers it accesses itself, not through
# loads in its expressions or nested statements) and `rebuild(tr)` (a copy with children and
# expressions passed through a visit.Transformer). Walkers use these and never test classes.
#
# Rules (JAX style: one primitive, a rule per backend in a table): `Stmt.rules` (and
# `Expr.rules`, see Ruled) is a per-class table, keyed by the table's name ("interp", "cpu.lower",
# "cpu", "cuda", "cuda.parallel", "cuda.layout", "verify", "print", "cexpr"), that each backend or
# analysis fills from its own module with `register_rules`. The IR never imports a backend; a
# walker asks the node for its rule.


def _region_exprs(*regions: Region) -> list[Expr]:
    return [e for r in regions for e in r.starts]


@dataclass(eq=False)
class Stmt(Ruled):
    loc: SourceLoc | None = field(default=None, kw_only=True)

    side_effects = False  # True: never dead, even when nothing reads what it writes (dce)

    def apply(self, table: str, ctx: Any, missing: str) -> Any:
        """Run this statement's `table` rule as rule(ctx, self); without one, CompileError(`missing`
        with {op} replaced by the class name)."""
        rule = self.rule(table)
        if rule is None:
            raise CompileError(missing.format(op=type(self).__name__), self.loc)
        return rule(ctx, self)

    def children(self) -> list[Stmt]:
        return []

    def exprs(self) -> list[Expr]:
        return []

    def reads(self) -> set[Buffer]:
        return set()

    def writes(self) -> set[Buffer]:
        return set()

    def rebuild(self, tr: Any) -> Stmt | None:
        raise NotImplementedError(f"{type(self).__name__}.rebuild")

    def check(self) -> None:
        """Raise CompileError when the statement is malformed on its own (operand shapes)."""

    def user_options(self) -> dict:
        """Keywords the user wrote that backends may act on (reported at DEBUG where ignored)."""
        return {}


def register_rules(table: str, rules: dict[type, Any]) -> None:
    """Register `rules[cls]` as the `table` rule of each statement or expression class `cls`."""
    for cls, fn in rules.items():
        if not (isinstance(cls, type) and issubclass(cls, Ruled)):
            raise TypeError(f"register_rules({table!r}): {cls!r} is not a statement or expression class")
        cls.rules[table] = fn


@dataclass(eq=False)
class Seq(Stmt):
    body: list[Stmt]

    def children(self) -> list[Stmt]:
        return list(self.body)

    def rebuild(self, tr: Any) -> Stmt:
        return Seq([t for t in (tr.stmt(c) for c in self.body) if t is not None], loc=self.loc)


@dataclass(eq=False)
class Kernel(Stmt):
    grid: list[Expr]
    block_vars: list[Var]
    threads: tuple[int, ...]
    body: Stmt
    attrs: dict = field(default_factory=dict)  # e.g. swizzle from T.use_swizzle

    def children(self) -> list[Stmt]:
        return [self.body]

    def exprs(self) -> list[Expr]:
        return list(self.grid)

    def rebuild(self, tr: Any) -> Stmt:
        return Kernel([tr.expr(g) for g in self.grid], self.block_vars, self.threads, tr.stmt(self.body) or Seq([]),
                      dict(self.attrs), loc=self.loc)

    def user_options(self) -> dict:
        return dict(self.attrs)  # swizzle (T.use_swizzle), prelude, is_cpu


@dataclass(eq=False)
class Alloc(Stmt):
    buffer: Buffer
    init: Expr | None = None  # alloc_var(..., init=)
    options: dict = field(default_factory=dict)  # keywords kept for backends: scope="shared.dyn", ...

    def exprs(self) -> list[Expr]:
        return [self.init] if self.init is not None else []

    def writes(self) -> set[Buffer]:
        return {self.buffer} if self.init is not None else set()

    def rebuild(self, tr: Any) -> Stmt:
        return Alloc(self.buffer, tr.expr(self.init) if self.init is not None else None, dict(self.options),
                     loc=self.loc)

    def user_options(self) -> dict:
        layout = {"layout": self.buffer.layout} if self.buffer.layout is not None else {}  # T.annotate_layout
        return {**self.options, **layout}


LOOP_KINDS = ("serial", "parallel", "pipelined", "unroll", "vectorized")


@dataclass(eq=False)
class For(Stmt):
    var: Var
    start: Expr
    extent: Expr
    kind: str
    body: Stmt
    annotations: dict = field(default_factory=dict)

    def children(self) -> list[Stmt]:
        return [self.body]

    def exprs(self) -> list[Expr]:
        return [self.start, self.extent]

    def rebuild(self, tr: Any) -> Stmt:
        return For(self.var, tr.expr(self.start), tr.expr(self.extent), self.kind, tr.stmt(self.body) or Seq([]),
                   dict(self.annotations), loc=self.loc)

    def user_options(self) -> dict:
        return {k: v for k, v in self.annotations.items() if k not in ("vectorize", "reduction")}  # not internal


@dataclass(eq=False)
class Let(Stmt):
    """Bind `var` to `value` for the rest of the enclosing block."""

    var: Var
    value: Expr

    def exprs(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, tr: Any) -> Stmt:
        return Let(self.var, tr.expr(self.value), loc=self.loc)


@dataclass(eq=False)
class Store(Stmt):
    buffer: Buffer
    indices: list[Expr]
    value: Expr

    def exprs(self) -> list[Expr]:
        return [*self.indices, self.value]

    def writes(self) -> set[Buffer]:
        return {self.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return Store(self.buffer, [tr.expr(i) for i in self.indices], tr.expr(self.value), loc=self.loc)


@dataclass(eq=False)
class If(Stmt):
    cond: Expr
    then: Stmt
    orelse: Stmt | None = None

    def children(self) -> list[Stmt]:
        return [self.then] + ([self.orelse] if self.orelse is not None else [])

    def exprs(self) -> list[Expr]:
        return [self.cond]

    def rebuild(self, tr: Any) -> Stmt:
        orelse = tr.stmt(self.orelse) if self.orelse is not None else None
        return If(tr.expr(self.cond), tr.stmt(self.then) or Seq([]), orelse, loc=self.loc)


@dataclass(eq=False)
class While(Stmt):
    """`while cond: body` on an IR condition (a serial loop of unknown trip count)."""

    cond: Expr
    body: Stmt

    def children(self) -> list[Stmt]:
        return [self.body]

    def exprs(self) -> list[Expr]:
        return [self.cond]

    def rebuild(self, tr: Any) -> Stmt:
        return While(tr.expr(self.cond), tr.stmt(self.body) or Seq([]), loc=self.loc)


# ---------------------------------------------------------------- tile ops


@dataclass(eq=False)
class TileOp(Stmt):
    """A tile op: a statement on whole tiles (regions or buffers) that every backend lowers its
    own way. Besides the Stmt structure, an op knows its operand regions and buffers (checked by
    the verifier) and how it prints."""

    def regions(self) -> list[Region]:
        """Tile operands (their buffers must be visible, their bounds within on-chip buffers)."""
        return []

    def operand_buffers(self) -> list[Buffer]:
        """Whole-buffer operands (must be visible where the op stands)."""
        return []

    def exprs(self) -> list[Expr]:
        return _region_exprs(*self.regions())

    def text(self, expr: Any, region: Any) -> str:
        """One line of TVMScript-like text; `expr` / `region` print an expression / a region."""
        raise NotImplementedError(f"{type(self).__name__}.text")


def _kw(options: dict) -> str:
    return "".join(f", {k}={v!r}" for k, v in options.items())


@dataclass(eq=False)
class Copy(TileOp):
    src: Region
    dst: Region
    options: dict = field(default_factory=dict)  # keywords a backend may use: coalesced_width, disable_tma, ...

    def regions(self) -> list[Region]:
        return [self.src, self.dst]

    def reads(self) -> set[Buffer]:
        return {self.src.buffer}

    def writes(self) -> set[Buffer]:
        return {self.dst.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return Copy(tr.region(self.src), tr.region(self.dst), dict(self.options), loc=self.loc)

    def text(self, expr: Any, region: Any) -> str:
        return f"T.copy({region(self.src)}, {region(self.dst)}{_kw(self.options)})"

    def check(self) -> None:
        if self.src.squeezed() != self.dst.squeezed():
            raise CompileError(f"T.copy: shape mismatch {tuple(self.src.extents)} vs {tuple(self.dst.extents)}",
                               self.loc)

    def user_options(self) -> dict:
        return dict(self.options)


@dataclass(eq=False)
class Gemm(TileOp):
    A: Region
    B: Region
    C: Region
    transpose_A: bool = False
    transpose_B: bool = False
    clear_accum: bool = False
    policy: str = "Square"
    options: dict = field(default_factory=dict)  # k_pack, wg_wait, use_wgmma (kept; backends say what they ignore)

    def regions(self) -> list[Region]:
        return [self.A, self.B, self.C]

    def reads(self) -> set[Buffer]:
        return {self.A.buffer, self.B.buffer, self.C.buffer}

    def writes(self) -> set[Buffer]:
        return {self.C.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return Gemm(tr.region(self.A), tr.region(self.B), tr.region(self.C), self.transpose_A, self.transpose_B,
                    self.clear_accum, self.policy, dict(self.options), loc=self.loc)

    def text(self, expr: Any, region: Any) -> str:
        opts = "".join([", transpose_A=True" if self.transpose_A else "", ", transpose_B=True" if self.transpose_B else "",
                        ", clear_accum=True" if self.clear_accum else "",
                        f", policy={self.policy!r}" if self.policy != "Square" else "", _kw(self.options)])
        return f"T.gemm({region(self.A)}, {region(self.B)}, {region(self.C)}{opts})"

    def check(self) -> None:
        a, b, c = self.A.as_2d(), self.B.as_2d(), self.C.as_2d()
        m, k = (a[1], a[0]) if self.transpose_A else (a[0], a[1])
        k2, n = (b[1], b[0]) if self.transpose_B else (b[0], b[1])
        if k != k2 or tuple(c) != (m, n):
            raise CompileError(f"T.gemm: shape mismatch A {m}x{k}, B {k2}x{n}, C {tuple(c)}", self.loc)

    def user_options(self) -> dict:
        return dict(self.options)


@dataclass(eq=False)
class Fill(TileOp):
    dst: Region
    value: Expr

    def regions(self) -> list[Region]:
        return [self.dst]

    def exprs(self) -> list[Expr]:
        return _region_exprs(self.dst) + [self.value]

    def writes(self) -> set[Buffer]:
        return {self.dst.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        return Fill(tr.region(self.dst), tr.expr(self.value), loc=self.loc)

    def text(self, expr: Any, region: Any) -> str:
        return f"T.fill({region(self.dst)}, {expr(self.value)})"


# name -> (combine operator, identity); "abs" kinds reduce |x|. One table for every backend.
REDUCE_OPS = {"sum": ("+", 0.0), "max": ("max", float("-inf")), "min": ("min", float("inf")),
              "abssum": ("+", 0.0), "absmax": ("max", 0.0)}
REDUCE_KINDS = tuple(REDUCE_OPS)


@dataclass(eq=False)
class Reduce(TileOp):
    kind: str
    src: Buffer
    dst: Buffer
    dim: int
    clear: bool = True

    def operand_buffers(self) -> list[Buffer]:
        return [self.src, self.dst]

    def reads(self) -> set[Buffer]:
        src = self.src.buffer if isinstance(self.src, Region) else self.src
        return {src} if self.clear else {src, self.dst}

    def writes(self) -> set[Buffer]:
        return {self.dst}

    def rebuild(self, tr: Any) -> Stmt:
        return self  # holds no expressions

    def text(self, expr: Any, region: Any) -> str:
        return f"T.reduce_{self.kind}({self.src.name}, {self.dst.name}, dim={self.dim}, clear={self.clear})"


@dataclass(eq=False)
class CumSum(TileOp):
    src: Buffer
    dst: Buffer
    dim: int
    reverse: bool = False

    def operand_buffers(self) -> list[Buffer]:
        return [self.src, self.dst]

    def reads(self) -> set[Buffer]:
        return {self.src}

    def writes(self) -> set[Buffer]:
        return {self.dst}

    def rebuild(self, tr: Any) -> Stmt:
        return self  # holds no expressions

    def text(self, expr: Any, region: Any) -> str:
        return f"T.cumsum({self.src.name}, {self.dst.name}, dim={self.dim}, reverse={self.reverse})"


@dataclass(eq=False)
class AtomicAdd(TileOp):
    """dst[region] += src (a Region of the same squeezed shape, or a scalar Expr for a 1-element dst)."""

    dst: Region
    src: Region | Expr
    options: dict = field(default_factory=dict)  # memory_order (kept; backends say what they ignore)

    side_effects = True  # accumulates into memory other blocks (and the caller) see

    def regions(self) -> list[Region]:
        return [self.dst] + ([self.src] if isinstance(self.src, Region) else [])

    def exprs(self) -> list[Expr]:
        return _region_exprs(*self.regions()) + ([] if isinstance(self.src, Region) else [self.src])

    def reads(self) -> set[Buffer]:
        return {self.dst.buffer} | ({self.src.buffer} if isinstance(self.src, Region) else set())

    def writes(self) -> set[Buffer]:
        return {self.dst.buffer}

    def rebuild(self, tr: Any) -> Stmt:
        src = tr.region(self.src) if isinstance(self.src, Region) else tr.expr(self.src)
        return AtomicAdd(tr.region(self.dst), src, dict(self.options), loc=self.loc)

    def text(self, expr: Any, region: Any) -> str:
        src = region(self.src) if isinstance(self.src, Region) else expr(self.src)
        return f"T.atomic_add({region(self.dst)}, {src}{_kw(self.options)})"

    def user_options(self) -> dict:
        return dict(self.options)


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

    printer = None  # PrimFunc -> text; set by ir/printer.py, which the ir package imports

    def script(self) -> str:
        return type(self).printer(self)

    def __str__(self) -> str:
        return self.script()

    def __repr__(self) -> str:
        return f"<PrimFunc {self.name}({', '.join(p.name for p in self.params)})>"
