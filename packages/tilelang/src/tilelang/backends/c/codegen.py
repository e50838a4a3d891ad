"""Tile IR (lowered) -> C source.

One exported function per prim_func. Thread blocks are spread over cores with
`#pragma omp for` (dynamic schedule, so causal kernels with uneven blocks balance); shared,
fragment and local buffers are allocated once per OpenMP thread and reused across its blocks.
Global tensors of 16/8-bit float types are raw bits converted on load/store; on-chip buffers of
those types are held as float and rounded on store, matching the interpreter bit for bit.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from ...errors import CompileError
from ...ir import dtypes as dt
from ...ir.bounds import MAX_GRID
from ...ir.nodes import (
    Alloc,
    AtomicAdd,
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
    Seq,
    Stmt,
    Store,
    While,
    register_rules,
)
from ...ir.visit import seq_rule, walk_stmts
from ..cexpr import C_MATH, CExprEmitter
from .guard_memory import BoundsFail

# kernel status codes (the function's return value); backend.py turns them into LaunchError
STATUS_OOM = 1  # an on-chip buffer could not be allocated
STATUS_GRID = 2  # a grid dimension outside [0, MAX_GRID[d]] (the runtime checks first; this is the backstop)
STATUS_BOUNDS = 16  # + k: the k-th checked on-chip store was out of bounds

_CTYPE = {"float32": "float", "float64": "double", "int64": "int64_t", "int32": "int32_t", "int16": "int16_t",
          "int8": "int8_t", "uint8": "uint8_t", "bool": "uint8_t"}
_RAW = {"float16": "uint16_t", "bfloat16": "uint16_t", "float8_e4m3": "uint8_t", "float8_e5m2": "uint8_t"}
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3": "e4m3", "float8_e5m2": "e5m2"}


def ctype(dtype: str) -> str:
    """C type of a value (arithmetic) of `dtype`."""
    return _CTYPE[dt.compute_type(dtype)] if dtype not in ("int32", "int64") else "int64_t"


def storage_ctype(buf: Buffer) -> str:
    if buf.dtype in _RAW:
        return _RAW[buf.dtype] if buf.scope == "global" else "float"
    return _CTYPE[buf.dtype]


def float_literal(v: float, dtype: str) -> str:
    if math.isinf(v):
        lit = "INFINITY" if v > 0 else "-INFINITY"
        return lit if dtype != "float64" else f"((double){lit})"
    if math.isnan(v):
        return "NAN"
    if dtype == "float64":
        return float(v).hex()
    f32 = struct.unpack("f", struct.pack("f", float(np.float32(v))))[0]
    return f"{f32.hex()}f"


# the C runtime's own exp2 (vectorizable) and sigmoid; the rest are libm's (backends/cexpr.py)
_MATH = {**C_MATH, "exp2": ("tl_exp2f", "tl_exp2"), "sigmoid": ("tl_sigmoidf", "tl_sigmoid")}


class CCodegen(CExprEmitter):
    TARGET = "C"
    MATH = _MATH

    def __init__(self, func: PrimFunc) -> None:
        self.func = func
        self.lines: list[str] = []
        self.ind = 1

    # ------------------------------------------------------------ expressions

    def cast_to(self, e: Expr, dtype: str) -> str:
        code = self.expr(e)
        if dt.compute_type(e.dtype) == dt.compute_type(dtype) or (isinstance(e, Const) and e.weak):
            if isinstance(e, Const):
                return self.const(Const(e.value, dtype))
            return code
        return f"(({ctype(dtype)})({code}))"

    def const(self, e: Const) -> str:
        t = dt.compute_type(e.dtype)
        if e.dtype == "bool" or isinstance(e.value, bool):
            return "1" if e.value else "0"
        if dt.is_float(t):
            return float_literal(float(e.value), t)
        v = int(e.value)
        return f"{v}LL" if abs(v) > 2**31 - 1 else str(v)

    def index(self, buf: Buffer, idx: list[Expr]) -> str:
        if buf.scope == "var":
            return buf.name
        terms = []
        stride: list[str] = []
        for d in range(buf.ndim - 1, -1, -1):
            i = self.expr(idx[d])
            terms.append(f"({i})" + ("".join(f" * {s}" for s in stride)))
            stride.append(self.dim(buf.shape[d]))
        return f"{buf.name}[{' + '.join(reversed(terms))}]"

    def dim(self, s: Expr) -> str:
        return str(int(s.value)) if isinstance(s, Const) else f"(int64_t){s.name}"

    def load(self, e: Load) -> str:
        ref = self.index(e.buffer, e.indices)
        b = e.buffer
        if b.dtype in _RAW and b.scope == "global":
            return f"tl_{_SHORT[b.dtype]}_to_f32({ref})"
        return ref

    def value_ctype(self, dtype: str) -> str:
        return ctype(dtype)

    def round_to(self, dtype: str, code: str) -> str | None:
        return f"tl_round_{_SHORT[dtype]}((float)({code}))" if dtype in _RAW else None

    def minmax(self, op: str, dtype: str, a: str, b: str) -> str:
        return f"TL_{op.upper()}({a}, {b})"

    def int_divmod(self, e: BinOp, a: str, b: str) -> str:
        return f"tl_floor{'div' if e.op == '//' else 'mod'}({a}, {b})"

    def store_value(self, buf: Buffer, value: Expr) -> str:
        v = self.cast_to(value, buf.dtype) if buf.dtype not in _RAW else self.expr(value)
        if buf.dtype in _RAW:
            fn = f"tl_f32_to_{_SHORT[buf.dtype]}" if buf.scope == "global" else f"tl_round_{_SHORT[buf.dtype]}"
            return f"{fn}((float)({v}))"
        if buf.dtype == "bool":
            return f"(({v}) != 0)"
        if dt.is_int(buf.dtype) and dt.is_float(value.dtype):
            return f"(({_CTYPE[buf.dtype]})({v}))"
        return v

    # ------------------------------------------------------------ statements

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.ind + line)

    def stmt(self, s: Stmt) -> None:
        s.apply("cpu", self, "C codegen: {op} should have been lowered")

    # ------------------------------------------------------------ rules (the "cpu" table)

    def alloc(self, s: Alloc) -> None:
        if s.buffer.scope == "var":
            init = f" = {self.store_value(s.buffer, s.init)}" if s.init is not None else " = 0"
            self.emit(f"{storage_ctype(s.buffer)} {s.buffer.name}{init};")
        elif s.init is not None:
            n = int(np.prod(s.buffer.static_shape()))
            self.emit(f"for (int64_t _z = 0; _z < {n}; ++_z) {s.buffer.name}[_z] = "
                      f"{self.store_value(s.buffer, s.init)};")

    def for_(self, s: For) -> None:
        ann = s.annotations
        if ann.get("vectorize"):
            self.emit("#pragma omp simd")
        elif "reduction" in ann:
            acc, op = ann["reduction"]
            omp_op = {"+": "+", "max": "max", "min": "min"}[op]
            self.emit(f"#pragma omp simd reduction({omp_op}:{acc.name})")
        elif s.kind == "unroll":
            self.emit("#pragma GCC unroll 16")
        start, ext = self.expr(s.start), self.expr(s.extent)
        v = s.var.name
        lo = start
        hi = f"({start}) + ({ext})" if start != "0" else ext
        self.block(f"for (int64_t {v} = {lo}; {v} < {hi}; ++{v}) {{", s.body)

    def block(self, head: str, body: Stmt) -> None:
        self.emit(head)
        self.ind += 1
        self.stmt(body)
        self.ind -= 1
        self.emit("}")

    def let(self, s: Let) -> None:
        self.emit(f"const {ctype(s.var.dtype)} {s.var.name} = {self.expr(s.value)};")

    def store(self, s: Store) -> None:
        self.emit(f"{self.index(s.buffer, s.indices)} = {self.store_value(s.buffer, s.value)};")

    def while_(self, s: While) -> None:
        self.block(f"while ({self.expr(s.cond)}) {{", s.body)

    def if_(self, s: If) -> None:
        self.emit(f"if ({self.expr(s.cond)}) {{")
        self.ind += 1
        self.stmt(s.then)
        self.ind -= 1
        if s.orelse is not None:
            self.emit("} else {")
            self.ind += 1
            self.stmt(s.orelse)
            self.ind -= 1
        self.emit("}")

    def nested_kernel(self, s: Kernel) -> None:
        raise CompileError("nested T.Kernel", s.loc)

    def bounds_fail(self, s: BoundsFail) -> None:  # an on-chip store out of bounds: skipped, reported by the launch
        self.emit(f"__atomic_store_n(&_tl_status, {STATUS_BOUNDS + s.code}, __ATOMIC_RELAXED);")

    def _matrix(self, r: Region, transpose: bool) -> tuple[str, str, str]:
        """(pointer to the tile's first element, stride between rows, stride between cols) of the logical matrix."""
        buf = r.buffer
        strides = []
        acc = "1"
        for d in range(buf.ndim - 1, -1, -1):
            strides.insert(0, acc)
            acc = f"{acc} * {self.dim(buf.shape[d])}"
        rd, cd = r.matrix_dims()
        rs = strides[rd] if rd >= 0 else "0"
        cs = strides[cd] if cd >= 0 else "0"
        ptr = f"&{self.index(buf, r.starts)}"
        return (ptr, cs, rs) if transpose else (ptr, rs, cs)

    def gemm(self, s: Gemm) -> None:
        m, n = s.C.as_2d()
        k = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        a, sam, sak = self._matrix(s.A, s.transpose_A)
        b, sbk, sbn = self._matrix(s.B, s.transpose_B)
        c, scm, scn = self._matrix(s.C, False)
        self.emit(f"tl_gemm_f32({m}, {n}, {k}, {a}, {sam}, {sak}, {b}, {sbk}, {sbn}, {c}, {scm}, {scn}, "
                  f"{int(s.clear_accum)}, _tl_scratch);")
        if s.C.buffer.dtype in _RAW:  # low-precision accumulator: round once per gemm, as the interpreter does
            rs = _SHORT[s.C.buffer.dtype]
            self.emit(f"for (int _i = 0; _i < {m}; ++_i) for (int _j = 0; _j < {n}; ++_j) "
                      f"{{ float *_p = {c} + _i * {scm} + _j * {scn}; *_p = tl_round_{rs}(*_p); }}")

    def atomic_add(self, s: AtomicAdd) -> None:
        buf = s.dst.buffer
        ref = self.index(buf, s.dst.starts)
        val = self.expr(s.src)
        if buf.dtype in _RAW:
            rs = _SHORT[buf.dtype]
            conv = f"tl_f32_to_{rs}(tl_{rs}_to_f32({ref}) + (float)({val}))" if buf.scope == "global" else \
                f"tl_round_{rs}({ref} + (float)({val}))"
            self.emit("#pragma omp critical(tl_atomic)")
            self.emit(f"{ref} = {conv};")
        else:
            self.emit("#pragma omp atomic")
            self.emit(f"{ref} += ({_CTYPE[buf.dtype]})({val});")

    # ------------------------------------------------------------ function

    def generate(self, symbol: str) -> tuple[str, str]:
        f = self.func
        params = [f"{storage_ctype(p)} *{'' if getattr(p, 'aliased', False) else 'restrict '}{p.name}"
                  for p in f.params]  # views (T.Tensor(..., buf.data)) alias their tensor: no restrict
        params += [f"int64_t {v.name}" for v in f.dynamic_vars]
        sig = f"int {symbol}({', '.join(params) or 'void'})"
        cdef_params = [f"{storage_ctype(p)} *{p.name}" for p in f.params] + [f"int64_t {v.name}" for v in
                                                                            f.dynamic_vars]
        cdef = f"int {symbol}({', '.join(cdef_params) or 'void'});"
        kernels = [s for s in (f.body.body if isinstance(f.body, Seq) else [f.body])]
        self.lines.append(f"{sig} {{")
        self.lines.append("  int _tl_status = 0;  /* 1: out of memory, 2: bad grid, 16 + k: on-chip store k out of bounds */")
        for s in kernels:
            if isinstance(s, Kernel):  # one C block per T.Kernel: programs may launch several in sequence
                self.emit("{")
                self.ind += 1
                self.kernel(s)
                self.ind -= 1
                self.emit("}")
            else:
                self.stmt(s)
        self.lines.append("  return _tl_status;")
        self.lines.append("}")
        return "\n".join(self.lines) + "\n", cdef

    def kernel(self, k: Kernel) -> None:
        arrays = [s.buffer for s in walk_stmts(k.body) if isinstance(s, Alloc) and s.buffer.scope != "var"]
        scratch = 1
        for s in walk_stmts(k.body):
            if isinstance(s, Gemm):
                n = s.C.as_2d()[1]
                kk = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
                scratch = max(scratch, n * kk)
        grid = [self.expr(g) for g in k.grid]
        for i, g in enumerate(grid):
            self.emit(f"const int64_t _grid{i} = {g};")
        bad = " || ".join(f"_grid{i} < 0 || _grid{i} > {MAX_GRID[min(i, 2)]}LL" for i in range(len(grid)))
        self.emit(f"if ({bad}) return {STATUS_GRID};")
        swz = k.attrs.get("swizzle")
        total = " * ".join(f"_grid{i}" for i in range(len(grid)))
        # no more threads than blocks: a 1-block launch runs on the calling thread, no barrier to wait on
        self.emit(f"const int64_t _blocks = {total};")
        self.emit("const int _nthreads = (int)(_blocks < omp_get_max_threads() ? _blocks : omp_get_max_threads());")
        self.emit("#pragma omp parallel num_threads(_nthreads > 0 ? _nthreads : 1) if(_blocks > 1)")
        self.emit("{")
        self.ind += 1
        for b in arrays:
            n = int(np.prod(b.static_shape()))
            self.emit(f"{storage_ctype(b)} *restrict {b.name} = ({storage_ctype(b)} *)tl_alloc({n} * "
                      f"sizeof({storage_ctype(b)}));")
        self.emit(f"float *restrict _tl_scratch = (float *)tl_alloc({scratch} * sizeof(float));")
        ok = " && ".join([b.name for b in arrays] + ["_tl_scratch"])
        self.emit(f"const int _tl_ok = {ok} ? 1 : 0;")
        self.emit("if (!_tl_ok) {")
        self.emit("#pragma omp atomic write")
        self.emit("  _tl_status = 1;")
        self.emit("}")
        # grid dims iterate with the last one outermost so consecutive work items share row panels
        dims = list(range(len(grid)))[::-1]
        self.emit(f"#pragma omp for collapse({len(grid)}) schedule(dynamic, 1)")
        for d in dims:
            self.emit(f"for (int64_t _g{d} = 0; _g{d} < _grid{d}; ++_g{d}) {{")
            self.ind += 1
        self.emit("if (!_tl_ok) continue;")
        for d, v in enumerate(k.block_vars):
            self.emit(f"const int64_t {v.name} = _g{d};")
        if swz is not None and swz[2]:
            self.emit(f"/* T.use_swizzle(panel_size={swz[0]}, order={swz[1]!r}): rasterization hint, no effect on "
                      f"CPU */")
        self.stmt(k.body)
        for _ in dims:
            self.ind -= 1
            self.emit("}")
        for b in arrays:
            self.emit(f"free({b.name});")
        self.emit("free(_tl_scratch);")
        self.ind -= 1
        self.emit("}")


# what the C backend emits itself; the other tile ops were lowered to loops (backends/c/lower_tile_ops.py)
register_rules("cpu", {Seq: seq_rule, Alloc: CCodegen.alloc, For: CCodegen.for_, Let: CCodegen.let,
                       Store: CCodegen.store, While: CCodegen.while_, If: CCodegen.if_, Gemm: CCodegen.gemm,
                       AtomicAdd: CCodegen.atomic_add, Kernel: CCodegen.nested_kernel,
                       BoundsFail: CCodegen.bounds_fail})
