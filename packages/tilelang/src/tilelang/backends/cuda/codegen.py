"""Tile IR -> CUDA C++ on tilehal's headers (one `__global__` function per T.Kernel).

Execution model: every thread of a block runs the *uniform* statements (scalar code, serial
loops, `if`s on block/loop indices) redundantly and identically; tile ops and `T.Parallel`
loops are *distributed*: a loop over fragments runs each thread over the elements its layout
gives it (registers), a loop over shared/global memory only is spread over the threads flat.
Fragments live in registers (`T name[nregs]`), shared buffers in one dynamic shared-memory
arena (planned with reuse of dead buffers), local/var buffers per thread.

Lowerings: T.copy global->shared with 16-byte `cp.async` (zero fill past the edges), other
copies with vector loads/stores where alignment is provable, element-wise with masks otherwise;
T.gemm through ldmatrix + mma.sync (fp16/bf16/fp8/int8) with swizzled shared operands, or FMA
on CUDA cores for the other types; T.reduce_* as register reduction + warp shuffles + shared
memory across warps; T.cumsum through shared memory; T.Pipelined(num_stages>=2) as a cp.async
multi-buffer pipeline; __syncthreads() inserted between statements with a shared/global hazard.
"""

from __future__ import annotations

import itertools
import logging
import math
import struct
from dataclasses import dataclass

import numpy as np
import tilehal

from ...errors import CompileError
from ...ir import dtypes as dt
from ...ir.layout import Axis, Fragment
from ...ir.nodes import (
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
    PrimFunc,
    Reduce,
    Region,
    Select,
    Seq,
    Stmt,
    Store,
    Var,
)
from ...ir.visit import buffers_read, buffers_written, walk_expr, walk_stmts
from .infer import GemmPlan, LayoutInference, ParallelNest, infer_layouts

log = logging.getLogger("tilelang.backends.cuda")

SMEM_LIMIT = 232448  # bytes of shared memory a block may opt into on sm_90 (227 KiB)
SMEM_ALIGN = 128

_FN32 = {"exp": "expf", "exp2": "exp2f", "log": "logf", "log2": "log2f", "sqrt": "sqrtf", "tanh": "tanhf",
         "sin": "sinf", "cos": "cosf", "floor": "floorf", "ceil": "ceilf", "round": "rintf", "abs": "fabsf",
         "pow": "powf"}
_FN64 = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "sqrt": "sqrt", "tanh": "tanh", "sin": "sin",
         "cos": "cos", "floor": "floor", "ceil": "ceil", "round": "rint", "abs": "fabs", "pow": "pow"}
_LOW = ("float16", "bfloat16", "float8_e4m3", "float8_e5m2")
_MMA_TAG = {"float16": "MmaF16", "bfloat16": "MmaBF16", "float8_e4m3": "MmaE4M3", "float8_e5m2": "MmaE5M2",
            "int8": "MmaS8"}

PRELUDE = r"""
#include <tilehal/tilehal.cuh>
template <typename T> __device__ __forceinline__ T tl_max(T a, T b) { return a > b ? a : b; }
template <typename T> __device__ __forceinline__ T tl_min(T a, T b) { return a < b ? a : b; }
template <typename T> __device__ __forceinline__ T tl_floordiv(T a, T b) {
  T q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
template <typename T> __device__ __forceinline__ T tl_floormod(T a, T b) {
  T r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""


def cuda_type(dtype: str) -> str:
    return tilehal.get_dtype(dtype).cuda_name


def value_type(dtype: str) -> str:
    """C type of arithmetic on a value of `dtype` (16/8-bit floats compute in float)."""
    return cuda_type(dt.compute_type(dtype))


def esize(dtype: str) -> int:
    return tilehal.get_dtype(dtype).itemsize


def float_literal(v: float, dtype: str) -> str:
    if math.isinf(v):
        lit = "INFINITY" if v > 0 else "-INFINITY"
        return lit if dtype != "float64" else f"((double){lit})"
    if math.isnan(v):
        return "__int_as_float(0x7fffffff)"
    if dtype == "float64":
        return repr(float(v))
    f32 = struct.unpack("f", struct.pack("f", float(np.float32(v))))[0]
    return f"{f32!r}f" if "e" in repr(f32) or "." in repr(f32) else f"{f32!r}.0f"


def _divisible(e: Expr, v: int) -> bool:
    if v == 1:
        return True
    if isinstance(e, Const):
        return int(e.value) % v == 0
    if isinstance(e, BinOp):
        if e.op == "*":
            return _divisible(e.a, v) or _divisible(e.b, v) or (
                isinstance(e.a, Const) and isinstance(e.b, Const) and (int(e.a.value) * int(e.b.value)) % v == 0)
        if e.op in ("+", "-"):
            return _divisible(e.a, v) and _divisible(e.b, v)
    return False


def _nonneg(e: Expr) -> bool:
    if isinstance(e, Const):
        return not isinstance(e.value, bool) and e.value >= 0
    if isinstance(e, Var):
        return True  # loop, block and size variables are never negative
    if isinstance(e, BinOp) and e.op in ("+", "*", "//", "%", "max", "min"):
        return _nonneg(e.a) and _nonneg(e.b)
    if isinstance(e, Cast):
        return _nonneg(e.value)
    return False


@dataclass
class SmemInfo:
    offset: int
    stages: int
    stage_elems: int
    swizzle: tuple[int, int, int] | None  # (shift, mask, log2 elems per 16 bytes)


@dataclass
class ParCtx:
    layout: Fragment | None
    var_pos: dict[Var, int]
    regvars: dict[tuple[int, Axis], str]
    lead: str | None  # C condition true on one replica (guards global/shared stores)


class KernelCodegen:
    def __init__(self, func: PrimFunc, kernel: Kernel, name: str, lets: list[Let]) -> None:
        self.func = func
        self.kernel = kernel
        self.name = name
        self.lets = lets
        self.threads = 1
        for t in kernel.threads:
            self.threads *= int(t)
        if self.threads % 32 or self.threads > 1024:
            raise CompileError(f"T.Kernel threads={self.threads}: the CUDA backend needs a multiple of 32 threads, "
                               f"at most 1024", kernel.loc)
        self.inf: LayoutInference = infer_layouts(kernel)
        self.lines: list[str] = []
        self.ind = 1
        self.ids = itertools.count()
        self.smem: dict[Buffer, SmemInfo] = {}
        self.stage_expr: dict[Buffer, str] = {}
        self.scratch_bytes = 0
        self.par: ParCtx | None = None
        self.pending_w: set[Buffer] = set()
        self.pending_r: set[Buffer] = set()
        self.dyn_names = {v.name for v in func.dynamic_vars}
        self._plan_swizzle()
        self._plan_pipelines()
        self._plan_zero_init()

    # ================================================================ planning

    def _plan_swizzle(self) -> None:
        self.swizzled: dict[Buffer, tuple[int, int, int]] = {}
        for s in walk_stmts(self.kernel.body):
            if isinstance(s, Gemm) and self.inf.gemms[id(s)].kind == "mma":
                for r in (s.A, s.B):
                    b = r.buffer
                    if b.scope != "shared" or b.ndim != 2:
                        continue
                    row_bytes = b.static_shape()[-1] * esize(b.dtype)
                    lv = int(math.log2(16 // esize(b.dtype)))
                    if row_bytes % 128 == 0:
                        self.swizzled[b] = (0, 7, lv)
                    elif row_bytes == 64:
                        self.swizzled[b] = (1, 3, lv)
                    elif row_bytes == 32:
                        self.swizzled[b] = (2, 1, lv)

    def _plan_zero_init(self) -> None:
        """Shared buffers whose first access is not a full, unconditional write start at zero (the
        interpreter's allocation semantics); the others are left as they are (no wasted pass)."""
        self.zero_init: set[Buffer] = set()
        first: dict[Buffer, bool] = {}

        def visit(s: Stmt, cond: bool) -> None:
            if isinstance(s, (Seq, Kernel)):
                for c in (s.body if isinstance(s, Seq) else [s.body]):
                    visit(c, cond)
                return
            if isinstance(s, If):
                for x in walk_expr(s.cond):
                    if isinstance(x, Load) and x.buffer.scope == "shared":
                        first.setdefault(x.buffer, False)
                visit(s.then, True)
                if s.orelse is not None:
                    visit(s.orelse, True)
                return
            if isinstance(s, For):
                visit(s.body, cond or s.kind == "parallel")
                return
            if isinstance(s, Alloc):
                return
            reads, writes = buffers_read(s), buffers_written(s)
            for b in reads | writes:
                if b.scope != "shared" or b in first:
                    continue
                full = False
                if b in writes and b not in reads and not cond and isinstance(s, (Copy, Fill)):
                    r = s.dst
                    full = tuple(r.extents) == b.static_shape() and all(isinstance(x, Const) and x.value == 0
                                                                         for x in r.starts)
                first[b] = full
        visit(self.kernel.body, False)
        self.zero_init = {b for b, full in first.items() if not full}
        for b in self.zero_init:
            log.debug("shared buffer %s is read before it is fully written: zero-initialized", b.name)

    def _plan_pipelines(self) -> None:
        self.pipes: dict[int, list[Copy]] = {}
        self.stages: dict[Buffer, int] = {}
        all_stmts = list(walk_stmts(self.kernel.body))
        for loop in all_stmts:
            if not (isinstance(loop, For) and loop.kind == "pipelined"):
                continue
            n = int(loop.annotations.get("num_stages", 1) or 1)
            if n < 2:
                continue
            body = loop.body.body if isinstance(loop.body, Seq) else [loop.body]
            inside = set(map(id, walk_stmts(loop.body)))
            local_vars = {st.var for st in walk_stmts(loop.body) if isinstance(st, (Let, For))}
            chosen = []
            for i, c in enumerate(body):
                if not (isinstance(c, Copy) and self._async_copy_ok(c)):
                    continue
                buf = c.dst.buffer
                free = {x for e in c.src.starts for x in walk_expr(e) if isinstance(x, (Var, Load))}
                if any(isinstance(x, Load) for x in free) or (free & local_vars):
                    log.debug("%s: T.copy into %s not pipelined: its source depends on values computed in the loop",
                              c.loc, buf.name)
                    continue
                others = [st for st in all_stmts if st is not c and not isinstance(st, (Seq, For, If, Kernel))
                          and (buf in buffers_written(st))]
                outside = [st for st in all_stmts if id(st) not in inside and not isinstance(st, (Seq, For, If, Kernel))
                           and not isinstance(st, Alloc) and buf in (buffers_read(st) | buffers_written(st))]
                before = [st for st in body[:i] if buf in buffers_read(st)]
                if others or outside or before:
                    log.debug("%s: T.copy into %s not pipelined: the buffer is used outside this loop or written "
                              "elsewhere", c.loc, buf.name)
                    continue
                chosen.append(c)
                self.stages[buf] = n
            if chosen:
                self.pipes[id(loop)] = chosen
            else:
                log.debug("%s: T.Pipelined(num_stages=%d) has no global->shared copy to prefetch; runs serially",
                          loop.loc, n)

    def _vector_width(self, src: Region, dst: Region, limit_bytes: int = 16) -> int:
        """Elements per vector for a copy between two memory regions (1 when alignment is unprovable)."""
        if src.buffer.dtype != dst.buffer.dtype:
            return 1
        es = esize(src.buffer.dtype)
        ext = src.squeezed()
        if not ext:
            return 1
        last = ext[-1]
        for r in (src, dst):
            rd, cd = r.matrix_dims()
            if cd != r.buffer.ndim - 1 or r.extents[cd] != last:
                return 1
        v = max(1, limit_bytes // es)
        while v > 1:
            ok = last % v == 0
            for r in (src, dst):
                size = r.buffer.shape[-1]
                ok = ok and isinstance(size, Const) and int(size.value) % v == 0 and _divisible(r.starts[-1], v)
            if ok:
                return v
            v //= 2
        return 1

    def _async_copy_ok(self, c: Copy) -> bool:
        if c.src.buffer.scope != "global" or c.dst.buffer.scope != "shared":
            return False
        v = self._vector_width(c.src, c.dst)
        return v * esize(c.src.buffer.dtype) in (4, 8, 16)

    # ================================================================ emission helpers

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.ind + line)

    def fresh(self, base: str) -> str:
        return f"_{base}{next(self.ids)}"

    def open(self, head: str) -> None:
        self.emit(head + " {")
        self.ind += 1

    def close(self) -> None:
        self.ind -= 1
        self.emit("}")

    def sync(self) -> None:
        self.emit("__syncthreads();")
        self.pending_w.clear()
        self.pending_r.clear()

    def thread_val(self, a: Axis) -> str:
        ts, e = a.tstride, a.extent
        if ts & (ts - 1) == 0 and e & (e - 1) == 0:
            sh = int(math.log2(ts))
            inner = f"(_tx >> {sh})" if sh else "_tx"
            return f"({inner} & {e - 1})" if ts * e < self.threads else inner
        return f"((_tx / {ts}) % {e})"

    def scratch(self, nbytes: int) -> str:
        self.scratch_bytes = max(self.scratch_bytes, nbytes)
        return "_tl_scratch"

    # ================================================================ expressions

    def const(self, e: Const) -> str:
        t = dt.compute_type(e.dtype)
        if e.dtype == "bool" or isinstance(e.value, bool):
            return "true" if e.value else "false"
        if dt.is_float(t):
            return float_literal(float(e.value), t)
        v = int(e.value)
        return f"{v}LL" if abs(v) > 2**31 - 1 or t == "int64" else str(v)

    def cast_to(self, e: Expr, dtype: str) -> str:
        code = self.expr(e)
        if dt.compute_type(e.dtype) == dt.compute_type(dtype):
            return code
        if isinstance(e, Const) and e.weak:
            return self.const(Const(e.value, dtype))
        return f"(({value_type(dtype)})({code}))"

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return self.const(e)
        if isinstance(e, Var):
            return e.name
        if isinstance(e, Load):
            return self.load(e)
        if isinstance(e, BinOp):
            return self.binop(e)
        if isinstance(e, Not):
            return f"(!({self.expr(e.a)}))"
        if isinstance(e, Cast):
            inner = self.expr(e.value)
            if e.dtype in _LOW:  # round to the narrow type, keep computing in float
                return f"tilehal::to_float(tilehal::from_float<{cuda_type(e.dtype)}>((float)({inner})))"
            if e.dtype == "bool":
                return f"(({inner}) != 0)"
            return f"(({value_type(e.dtype)})({inner}))"
        if isinstance(e, Select):
            return f"(({self.expr(e.cond)}) ? {self.cast_to(e.a, e.dtype)} : {self.cast_to(e.b, e.dtype)})"
        if isinstance(e, Call):
            t = dt.compute_type(e.dtype)
            args = [self.cast_to(a, e.dtype) for a in e.args]
            if dt.is_int(t):
                if e.fn == "abs":
                    return f"({args[0]} < 0 ? -{args[0]} : {args[0]})"
                raise CompileError(f"T.{e.fn} on integer type {e.dtype} is not supported")
            f64 = t == "float64"
            if e.fn == "rsqrt":
                return f"(1.0 / sqrt({args[0]}))" if f64 else f"(1.0f / sqrtf({args[0]}))"
            if e.fn == "sigmoid":
                return f"(1.0 / (1.0 + exp(-{args[0]})))" if f64 else f"(1.0f / (1.0f + expf(-{args[0]})))"
            table = _FN64 if f64 else _FN32
            if e.fn not in table:
                raise CompileError(f"T.{e.fn} is not supported by the CUDA backend")
            return f"{table[e.fn]}({', '.join(args)})"
        raise CompileError(f"CUDA codegen: unknown expression {type(e).__name__}")

    def binop(self, e: BinOp) -> str:
        op = e.op
        if op in ("and", "or"):
            return f"({self.expr(e.a)} {'&&' if op == 'and' else '||'} {self.expr(e.b)})"
        if op in ("<", "<=", ">", ">=", "==", "!="):
            common = dt.promote(e.a.dtype, e.b.dtype)
            return f"({self.cast_to(e.a, common)} {op} {self.cast_to(e.b, common)})"
        a, b = self.cast_to(e.a, e.dtype), self.cast_to(e.b, e.dtype)
        if op == "max":
            return f"tl_max<{value_type(e.dtype)}>({a}, {b})"
        if op == "min":
            return f"tl_min<{value_type(e.dtype)}>({a}, {b})"
        if dt.is_int(e.dtype) and op in ("//", "%"):
            if _nonneg(e.a) and _nonneg(e.b):
                return f"({a} {'/' if op == '//' else '%'} {b})"
            return f"tl_floor{'div' if op == '//' else 'mod'}<{value_type(e.dtype)}>({a}, {b})"
        if op == "//":
            return f"floor{'f' if e.dtype == 'float32' else ''}({a} / {b})"
        if op == "%":
            f = "f" if e.dtype == "float32" else ""
            return f"({a} - floor{f}({a} / {b}) * {b})"
        return f"({a} {op} {b})"

    # ---------------------------------------------------------------- memory references

    def dim(self, s: Expr) -> str:
        return str(int(s.value)) if isinstance(s, Const) else s.name

    def flat_index(self, buf: Buffer, idx: list[str]) -> str:
        if not idx:
            return "0"
        wide = buf.static_shape() is None or int(np.prod(buf.static_shape(), dtype=np.int64)) >= 2**31
        code = f"((long long)({idx[0]}))" if wide else f"({idx[0]})"
        for d in range(1, buf.ndim):
            code = f"({code} * {self.dim(buf.shape[d])} + ({idx[d]}))"
        return code

    def smem_offset(self, buf: Buffer, idx: list[str]) -> str:
        shape = buf.static_shape()
        swz = self.swizzled.get(buf)
        if swz is None:
            off = self.flat_index(buf, idx)
        else:
            sh, mask, lv = swz
            row = idx[0] if buf.ndim == 2 else "0"
            off = f"(({row}) * {shape[-1]} + (({idx[-1]}) ^ (((({row}) >> {sh}) & {mask}) << {lv})))"
        stage = self.stage_expr.get(buf)
        if stage is not None and self.stages.get(buf, 1) > 1:
            off = f"(({stage}) * {int(np.prod(shape))} + {off})"
        return off

    def ref(self, buf: Buffer, idx: list[Expr]) -> str:
        """C lvalue of one element (uniform or inside the current T.Parallel context)."""
        if buf.scope == "var":
            return buf.name
        if buf.scope == "fragment":
            return f"{buf.name}[{self.frag_reg(buf, idx)}]"
        cidx = [self.expr(i) for i in idx]
        if buf.scope == "shared":
            return f"{buf.name}[{self.smem_offset(buf, cidx)}]"
        return f"{buf.name}[{self.flat_index(buf, cidx)}]"

    def frag_reg(self, buf: Buffer, idx: list[Expr]) -> str:
        f = self.inf.layouts.get(buf)
        if f is None:
            raise CompileError(f"fragment {buf.name}: no layout was inferred", self.kernel.loc)
        terms = []
        for d, ix in enumerate(idx):
            axes = f.dims[d]
            par = self.par
            if (par is not None and par.layout is not None and isinstance(ix, Var) and ix in par.var_pos
                    and set(par.layout.dims[par.var_pos[ix]]) == set(axes)):
                p = par.var_pos[ix]
                for dd, a in f.reg_order:
                    if dd == d:
                        terms.append(f"{par.regvars[(p, a)]} * {f.reg_stride(d, a)}")
            elif f.register_only(d):
                x = self.expr(ix)
                for a in axes:
                    terms.append(f"((({x}) / {a.coeff}) % {a.extent}) * {f.reg_stride(d, a)}")
            else:
                raise CompileError(f"fragment {buf.name}: element index {d} ({ix}) may be held by another thread "
                                   f"(layout {f}); access fragments in T.Parallel loops over their own shape",
                                   self.kernel.loc)
        return " + ".join(terms) or "0"

    def load(self, e: Load) -> str:
        ref = self.ref(e.buffer, e.indices)
        if e.buffer.dtype in _LOW:
            return f"tilehal::to_float({ref})"
        return ref

    def store_value(self, buf: Buffer, value: Expr) -> str:
        if buf.dtype in _LOW:
            return f"tilehal::from_float<{cuda_type(buf.dtype)}>((float)({self.expr(value)}))"
        if buf.dtype == "bool":
            return f"(({self.expr(value)}) != 0)"
        return self.cast_to(value, buf.dtype)

    def zero(self, dtype: str) -> str:
        return f"tilehal::from_float<{cuda_type(dtype)}>(0.0f)" if dtype in _LOW else "0"

    def conv(self, code: str, src_dtype: str, dst_dtype: str) -> str:
        """Convert a stored value of src_dtype to storage dst_dtype."""
        if src_dtype == dst_dtype:
            return code
        v = f"tilehal::to_float({code})" if src_dtype in _LOW else code
        if dst_dtype in _LOW:
            return f"tilehal::from_float<{cuda_type(dst_dtype)}>((float)({v}))"
        return f"(({cuda_type(dst_dtype)})({v}))"

    # ================================================================ statements

    def tracked(self, s: Stmt) -> tuple[set[Buffer], set[Buffer]]:
        def keep(b: Buffer) -> bool:
            return b.scope == "shared" or (b.scope == "global" and b in self.written_globals)

        def expand(bs: set[Buffer]) -> set[Buffer]:  # buffers sharing bytes are one resource
            out = set()
            for b in bs:
                out |= self.alias.get(b, {b})
            return out

        return (expand({b for b in buffers_read(s) if keep(b)}), expand({b for b in buffers_written(s) if keep(b)}))

    def hazard(self, s: Stmt) -> None:
        r, w = self.tracked(s)
        if ((r | w) & self.pending_w) or (w & self.pending_r):
            self.sync()
        self.pending_r |= r
        self.pending_w |= w

    def stmt(self, s: Stmt) -> None:
        if self.par is not None:
            return self.par_stmt(s)
        if isinstance(s, Seq):
            for c in s.body:
                self.stmt(c)
            return
        if isinstance(s, Alloc):
            return self.alloc(s)
        if isinstance(s, Let):
            self.emit(f"const {value_type(s.var.dtype)} {s.var.name} = {self.expr(s.value)};")
            return
        if isinstance(s, If):
            r, w = self.tracked(s)
            if ((r | w) & self.pending_w) or (w & self.pending_r):
                self.sync()
            saved = (set(self.pending_r), set(self.pending_w))
            self.open(f"if ({self.expr(s.cond)})")
            self.stmt(s.then)
            after_then = (self.pending_r, self.pending_w)
            self.close()
            self.pending_r, self.pending_w = set(saved[0]), set(saved[1])
            if s.orelse is not None:
                self.open("else")
                self.stmt(s.orelse)
                self.close()
            self.pending_r |= after_then[0]
            self.pending_w |= after_then[1]
            return
        if isinstance(s, For):
            if s.kind == "parallel":
                self.hazard(s)
                return self.parallel(self.inf.nests[id(s)])
            return self.serial_loop(s)
        self.hazard(s)
        if isinstance(s, Store):
            self.emit(f"{self.ref(s.buffer, s.indices)} = {self.store_value(s.buffer, s.value)};")
        elif isinstance(s, Copy):
            self.copy(s)
        elif isinstance(s, Fill):
            self.fill(s)
        elif isinstance(s, Gemm):
            self.gemm(s)
        elif isinstance(s, Reduce):
            self.reduce(s)
        elif isinstance(s, CumSum):
            self.cumsum(s)
        elif isinstance(s, AtomicAdd):
            self.atomic(s, uniform=True)
        else:
            raise CompileError(f"CUDA codegen: unsupported statement {type(s).__name__}", s.loc)

    def alloc(self, s: Alloc) -> None:
        b = s.buffer
        if b.scope == "shared":
            if b in self.zero_init:  # read before fully written: zero, as the interpreter allocates
                w = self.alias.get(b, {b})
                if (w & self.pending_w) or (w & self.pending_r):
                    self.sync()
                self.pending_w |= w
                n = int(np.prod(b.static_shape()))
                e = self.fresh("z")
                # every element (the swizzle only permutes them)
                self.emit(f"for (int {e} = _tx; {e} < {n}; {e} += {self.threads}) {b.name}[{e}] = {self.zero(b.dtype)};")
            return  # placed in the shared-memory arena
        t = cuda_type(b.dtype)
        if b.scope == "var":
            init = self.store_value(b, s.init) if s.init is not None else self.zero(b.dtype)
            self.emit(f"{t} {b.name} = {init};")
            return
        if b.scope == "fragment":
            n = self.inf.layouts[b].nregs
        else:
            shape = b.static_shape()
            if shape is None:
                raise CompileError(f"local buffer {b.name} needs a static shape", s.loc)
            n = int(np.prod(shape))
        init = self.store_value(b, s.init) if s.init is not None else self.zero(b.dtype)
        self.emit(f"{t} {b.name}[{n}];")
        self.emit("#pragma unroll")
        self.emit(f"for (int _i = 0; _i < {n}; ++_i) {b.name}[_i] = {init};")

    def serial_loop(self, s: For) -> None:
        r, w = self.tracked(s)
        if (r | w) and (self.pending_r or self.pending_w):
            self.sync()
        if id(s) in self.pipes:
            return self.pipelined(s)
        start, ext = self.expr(s.start), self.expr(s.extent)
        v = s.var.name
        if s.kind == "unroll":
            self.emit("#pragma unroll")
        self.open(f"for (int {v} = {start}; {v} < {start} + {ext}; ++{v})")
        self.stmt(s.body)
        if w:
            self.sync()
        self.close()
        if w:
            self.pending_r.clear()
            self.pending_w.clear()

    # ---------------------------------------------------------------- T.Pipelined

    def pipelined(self, s: For) -> None:
        copies = self.pipes[id(s)]
        n = int(s.annotations["num_stages"])
        start, ext = self.expr(s.start), self.expr(s.extent)
        v = s.var.name
        bufs = [c.dst.buffer for c in copies]
        self.emit(f"// T.Pipelined: {n} stages of {', '.join(b.name for b in bufs)} (cp.async)")
        for st in range(n - 1):
            self.open("")
            self.emit(f"const int {v} = {start} + {st};")
            self.open(f"if ({st} < {ext})")
            for c in copies:
                self.stage_expr[c.dst.buffer] = str(st)
                self.copy_async(c)
            self.close()
            self.emit("tilehal::cp_async_commit();")
            self.close()
        # one barrier per iteration: after it, stage k has landed for every thread and every thread is
        # done with stage k-1 (read in the previous iteration), which the prefetch then refills
        self.open(f"for (int {v} = {start}; {v} < {start} + {ext}; ++{v})")
        self.emit(f"tilehal::cp_async_wait<{n - 2}>();")
        self.sync()
        self.open("")
        nxt = self.fresh("knext")
        self.emit(f"const int {nxt} = {v} + {n - 1};")
        self.open(f"if ({nxt} < {start} + {ext})")
        self.emit(f"const int {v} = {nxt};")
        for c in copies:
            self.stage_expr[c.dst.buffer] = f"(({nxt} - ({start})) % {n})"
            self.copy_async(c)
        self.close()
        self.emit("tilehal::cp_async_commit();")
        self.close()
        stage = self.fresh("stage")
        self.emit(f"const int {stage} = ({v} - ({start})) % {n};")
        for b in bufs:
            self.stage_expr[b] = stage
        body = s.body.body if isinstance(s.body, Seq) else [s.body]
        for c in body:
            if any(c is x for x in copies):
                continue
            self.stmt(c)
        self.close()
        self.emit("tilehal::cp_async_wait<0>();")
        # the last iteration's accesses are still in flight for other threads
        r, w = self.tracked(s)
        self.pending_r |= r
        self.pending_w |= w

    # ---------------------------------------------------------------- T.Parallel

    def reg_loops(self, f: Fragment, tag: str) -> dict[tuple[int, Axis], str]:
        names = {}
        for d, a in f.reg_order:
            nm = self.fresh(tag)
            names[(d, a)] = nm
            self.emit("#pragma unroll")
            self.open(f"for (int {nm} = 0; {nm} < {a.extent}; ++{nm})")
        return names

    def dim_exprs(self, f: Fragment, regvars: dict[tuple[int, Axis], str]) -> list[str]:
        out = []
        for d, axes in enumerate(f.dims):
            terms = []
            for a in axes:
                val = self.thread_val(a) if a.kind == "t" else regvars[(d, a)]
                terms.append(f"{val} * {a.coeff}" if a.coeff != 1 else val)
            out.append(" + ".join(terms) or "0")
        return out

    def lead_cond(self, f: Fragment) -> str | None:
        conds = []
        for ts, e in f.replication():
            conds.append(f"((_tx / {ts}) % {e}) == 0")
        return " && ".join(conds) if conds else None

    def layout_loop(self, f: Fragment, names: list[str], body, bounds: list[int] | None = None,
                    vec: tuple[int, Axis] | None = None) -> None:
        """Run `body()` for every element of layout `f` this thread holds, with C ints `names` bound to
        the element's index (elements past `bounds`, the padding of the layout, are skipped). With `vec`
        (the innermost register axis), that axis is not looped: body() handles its elements as a vector."""
        self.open("")
        regvars = {}
        for d, a in f.reg_order:
            if vec is not None and (d, a) == vec:
                regvars[(d, a)] = "0"
                continue
            nm = self.fresh("r")
            regvars[(d, a)] = nm
            self.emit("#pragma unroll")
            self.open(f"for (int {nm} = 0; {nm} < {a.extent}; ++{nm})")
        for nm, ex in zip(names, self.dim_exprs(f, regvars)):
            self.emit(f"const int {nm} = {ex};")
        bounds = list(f.shape) if bounds is None else bounds
        conds = [f"{nm} < {n}" for d, (nm, n) in enumerate(zip(names, bounds)) if f.covered(d) > n]
        if conds:
            self.open(f"if ({' && '.join(conds)})")
        body(regvars)
        if conds:
            self.close()
        for _ in range(len(f.reg_order) - (vec is not None)):
            self.close()
        self.close()

    def _frag_vector(self, f: Fragment, fr: Region, other: Region) -> tuple[int, Axis] | None:
        """The fragment's innermost register axis, when its elements are contiguous in `other` and every
        vector is aligned (16, 8 or 4 bytes): a copy then moves them with one vector access."""
        if not f.reg_order or other.buffer.scope not in ("global", "shared"):
            return None
        d, a = f.reg_order[-1]
        nd = len(f.shape)
        if d != nd - 1 or a.coeff != 1 or a.extent < 2 or f.shape[-1] % a.extent:
            return None
        v = a.extent
        es = esize(other.buffer.dtype)
        if v * es not in (4, 8, 16):
            return None
        rd, cd = other.matrix_dims()
        size = other.buffer.shape[-1]
        if cd != other.buffer.ndim - 1 or not isinstance(size, Const) or int(size.value) % v or \
                not _divisible(other.starts[-1], v) or f.shape[-1] != other.extents[-1]:
            return None
        return (d, a)

    def parallel(self, nest: ParallelNest) -> None:
        names = [v.name for v in nest.vars]
        if nest.layout is None:
            return self.flat_loop([self._extent_expr(nest, i) for i in range(len(names))], names,
                                  lambda: self.par_body(nest.body, ParCtx(None, {}, {}, None)))
        f = nest.layout
        lead = self.lead_cond(f)
        self.open("")
        if lead:
            self.emit(f"const bool _lead = {lead};")

        def body(regvars):
            self.par_body(nest.body, ParCtx(f, {v: i for i, v in enumerate(nest.vars)}, regvars,
                                            "_lead" if lead else None))

        self.layout_loop(f, names, body)
        self.close()

    def _extent_expr(self, nest: ParallelNest, i: int) -> str:
        e = nest.extents[i]
        if e is not None:
            return str(e)
        s = nest.loop
        for _ in range(i):
            s = s.body if not isinstance(s.body, Seq) else s.body.body[0]
        return self.expr(s.extent)

    def flat_loop(self, extents: list[str], names: list[str], body, step: int = 1) -> None:
        """Spread the index space `extents` over the block's threads, element by element."""
        total = " * ".join(f"({e})" for e in extents) or "1"
        static = all(e.isdigit() for e in extents)
        e = self.fresh("e")
        if static:
            n = int(np.prod([int(x) for x in extents]))
            if n <= self.threads:
                self.open(f"if (_tx < {n})")
                self.emit(f"const int {e} = _tx;")
            else:
                if n % self.threads == 0 and n // self.threads <= 32:
                    self.emit("#pragma unroll")
                self.open(f"for (int {e} = _tx; {e} < {n}; {e} += {self.threads})")
        else:
            self.open(f"for (int {e} = _tx; {e} < {total}; {e} += {self.threads})")
        rest = e
        for i in range(len(names) - 1, -1, -1):
            if i == 0:
                self.emit(f"const int {names[i]} = {rest};")
            else:
                self.emit(f"const int {names[i]} = {rest} % ({extents[i]});")
                nr = self.fresh("q")
                self.emit(f"const int {nr} = {rest} / ({extents[i]});")
                rest = nr
        body()
        self.close()

    def par_body(self, s: Stmt, ctx: ParCtx) -> None:
        saved = self.par
        self.par = ctx
        try:
            self.par_stmt(s)
        finally:
            self.par = saved

    def par_stmt(self, s: Stmt) -> None:
        if isinstance(s, Seq):
            for c in s.body:
                self.par_stmt(c)
        elif isinstance(s, Store):
            line = f"{self.ref(s.buffer, s.indices)} = {self.store_value(s.buffer, s.value)};"
            if s.buffer.scope in ("global", "shared") and self.par.lead:
                line = f"if ({self.par.lead}) {line}"
            self.emit(line)
        elif isinstance(s, Let):
            self.emit(f"const {value_type(s.var.dtype)} {s.var.name} = {self.expr(s.value)};")
        elif isinstance(s, If):
            self.open(f"if ({self.expr(s.cond)})")
            self.par_stmt(s.then)
            self.close()
            if s.orelse is not None:
                self.open("else")
                self.par_stmt(s.orelse)
                self.close()
        elif isinstance(s, For):
            v = s.var.name
            start, ext = self.expr(s.start), self.expr(s.extent)
            if s.kind == "unroll":
                self.emit("#pragma unroll")
            self.open(f"for (int {v} = {start}; {v} < {start} + {ext}; ++{v})")
            self.par_stmt(s.body)
            self.close()
        elif isinstance(s, Alloc):
            b = s.buffer
            t = cuda_type(b.dtype)
            init = self.store_value(b, s.init) if s.init is not None else self.zero(b.dtype)
            if b.scope == "var":
                self.emit(f"{t} {b.name} = {init};")
            else:
                n = int(np.prod(b.static_shape()))
                self.emit(f"{t} {b.name}[{n}];")
                self.emit(f"for (int _i = 0; _i < {n}; ++_i) {b.name}[_i] = {init};")
        elif isinstance(s, AtomicAdd):
            self.atomic(s, uniform=False)
        else:
            raise CompileError(f"{type(s).__name__} inside a T.Parallel loop is not supported on cuda", s.loc)

    # ---------------------------------------------------------------- regions

    def region_idx(self, r: Region, coords: list[str]) -> list[str]:
        """Buffer indices (C) of the tile element whose non-unit coordinates are `coords`."""
        it = iter(coords)
        out = []
        for s, n in zip(r.starts, r.extents):
            st = self.expr(s)
            out.append(f"({st} + {next(it)})" if n != 1 else st)
        return out

    def in_bounds(self, r: Region, idx: list[str]) -> str | None:
        if r.buffer.scope != "global":
            return None
        conds = []
        for d, (i, n) in enumerate(zip(idx, r.buffer.shape)):
            st = r.starts[d]
            if isinstance(st, Const) and isinstance(n, Const) and int(st.value) >= 0 and \
                    int(st.value) + r.extents[d] <= int(n.value):
                continue
            conds.append(f"({i}) < {self.dim(n)}")
            if not _nonneg(st):
                conds.append(f"({i}) >= 0")
        return " && ".join(conds) if conds else None

    def mem_ref(self, buf: Buffer, idx: list[str]) -> str:
        if buf.scope == "shared":
            return f"{buf.name}[{self.smem_offset(buf, idx)}]"
        if buf.scope == "var":
            return buf.name
        return f"{buf.name}[{self.flat_index(buf, idx)}]"

    # ---------------------------------------------------------------- T.copy

    def copy(self, s: Copy) -> None:
        src, dst = s.src, s.dst
        ss, ds = src.buffer.scope, dst.buffer.scope
        if src.squeezed() != dst.squeezed():
            raise CompileError(f"T.copy: shape mismatch {tuple(src.extents)} vs {tuple(dst.extents)}", s.loc)
        if ss == "fragment" and ds == "fragment":
            fa, fb = self.inf.layouts[src.buffer], self.inf.layouts[dst.buffer]
            if fa.same_mapping(fb) and self._full(src) and self._full(dst):
                names = [self.fresh("i") for _ in fb.shape]
                f = fb

                def body(regvars):
                    ra = self._reg_by_axes(fa, f, regvars)
                    rb = self._reg_by_axes(fb, f, regvars)
                    self.emit(f"{dst.buffer.name}[{rb}] = {self.conv(f'{src.buffer.name}[{ra}]', src.buffer.dtype, dst.buffer.dtype)};")

                self.layout_loop(f, names, body)
                return
            return self.copy_via_scratch(s)
        if ss == "fragment" or ds == "fragment":
            return self.copy_fragment(s)
        if ss == "local" or ds == "local" or ss == "var" or ds == "var":
            return self.copy_elementwise(s, uniform=True)
        if ss == "global" and ds == "shared" and self._async_copy_ok(s):
            self.copy_async(s)
            self.emit("tilehal::cp_async_commit();")
            self.emit("tilehal::cp_async_wait<0>();")
            return
        v = self._vector_width(src, dst)
        if v > 1:
            return self.copy_vector(s, v)
        self.copy_elementwise(s)

    def _full(self, r: Region) -> bool:
        return tuple(r.extents) == r.buffer.static_shape() and all(isinstance(x, Const) and x.value == 0
                                                                     for x in r.starts)

    def _reg_by_axes(self, f: Fragment, driver: Fragment, regvars) -> str:
        terms = []
        for d, a in f.reg_order:
            terms.append(f"{regvars[(d, a)]} * {f.reg_stride(d, a)}")
        return " + ".join(terms) or "0"

    def _tile_names(self, r: Region) -> list[str]:
        return [self.fresh("c") for _ in (r.squeezed() or [1])]

    def copy_async(self, s: Copy) -> None:
        src, dst = s.src, s.dst
        v = self._vector_width(src, dst)
        nbytes = v * esize(src.buffer.dtype)
        ext = [str(x) for x in (src.squeezed() or [1])]
        ext_v = ext[:-1] + [str(int(ext[-1]) // v)]
        names = self._tile_names(src)

        def body():
            coords = names[:-1] + [f"{names[-1]} * {v}"]
            si = self.region_idx(src, coords if src.squeezed() else [])
            di = self.region_idx(dst, coords if dst.squeezed() else [])
            pred = self.in_bounds(src, si)
            sref = f"&{src.buffer.name}[{self.flat_index(src.buffer, si)}]"
            dref = f"&{dst.buffer.name}[{self.smem_offset(dst.buffer, di)}]"
            if pred:
                sref = f"(({pred}) ? (const void*)({sref}) : (const void*){src.buffer.name})"
            fn = "cp_async_16" if nbytes == 16 else f"cp_async_{nbytes}"
            self.emit(f"tilehal::{fn}({dref}, {sref}{', ' + pred if pred else ''});")

        self.flat_loop(ext_v, names, body)

    def copy_vector(self, s: Copy, v: int) -> None:
        src, dst = s.src, s.dst
        ext = [str(x) for x in (src.squeezed() or [1])]
        ext_v = ext[:-1] + [str(int(ext[-1]) // v)]
        names = self._tile_names(src)
        t = cuda_type(src.buffer.dtype)

        def body():
            coords = names[:-1] + [f"{names[-1]} * {v}"]
            si = self.region_idx(src, coords)
            di = self.region_idx(dst, coords)
            sp, dp = self.in_bounds(src, si), self.in_bounds(dst, di)
            sref = f"&{self.mem_ref(src.buffer, si)}"
            dref = f"&{self.mem_ref(dst.buffer, di)}"
            vt = f"tilehal::Vec<{t}, {v}>"
            tmp = self.fresh("v")
            if sp:
                self.emit(f"{vt} {tmp};")
                self.open(f"if ({sp})")
                self.emit(f"{tmp} = tilehal::load_vec<{t}, {v}>({sref});")
                self.close()
                self.open("else")
                self.emit("#pragma unroll")
                self.emit(f"for (int _k = 0; _k < {v}; ++_k) {tmp}[_k] = tilehal::from_float<{t}>(0.0f);"
                          if t in ("__half", "__nv_bfloat16", "__nv_fp8_e4m3", "__nv_fp8_e5m2") else
                          f"for (int _k = 0; _k < {v}; ++_k) {tmp}[_k] = 0;")
                self.close()
            else:
                self.emit(f"{vt} {tmp} = tilehal::load_vec<{t}, {v}>({sref});")
            st = f"tilehal::store_vec<{t}, {v}>({dref}, {tmp});"
            self.emit(f"if ({dp}) {st}" if dp else st)

        self.flat_loop(ext_v, names, body)

    def copy_elementwise(self, s: Copy, uniform: bool = False) -> None:
        src, dst = s.src, s.dst
        ext = [str(x) for x in (src.squeezed() or [1])]
        names = self._tile_names(src)

        def body():
            si = self.region_idx(src, names if src.squeezed() else [])
            di = self.region_idx(dst, names if dst.squeezed() else [])
            sp, dp = self.in_bounds(src, si), self.in_bounds(dst, di)
            val = self.mem_ref(src.buffer, si)
            if sp:
                zero = self.conv("0", "int32", src.buffer.dtype) if src.buffer.dtype in _LOW else "0"
                val = f"(({sp}) ? {val} : {zero})"
            line = f"{self.mem_ref(dst.buffer, di)} = {self.conv(val, src.buffer.dtype, dst.buffer.dtype)};"
            self.emit(f"if ({dp}) {line}" if dp else line)

        if uniform:
            self.open("")
            for n, e in zip(names, ext):
                self.open(f"for (int {n} = 0; {n} < {e}; ++{n})")
            body()
            for _ in names:
                self.close()
            self.close()
        else:
            self.flat_loop(ext, names, body)

    def copy_fragment(self, s: Copy) -> None:
        """Each thread moves the fragment elements it holds (masked at the edges of global tensors)."""
        src, dst = s.src, s.dst
        fr, other = (src, dst) if src.buffer.scope == "fragment" else (dst, src)
        f = self.inf.layouts[fr.buffer]
        if not self._full(fr):
            raise CompileError(f"T.copy of part of fragment {fr.buffer.name} is not supported on cuda; copy the whole "
                               f"fragment", s.loc)
        names = [self.fresh("i") for _ in f.shape]
        nonunit = [nm for nm, n in zip(names, f.shape) if n != 1]
        lead = self.lead_cond(f) if fr is src and other.buffer.scope in ("global", "shared") else None
        vec = self._frag_vector(f, fr, other)

        def body(regvars):
            reg = self._reg_by_axes(f, f, regvars)
            oi = self.region_idx(other, nonunit if other.squeezed() else [])
            pred = self.in_bounds(other, oi)
            oref = self.mem_ref(other.buffer, oi)
            fref = f"{fr.buffer.name}[{reg}]"
            if vec is not None:
                v = vec[1].extent
                t = cuda_type(other.buffer.dtype)
                vt = f"tilehal::Vec<{t}, {v}>"
                tmp = self.fresh("v")
                fd, od = fr.buffer.dtype, other.buffer.dtype
                if fr is src:
                    self.emit(f"{vt} {tmp};")
                    self.emit("#pragma unroll")
                    self.emit(f"for (int _u = 0; _u < {v}; ++_u) {tmp}[_u] = "
                              f"{self.conv(f'{fr.buffer.name}[{reg} + _u]', fd, od)};")
                    conds = [c for c in (pred, lead) if c]
                    line = f"tilehal::store_vec<{t}, {v}>(&{oref}, {tmp});"
                    self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
                else:
                    self.emit(f"{vt} {tmp};")
                    load = f"{tmp} = tilehal::load_vec<{t}, {v}>(&{oref});"
                    if pred:
                        self.emit(f"if ({pred}) {load} else for (int _u = 0; _u < {v}; ++_u) {tmp}[_u] = "
                                  f"{self.zero(od)};")
                    else:
                        self.emit(load)
                    self.emit("#pragma unroll")
                    self.emit(f"for (int _u = 0; _u < {v}; ++_u) {fr.buffer.name}[{reg} + _u] = "
                              f"{self.conv(f'{tmp}[_u]', od, fd)};")
                return
            if fr is src:
                conds = [c for c in (pred, lead) if c]
                line = f"{oref} = {self.conv(fref, fr.buffer.dtype, other.buffer.dtype)};"
                self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
            else:
                val = self.conv(oref, other.buffer.dtype, fr.buffer.dtype)
                if pred:
                    zero = self.conv("0", "int32", fr.buffer.dtype) if fr.buffer.dtype in _LOW else "0"
                    val = f"(({pred}) ? {val} : {zero})"
                self.emit(f"{fref} = {val};")

        self.layout_loop(f, names, body, vec=vec)

    def stage_fragment(self, buf: Buffer, to_scratch: bool, base: str) -> None:
        """fragment <-> scratch (row-major, compute type): the way between two layouts."""
        f = self.inf.layouts[buf]
        names = [self.fresh("i") for _ in f.shape]
        shape = list(f.shape)
        ct = value_type(buf.dtype)

        def body(regvars):
            reg = self._reg_by_axes(f, f, regvars)
            flat = names[0] if names else "0"
            for d in range(1, len(names)):
                flat = f"({flat}) * {shape[d]} + {names[d]}"
            sref = f"(({ct}*){base})[{flat}]"
            fref = f"{buf.name}[{reg}]"
            if to_scratch:
                val = f"tilehal::to_float({fref})" if buf.dtype in _LOW else fref
                self.emit(f"{sref} = {val};")
            else:
                self.emit(f"{fref} = {self.conv(sref, dt.compute_type(buf.dtype), buf.dtype)};")

        self.layout_loop(f, names, body)

    def copy_via_scratch(self, s: Copy) -> None:
        a, b = s.src.buffer, s.dst.buffer
        if not (self._full(s.src) and self._full(s.dst)):
            raise CompileError("T.copy between parts of fragments with different layouts is not supported", s.loc)
        n = int(np.prod(a.static_shape()))
        base = self.scratch(n * 8)
        self.emit("__syncthreads();")
        self.stage_fragment(a, True, base)
        self.emit("__syncthreads();")
        self.stage_fragment(b, False, base)
        self.emit("__syncthreads();")

    # ---------------------------------------------------------------- T.fill

    def fill(self, s: Fill) -> None:
        r = s.dst
        b = r.buffer
        if b.scope == "fragment" and self._full(r):
            n = self.inf.layouts[b].nregs
            self.emit("#pragma unroll")
            self.emit(f"for (int _i = 0; _i < {n}; ++_i) {b.name}[_i] = {self.store_value(b, s.value)};")
            return
        if b.scope == "fragment":
            f = self.inf.layouts[b]
            names = [self.fresh("i") for _ in f.shape]

            def body(regvars):
                reg = self._reg_by_axes(f, f, regvars)
                conds = []
                for d, nm in enumerate(names):
                    st = self.expr(r.starts[d])
                    conds.append(f"{nm} >= {st} && {nm} < {st} + {r.extents[d]}")
                self.emit(f"if ({' && '.join(conds)}) {b.name}[{reg}] = {self.store_value(b, s.value)};")

            return self.layout_loop(f, names, body)
        ext = [str(x) for x in (r.squeezed() or [1])]
        names = self._tile_names(r)

        def body2():
            idx = self.region_idx(r, names if r.squeezed() else [])
            pred = self.in_bounds(r, idx)
            line = f"{self.mem_ref(b, idx)} = {self.store_value(b, s.value)};"
            self.emit(f"if ({pred}) {line}" if pred else line)

        if b.scope in ("local", "var"):
            self.open("")
            for n, e in zip(names, ext):
                self.open(f"for (int {n} = 0; {n} < {e}; ++{n})")
            body2()
            for _ in names:
                self.close()
            self.close()
        else:
            self.flat_loop(ext, names, body2)

    # ---------------------------------------------------------------- T.reduce_*

    def reduce(self, s: Reduce) -> None:
        src, dst = s.src, s.dst
        if src.scope != "fragment" or dst.scope not in ("fragment",):
            raise CompileError(f"T.reduce_{s.kind} on cuda reduces a fragment into a fragment, got {src.name} "
                               f"({src.scope}) -> {dst.name} ({dst.scope})", s.loc)
        fs, fd = self.inf.layouts[src], self.inf.layouts[dst]
        acc_t = dt.compute_type(dst.dtype)
        ct = value_type(dst.dtype)
        init = {"sum": 0.0, "abssum": 0.0, "max": float("-inf"), "absmax": 0.0, "min": float("inf")}[s.kind]
        if dt.is_int(acc_t) and math.isinf(init):
            info = np.iinfo(np.dtype(acc_t))
            init_c = str(int(info.max if init > 0 else info.min))
        elif dt.is_int(acc_t):
            init_c = "0"
        else:
            init_c = float_literal(init, acc_t)
        op = {"sum": "+", "abssum": "+", "max": "max", "absmax": "max", "min": "min"}[s.kind]

        def comb(a: str, b: str) -> str:
            return f"({a} + {b})" if op == "+" else f"tl_{op}<{ct}>({a}, {b})"

        red_axes = list(fs.dims[s.dim])
        kept = [d for d in range(src.ndim) if d != s.dim]
        dst_dim = {d: (i if dst.ndim != src.ndim else d) for i, d in enumerate(kept)}
        warp_ax, cross_ax = [], []
        for a in red_axes:
            if a.kind != "t":
                continue
            if a.tstride * a.extent <= 32:
                warp_ax.append((a.tstride, a.extent))
            elif a.tstride >= 32:
                cross_ax.append((a.tstride, a.extent))
            else:
                inner = 32 // a.tstride
                warp_ax.append((a.tstride, inner))
                cross_ax.append((32, a.extent // inner))
        nd = fd.nregs
        self.emit(f"// T.reduce_{s.kind}({src.name} -> {dst.name}, dim={s.dim})")
        self.open("")
        accs = self.fresh("acc")
        self.emit(f"{ct} {accs}[{nd}];")
        # registers of the kept dims (outer loops), then the reduced registers (inner loops)
        kept_regs = [(d, a) for d, a in fs.reg_order if d != s.dim]
        red_regs = [(d, a) for d, a in fs.reg_order if d == s.dim]
        names = {}
        for d, a in kept_regs:
            nm = self.fresh("r")
            names[(d, a)] = nm
            self.emit("#pragma unroll")
            self.open(f"for (int {nm} = 0; {nm} < {a.extent}; ++{nm})")
        dreg = " + ".join(f"{names[(d, a)]} * {fd.reg_stride(dst_dim[d], a)}" for d, a in kept_regs) or "0"
        acc = self.fresh("a")
        self.emit(f"{ct} {acc} = {init_c};")
        for d, a in red_regs:
            nm = self.fresh("r")
            names[(d, a)] = nm
            self.emit("#pragma unroll")
            self.open(f"for (int {nm} = 0; {nm} < {a.extent}; ++{nm})")
        sreg = " + ".join(f"{names[(d, a)]} * {fs.reg_stride(d, a)}" for d, a in fs.reg_order) or "0"
        val = f"{src.name}[{sreg}]"
        val = f"tilehal::to_float({val})" if src.dtype in _LOW else f"(({ct}){val})"
        if s.kind in ("abssum", "absmax"):
            val = f"fabsf({val})" if not dt.is_int(acc_t) else f"abs({val})"
        # padding of the reduced dim holds no data
        if fs.covered(s.dim) > fs.shape[s.dim]:
            terms = []
            for a in red_axes:
                v = self.thread_val(a) if a.kind == "t" else names[(s.dim, a)]
                terms.append(f"{v} * {a.coeff}")
            self.emit(f"if (({' + '.join(terms)}) < {fs.shape[s.dim]}) {acc} = {comb(acc, val)};")
        else:
            self.emit(f"{acc} = {comb(acc, val)};")
        for _ in red_regs:
            self.close()
        for ts, e in warp_ax:
            off = ts
            while off < ts * e:
                self.emit(f"{acc} = {comb(acc, f'__shfl_xor_sync(0xffffffffu, {acc}, {off})')};")
                off *= 2
        self.emit(f"{accs}[{dreg}] = {acc};")
        for _ in kept_regs:
            self.close()
        if cross_ax:
            base = self.scratch(nd * self.threads * 8)
            sp = f"(({ct}*){base})"
            self.emit("__syncthreads();")
            self.emit(f"for (int _i = 0; _i < {nd}; ++_i) {sp}[_i * {self.threads} + _tx] = {accs}[_i];")
            self.emit("__syncthreads();")
            self.open(f"for (int _i = 0; _i < {nd}; ++_i)")
            self.emit(f"{ct} _a = {init_c};")
            base_t = "_tx"
            for ts, e in cross_ax:
                base_t = f"({base_t} - ((_tx / {ts}) % {e}) * {ts})"
            loops = []
            for k, (ts, e) in enumerate(cross_ax):
                w = f"_w{k}"
                loops.append(f"{w} * {ts}")
                self.open(f"for (int {w} = 0; {w} < {e}; ++{w})")
            self.emit(f"_a = {comb('_a', f'{sp}[_i * {self.threads} + {base_t} + {chr(43).join(loops)}]')};")
            for _ in cross_ax:
                self.close()
            self.emit(f"{accs}[_i] = _a;")
            self.close()
            self.emit("__syncthreads();")
        self.emit("#pragma unroll")
        if s.clear:
            self.emit(f"for (int _i = 0; _i < {nd}; ++_i) {dst.name}[_i] = {self.conv(f'{accs}[_i]', acc_t, dst.dtype)};")
        else:
            old = f"tilehal::to_float({dst.name}[_i])" if dst.dtype in _LOW else f"{dst.name}[_i]"
            self.emit(f"for (int _i = 0; _i < {nd}; ++_i) {dst.name}[_i] = "
                      f"{self.conv(comb(old, f'{accs}[_i]'), acc_t, dst.dtype)};")
        self.close()

    # ---------------------------------------------------------------- T.cumsum

    def cumsum(self, s: CumSum) -> None:
        src, dst = s.src, s.dst
        shape = src.static_shape()
        n = int(np.prod(shape))
        ct = value_type(dst.dtype)
        base = self.scratch(n * 8)
        sp = f"(({ct}*){base})"
        self.emit(f"// T.cumsum({src.name} -> {dst.name}, dim={s.dim}, reverse={s.reverse})")
        self.emit("__syncthreads();")
        self._to_from_scratch(src, sp, True)
        self.emit("__syncthreads();")
        rows = n // shape[s.dim]
        inner = int(np.prod(shape[s.dim + 1:]))
        L = shape[s.dim]
        self.open(f"for (int _row = _tx; _row < {rows}; _row += {self.threads})")
        self.emit(f"const int _base = (_row / {inner}) * {L * inner} + (_row % {inner});")
        self.emit(f"{ct} _acc = 0;")
        self.open(f"for (int _k = 0; _k < {L}; ++_k)")
        kk = f"({L - 1} - _k)" if s.reverse else "_k"
        self.emit(f"const int _o = _base + {kk} * {inner};")
        self.emit(f"_acc += {sp}[_o];")
        self.emit(f"{sp}[_o] = _acc;")
        self.close()
        self.close()
        self.emit("__syncthreads();")
        self._to_from_scratch(dst, sp, False)
        self.emit("__syncthreads();")

    def _to_from_scratch(self, buf: Buffer, sp: str, to: bool) -> None:
        if buf.scope == "fragment":
            f = self.inf.layouts[buf]
            names = [self.fresh("i") for _ in f.shape]
            shape = list(f.shape)

            def body(regvars):
                reg = self._reg_by_axes(f, f, regvars)
                flat = names[0]
                for d in range(1, len(names)):
                    flat = f"({flat}) * {shape[d]} + {names[d]}"
                fref = f"{buf.name}[{reg}]"
                if to:
                    self.emit(f"{sp}[{flat}] = {'tilehal::to_float(' + fref + ')' if buf.dtype in _LOW else fref};")
                else:
                    self.emit(f"{fref} = {self.conv(f'{sp}[{flat}]', dt.compute_type(buf.dtype), buf.dtype)};")

            self.layout_loop(f, names, body)
            return
        shape = buf.static_shape()
        names = [self.fresh("c") for _ in shape]

        def body2():
            flat = names[0]
            for d in range(1, len(names)):
                flat = f"({flat}) * {shape[d]} + {names[d]}"
            ref = self.mem_ref(buf, names)
            if to:
                self.emit(f"{sp}[{flat}] = {'tilehal::to_float(' + ref + ')' if buf.dtype in _LOW else ref};")
            else:
                self.emit(f"{ref} = {self.conv(f'{sp}[{flat}]', dt.compute_type(buf.dtype), buf.dtype)};")

        if buf.scope in ("local", "var"):
            raise CompileError(f"T.cumsum on a {buf.scope} buffer is not supported on cuda")
        self.flat_loop([str(x) for x in shape], names, body2)

    # ---------------------------------------------------------------- T.atomic_add

    def atomic(self, s: AtomicAdd, uniform: bool) -> None:
        dst = s.dst
        if not isinstance(s.src, Region):
            idx = [self.expr(x) for x in dst.starts]
            pred = self.in_bounds(Region(dst.buffer, dst.starts, [1] * dst.buffer.ndim), idx)
            val = self.store_value(dst.buffer, s.src)
            conds = [c for c in (pred, "_tx == 0" if uniform else (self.par.lead if self.par else None)) if c]
            line = f"atomicAdd(&{self.mem_ref(dst.buffer, idx)}, {val});"
            self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
            return
        src = s.src
        if src.buffer.scope == "fragment":
            f = self.inf.layouts[src.buffer]
            names = [self.fresh("i") for _ in f.shape]
            nonunit = [nm for nm, n in zip(names, f.shape) if n != 1]
            lead = self.lead_cond(f)

            def body(regvars):
                reg = self._reg_by_axes(f, f, regvars)
                di = self.region_idx(dst, nonunit if dst.squeezed() else [])
                pred = self.in_bounds(dst, di)
                conds = [c for c in (pred, lead) if c]
                val = self.conv(f"{src.buffer.name}[{reg}]", src.buffer.dtype, dst.buffer.dtype)
                line = f"atomicAdd(&{self.mem_ref(dst.buffer, di)}, {val});"
                self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)

            return self.layout_loop(f, names, body)
        ext = [str(x) for x in (src.squeezed() or [1])]
        names = self._tile_names(src)

        def body2():
            si = self.region_idx(src, names if src.squeezed() else [])
            di = self.region_idx(dst, names if dst.squeezed() else [])
            sp, dp = self.in_bounds(src, si), self.in_bounds(dst, di)
            conds = [c for c in (sp, dp) if c]
            val = self.conv(self.mem_ref(src.buffer, si), src.buffer.dtype, dst.buffer.dtype)
            line = f"atomicAdd(&{self.mem_ref(dst.buffer, di)}, {val});"
            self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)

        self.flat_loop(ext, names, body2)

    # ---------------------------------------------------------------- T.gemm

    def gemm(self, s: Gemm) -> None:
        plan = self.inf.gemms[id(s)]
        if plan.kind == "mma":
            return self.gemm_mma(s, plan)
        return self.gemm_simt(s, plan)

    def _smem_addr(self, r: Region, row: str, col: str) -> str:
        rd, cd = r.matrix_dims()
        idx = [self.expr(x) for x in r.starts]
        idx[rd] = f"({idx[rd]} + {row})"
        idx[cd] = f"({idx[cd]} + {col})"
        return f"&{r.buffer.name}[{self.smem_offset(r.buffer, idx)}]"

    def _mma_reg(self, f: Fragment, mi: str, nj: str, h: str, c: str) -> str:
        """Register of (m16 tile mi, n8 tile nj, half h, column c) in an mma-shaped layout."""
        want = {(0, 16): mi, (1, 8): nj, (0, 8): h, (1, 1): c}
        terms = []
        for d, a in f.reg_order:
            key = (d, a.coeff)
            if key not in want:
                raise CompileError(f"layout {f} is not an mma.sync fragment", self.kernel.loc)
            terms.append(f"({want[key]}) * {f.reg_stride(d, a)}")
        return " + ".join(terms) or "0"

    def gemm_mma(self, s: Gemm, plan: GemmPlan) -> None:
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        wm, wn = plan.warps_m, plan.warps_n
        WM, WN = m // wm, n // wn
        MI, NJ = WM // 16, WN // 8
        ks = plan.kstep
        tag = _MMA_TAG[s.A.buffer.dtype]
        fc = self.inf.layouts[s.C.buffer]
        c = s.C.buffer.name
        acc_t = "int" if s.C.buffer.dtype == "int32" else "float"
        self.emit(f"// T.gemm {m}x{n}x{kdim} {s.A.buffer.dtype}: mma.sync m16n8k{ks}, warps {wm}x{wn}")
        self.open("")
        self.emit("const int _warp = _tx >> 5, _lane = _tx & 31;")
        self.emit(f"const int _wm = (_warp / {wn}) % {wm} * {WM}, _wn = (_warp % {wn}) * {WN};")
        if s.clear_accum:
            self.emit("#pragma unroll")
            self.emit(f"for (int _i = 0; _i < {fc.nregs}; ++_i) {c}[_i] = 0;")
        self.emit("const int _q = _lane >> 3, _r8 = _lane & 7;")
        self.emit("#pragma unroll")
        self.open(f"for (int _kk = 0; _kk < {kdim // ks}; ++_kk)")
        self.emit(f"tilehal::u32 _a[{MI}][4];")
        self.emit(f"tilehal::u32 _b[{NJ}][2];")
        kcol = "(_q >> 1) * 8" if ks == 16 else "(_q >> 1) * 16"
        # A
        self.emit("#pragma unroll")
        self.open(f"for (int _mi = 0; _mi < {MI}; ++_mi)")
        if s.A.buffer.scope == "fragment":
            fa = self.inf.layouts[s.A.buffer]
            an = s.A.buffer.name
            regs = [self._mma_reg(fa, "_mi", f"2 * _kk + {j}", str(h), "0") for j, h in ((0, 0), (0, 1), (1, 0), (1, 1))]
            for i, r in enumerate(regs):
                self.emit(f"_a[_mi][{i}] = tilehal::pack2_bits({an}[{r}], {an}[{r} + {fa.reg_stride(1, Axis('r', 2, 1))}]);")
        elif not s.transpose_A:
            row = "_wm + _mi * 16 + (_q & 1) * 8 + _r8"
            col = f"_kk * {ks} + {kcol}"
            self.emit(f"tilehal::ldmatrix_x4(_a[_mi], {self._smem_addr(s.A, row, col)});")
        else:
            row = "_kk * 16 + (_q >> 1) * 8 + _r8"
            col = "_wm + _mi * 16 + (_q & 1) * 8"
            self.emit(f"tilehal::ldmatrix_x4_trans(_a[_mi], {self._smem_addr(s.A, row, col)});")
        self.close()
        # B, two n8 tiles per ldmatrix.x4
        self.emit("#pragma unroll")
        self.open(f"for (int _p = 0; _p < {NJ // 2}; ++_p)")
        self.emit("tilehal::u32 _t[4];")
        if s.transpose_B:
            row = "_wn + (_p * 2 + (_q >> 1)) * 8 + _r8"
            col = f"_kk * {ks} + (_q & 1) * {ks // 2}"
            self.emit(f"tilehal::ldmatrix_x4(_t, {self._smem_addr(s.B, row, col)});")
        else:
            row = "_kk * 16 + (_q & 1) * 8 + _r8"
            col = "_wn + (_p * 2 + (_q >> 1)) * 8"
            self.emit(f"tilehal::ldmatrix_x4_trans(_t, {self._smem_addr(s.B, row, col)});")
        self.emit("_b[2 * _p][0] = _t[0]; _b[2 * _p][1] = _t[1]; _b[2 * _p + 1][0] = _t[2]; _b[2 * _p + 1][1] = _t[3];")
        self.close()
        self.emit("#pragma unroll")
        self.open(f"for (int _mi = 0; _mi < {MI}; ++_mi)")
        self.emit("#pragma unroll")
        self.open(f"for (int _nj = 0; _nj < {NJ}; ++_nj)")
        creg = self._mma_reg(fc, "_mi", "_nj", "0", "0")
        fn = "mma_m16n8k16" if ks == 16 else "mma_m16n8k32"
        self.emit(f"tilehal::{fn}(tilehal::{tag}(), *reinterpret_cast<{acc_t}(*)[4]>(&{c}[{creg}]), _a[_mi], _b[_nj]);")
        self.close()
        self.close()
        self.close()
        self.close()
        # the accumulator registers are in (mi, nj, h, c) order with (h, c) innermost: checked here
        for h, cc, k in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)):
            try:
                st = fc.reg_stride(0, Axis("r", 2, 8)) * h + fc.reg_stride(1, Axis("r", 2, 1)) * cc
            except KeyError:
                st = k
            if st != k:
                raise CompileError(f"T.gemm accumulator {c}: registers not in mma order ({fc})", s.loc)

    def gemm_simt(self, s: Gemm, plan: GemmPlan) -> None:
        cbuf = s.C.buffer
        f = self.inf.layouts[cbuf]
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        acc_t = dt.compute_type(cbuf.dtype)
        ct = value_type(acc_t)
        self.emit(f"// T.gemm {m}x{n}x{kdim} on CUDA cores ({plan.reason})")
        staged = {}
        off = 0
        for r in (s.A, s.B):
            if r.buffer.scope == "fragment" and r.buffer not in staged:
                staged[r.buffer] = off
                off += int(np.prod(r.buffer.static_shape()))
        if staged:
            base = self.scratch(off * 8)
            self.emit("__syncthreads();")
            for b, o in staged.items():
                self.stage_fragment(b, True, f"((({value_type(b.dtype)}*){base}) + {o})")
            self.emit("__syncthreads();")

        def operand(r: Region, row: str, col: str) -> str:
            b = r.buffer
            rd, cd = r.matrix_dims()
            if b in staged:
                shape = b.static_shape()
                idx = [self.expr(x) for x in r.starts]
                if rd >= 0:
                    idx[rd] = f"({idx[rd]} + {row})"
                if cd >= 0:
                    idx[cd] = f"({idx[cd]} + {col})"
                flat = idx[0]
                for d in range(1, len(idx)):
                    flat = f"({flat}) * {shape[d]} + {idx[d]}"
                return f"((({value_type(b.dtype)}*){base}) + {staged[b]})[{flat}]"
            idx = [self.expr(x) for x in r.starts]
            if rd >= 0:
                idx[rd] = f"({idx[rd]} + {row})"
            if cd >= 0:
                idx[cd] = f"({idx[cd]} + {col})"
            ref = self.mem_ref(b, idx)
            return f"tilehal::to_float({ref})" if b.dtype in _LOW else ref

        names = [self.fresh("i"), self.fresh("j")]
        cn = [nm for nm in names]

        def body(regvars):
            reg = self._reg_by_axes(f, f, regvars)
            i, j = cn
            a = operand(s.A, "_k", i) if s.transpose_A else operand(s.A, i, "_k")
            b = operand(s.B, j, "_k") if s.transpose_B else operand(s.B, "_k", j)
            self.emit(f"{ct} _acc = 0;")
            self.open(f"for (int _k = 0; _k < {kdim}; ++_k)")
            self.emit(f"_acc += (({ct})({a})) * (({ct})({b}));")
            self.close()
            old = f"tilehal::to_float({cbuf.name}[{reg}])" if cbuf.dtype in _LOW else f"{cbuf.name}[{reg}]"
            val = "_acc" if s.clear_accum else f"({old} + _acc)"
            self.emit(f"{cbuf.name}[{reg}] = {self.conv(val, acc_t, cbuf.dtype)};")

        if len(f.shape) != 2:
            raise CompileError(f"T.gemm accumulator {cbuf.name} must be 2-D", s.loc)
        self.layout_loop(f, names, body)
        if staged:
            self.emit("__syncthreads();")

    # ================================================================ the kernel

    def place_smem(self) -> None:
        """Offsets for the shared buffers (before lowering: barriers must know which buffers alias)."""
        allocs = [st for st in walk_stmts(self.kernel.body) if isinstance(st, Alloc) and st.buffer.scope == "shared"]
        # live ranges over a pre-order numbering of statements; a use inside a loop spans the loop
        order: dict[int, int] = {}
        spans: dict[int, tuple[int, int]] = {}

        def number(s: Stmt, loops: list[int]) -> None:
            i = len(order)
            order[id(s)] = i
            from ...ir.visit import child_stmts

            for c in child_stmts(s):
                number(c, loops + ([id(s)] if isinstance(s, For) else []))
            spans[id(s)] = (i, len(order))

        number(self.kernel.body, [])
        live: dict[Buffer, list[int]] = {}

        def uses(s: Stmt, loops: list[Stmt]) -> None:
            from ...ir.visit import child_stmts

            if not isinstance(s, (Seq, For, If, Kernel)):
                touched = buffers_read(s) | buffers_written(s)
                if isinstance(s, Alloc) and s.buffer in self.zero_init:
                    touched.add(s.buffer)
                for b in touched:
                    if b.scope == "shared":
                        lo, hi = spans[id(s)]
                        if loops:
                            lo, hi = spans[id(loops[0])]
                        cur = live.setdefault(b, [lo, hi])
                        cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
            for c in child_stmts(s):
                uses(c, loops + ([s] if isinstance(s, For) and s.kind != "parallel" else []))
            if isinstance(s, If):
                for x in walk_expr(s.cond):
                    if isinstance(x, Load) and x.buffer.scope == "shared":
                        lo, hi = spans[id(s)]
                        cur = live.setdefault(x.buffer, [lo, hi])
                        cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)

        uses(self.kernel.body, [])
        placed: list[tuple[int, int, int, int]] = []  # (offset, end, live lo, live hi)
        sizes = []
        for a in allocs:
            b = a.buffer
            shape = b.static_shape()
            if shape is None:
                raise CompileError(f"shared buffer {b.name} needs a static shape", a.loc)
            stages = self.stages.get(b, 1)
            nbytes = int(np.prod(shape)) * esize(b.dtype) * stages
            sizes.append((nbytes, b))
        for nbytes, b in sorted(sizes, key=lambda x: -x[0]):
            lo, hi = live.get(b, [0, 0])
            off = 0
            changed = True  # first fit: move past every buffer that is live at the same time and overlaps
            while changed:
                changed = False
                for o, e, l2, h2 in placed:
                    if not (hi <= l2 or h2 <= lo) and off < e and o < off + nbytes:
                        off = -(-e // SMEM_ALIGN) * SMEM_ALIGN
                        changed = True
            placed.append((off, off + nbytes, lo, hi))
            shape = b.static_shape()
            self.smem[b] = SmemInfo(off, self.stages.get(b, 1), int(np.prod(shape)), self.swizzled.get(b))
        self.smem_end = max([e for _, e, _, _ in placed], default=0)
        self.smem_sizes = sizes
        self.alias: dict[Buffer, set[Buffer]] = {}
        for b, info in self.smem.items():
            lo = info.offset
            hi = lo + int(np.prod(b.static_shape())) * esize(b.dtype) * info.stages
            group = set()
            for c, ci in self.smem.items():
                clo = ci.offset
                chi = clo + int(np.prod(c.static_shape())) * esize(c.dtype) * ci.stages
                if clo < hi and lo < chi:
                    group.add(c)
            self.alias[b] = group

    def plan_smem(self) -> tuple[int, list[str]]:
        sizes = self.smem_sizes
        scratch_off = -(-self.smem_end // SMEM_ALIGN) * SMEM_ALIGN
        total = scratch_off + self.scratch_bytes
        if total > SMEM_LIMIT:
            detail = ", ".join(f"{b.name}: {nb} B" for nb, b in sizes)
            raise CompileError(f"T.Kernel needs {total} bytes of shared memory ({detail}"
                               f"{', scratch: ' + str(self.scratch_bytes) + ' B' if self.scratch_bytes else ''}); "
                               f"an sm_90 block can use at most {SMEM_LIMIT}", self.kernel.loc)
        decls = []
        for b, info in self.smem.items():
            decls.append(f"{cuda_type(b.dtype)}* {b.name} = reinterpret_cast<{cuda_type(b.dtype)}*>(_tl_smem + "
                         f"{info.offset});")
        if self.scratch_bytes:
            decls.append(f"unsigned char* _tl_scratch = _tl_smem + {scratch_off};")
        return total, decls

    def generate(self) -> tuple[str, int]:
        self.written_globals = {b for b in buffers_written(self.kernel.body) if b.scope == "global"}
        k = self.kernel
        self.place_smem()
        self.stmt(k.body)
        body = self.lines
        smem_bytes, decls = self.plan_smem()
        params = []
        for p in self.func.params:
            params.append(f"{cuda_type(p.dtype)}* __restrict__ {p.name}")
        for v in self.func.dynamic_vars:
            params.append(f"int {v.name}")
        head = [f'extern "C" __global__ void __launch_bounds__({self.threads}) {self.name}({", ".join(params)}) {{',
                "  extern __shared__ __align__(1024) unsigned char _tl_smem[];",
                "  const int _tx = threadIdx.x;"]
        axes = ["blockIdx.x", "blockIdx.y", "blockIdx.z"]
        swz = k.attrs.get("swizzle")
        if swz and swz[2] and len(k.block_vars) >= 2:
            panel, order = int(swz[0]), swz[1]
            gx, gy = ("gridDim.x", "gridDim.y") if order == "row" else ("gridDim.y", "gridDim.x")
            ix, iy = ("blockIdx.x", "blockIdx.y") if order == "row" else ("blockIdx.y", "blockIdx.x")
            head += [f"  // T.use_swizzle(panel_size={panel}, order={order!r}): blocks walk panels of {panel} columns",
                     f"  const int _bid = {iy} * {gx} + {ix};",
                     f"  const int _panel = _bid / ({panel} * {gy});",
                     f"  const int _inpanel = _bid % ({panel} * {gy});",
                     f"  const int _pw = min({panel}, (int){gx} - _panel * {panel});",
                     f"  const int _sx = _panel * {panel} + _inpanel % _pw, _sy = _inpanel / _pw;"]
            remap = {ix: "_sx", iy: "_sy"}
            axes = [remap.get(a, a) for a in axes]
        for v, a in zip(k.block_vars, axes):
            head.append(f"  const int {v.name} = {a};")
        for let in self.lets:
            head.append(f"  const {value_type(let.var.dtype)} {let.var.name} = {self.expr(let.value)};")
        head += ["  " + d for d in decls]
        src = "\n".join(head + body + ["}"])
        return src, smem_bytes


def generate_cuda(func: PrimFunc, base_name: str) -> tuple[str, list[tuple[str, Kernel, int]]]:
    """CUDA source for every T.Kernel of `func`: (source, [(kernel name, Kernel node, smem bytes)])."""
    body = func.body.body if isinstance(func.body, Seq) else [func.body]
    lets: list[Let] = []
    kernels = []
    parts = []
    for s in body:
        if isinstance(s, Let):
            lets.append(s)
        elif isinstance(s, Kernel):
            name = f"{base_name}_k{len(kernels)}"
            src, smem = KernelCodegen(func, s, name, list(lets)).generate()
            parts.append(src)
            kernels.append((name, s, smem))
        elif isinstance(s, Seq) and not s.body:
            continue
        else:
            raise CompileError(f"cuda: statements outside T.Kernel ({type(s).__name__}) are not supported", s.loc)
    if not kernels:
        raise CompileError("cuda: the prim_func has no T.Kernel", func.loc)
    source = f"// generated by tilelang from {func.name}\n{PRELUDE}\n" + "\n\n".join(parts) + "\n"
    return source, kernels


__all__ = ["KernelCodegen", "SMEM_LIMIT", "generate_cuda"]

