"""Lower tile ops to loop nests (for the C backend).

copy/fill/reduce/cumsum/atomic_add become T.Parallel loops; accesses to buffers whose bounds
are not statically satisfied get guards (zero on read, skip on write) behind a single
"whole tile in bounds" test, so full tiles run the guard-free, vectorizable loop. gemm with a
float32-storage accumulator stays a tile op (the C backend calls its micro-kernel); other
gemms (int8 -> int32, float64) become loops.
"""

from __future__ import annotations

import itertools
import logging

from ...ir import dtypes as dt
from ...ir.nodes import (
    REDUCE_OPS,
    Alloc,
    AtomicAdd,
    Buffer,
    Const,
    Copy,
    CumSum,
    Expr,
    Fill,
    For,
    Gemm,
    If,
    Load,
    PrimFunc,
    Reduce,
    Region,
    Select,
    Seq,
    Stmt,
    Store,
    Var,
    binop,
    const,
    register_rules,
)
from ...ir.visit import map_stmt
from ...passes.simplify import simplify_expr
from .guard_memory import LOCAL_SCOPES

_ids = itertools.count()
log = logging.getLogger("tilelang.passes.lower_tile_ops")


def _var(base: str) -> Var:
    return Var(f"_{base}{next(_ids)}")


def _region_index(r: Region, vars_: list[Var]) -> list[Expr]:
    """Buffer indices of a tile element, the non-unit dims taking `vars_` in order."""
    it = iter(vars_)
    return [binop("+", s, next(it)) if n != 1 else s for s, n in zip(r.starts, r.extents)]


def _in_bounds(buf: Buffer, idx: list[Expr]) -> Expr:
    cond: Expr = Const(True, "bool")
    for i, n in zip(idx, buf.shape):
        cond = binop("and", cond, binop("and", binop(">=", i, 0), binop("<", i, n)))
    return simplify_expr(cond)


def _tile_in_bounds(r: Region) -> Expr:
    cond: Expr = Const(True, "bool")
    for s, n, size in zip(r.starts, r.extents, r.buffer.shape):
        cond = binop("and", cond, binop("and", binop(">=", s, 0), binop("<=", binop("+", s, n), size)))
    return simplify_expr(cond)


def _needs_guard(r: Region) -> bool:
    return not (isinstance(_tile_in_bounds(r), Const) and _tile_in_bounds(r).value)


def _loops(vars_: list[Var], extents: list[int], body: Stmt, loc, kind: str = "parallel") -> Stmt:
    for v, n in reversed(list(zip(vars_, extents))):
        body = For(v, const(0), const(n), kind, body, loc=loc)
    return body


def lower_copy(s: Copy) -> Stmt:
    shape = s.dst.squeezed() or [1]
    vars_ = [_var("i") for _ in shape]
    src_ext = s.src.squeezed()
    sv = vars_ if src_ext else []
    dv = vars_ if s.dst.squeezed() else []
    sidx, didx = _region_index(s.src, sv), _region_index(s.dst, dv)

    def body(guarded: bool) -> Stmt:
        val: Expr = Load(s.src.buffer, sidx)
        if guarded and _needs_guard(s.src):
            val = Select(_in_bounds(s.src.buffer, sidx), val, const(0), val.dtype)
        st: Stmt = Store(s.dst.buffer, didx, val, loc=s.loc)
        if guarded and _needs_guard(s.dst):
            st = If(_in_bounds(s.dst.buffer, didx), st, loc=s.loc)
        return st

    fast = _loops(vars_, shape, body(False), s.loc)
    if not (_needs_guard(s.src) or _needs_guard(s.dst)):
        return fast
    cond = binop("and", _tile_in_bounds(s.src), _tile_in_bounds(s.dst))
    return If(simplify_expr(cond), fast, _loops(vars_, shape, body(True), s.loc), loc=s.loc)


def lower_fill(s: Fill) -> Stmt:
    shape = s.dst.squeezed() or [1]
    vars_ = [_var("i") for _ in shape]
    idx = _region_index(s.dst, vars_ if s.dst.squeezed() else [])
    st: Stmt = Store(s.dst.buffer, idx, s.value, loc=s.loc)
    if _needs_guard(s.dst):
        st = If(_in_bounds(s.dst.buffer, idx), st, loc=s.loc)
    return _loops(vars_, shape, st, s.loc)


_INIT = {k: init for k, (_, init) in REDUCE_OPS.items()}


def _acc_buffer(dtype: str) -> Buffer:
    return Buffer(f"_acc{next(_ids)}", (const(1),), dtype, "var")


def lower_reduce(s: Reduce) -> Stmt:
    sshape = s.src.static_shape()
    kept = [n for d, n in enumerate(sshape) if d != s.dim]
    vars_ = [_var("i") for _ in kept]
    k = _var("k")
    src_idx = list(vars_)
    src_idx.insert(s.dim, k)
    dst_idx: list[Expr] = list(vars_)
    if s.dst.ndim == s.src.ndim:
        dst_idx.insert(s.dim, const(0))
    elif not dst_idx:
        dst_idx = [const(0)]
    acc_t = dt.compute_type(s.dst.dtype)
    acc = _acc_buffer(acc_t)
    a0 = [const(0)]
    init = _INIT[s.kind]
    if dt.is_int(acc_t) and init in (float("inf"), float("-inf")):
        import numpy as np

        info = np.iinfo(np.dtype(acc_t))
        init = int(info.max if init > 0 else info.min)
    x: Expr = Load(s.src, src_idx)
    if s.kind in ("abssum", "absmax"):
        from ...ir.nodes import Call

        x = Call("abs", [x], x.dtype)
    op = REDUCE_OPS[s.kind][0]
    start = Const(init, acc_t) if s.clear else Load(s.dst, dst_idx)
    inner = For(k, const(0), const(sshape[s.dim]), "serial",
                Store(acc, a0, binop(op, Load(acc, a0), x), loc=s.loc), {"reduction": (acc, op)}, loc=s.loc)
    if not s.clear:
        # combine the old value last, as the interpreter does: op(dst, reduce(src))
        inner_init = Const(_INIT[s.kind] if not dt.is_int(acc_t) else 0, acc_t)
        body = Seq([Alloc(acc, inner_init, loc=s.loc), inner,
                    Store(s.dst, dst_idx, binop(op, start, Load(acc, a0)), loc=s.loc)])
    else:
        body = Seq([Alloc(acc, start, loc=s.loc), inner, Store(s.dst, dst_idx, Load(acc, a0), loc=s.loc)])
    return _loops(vars_, kept, body, s.loc) if kept else body


def lower_cumsum(s: CumSum) -> Stmt:
    shape = s.src.static_shape()
    kept = [n for d, n in enumerate(shape) if d != s.dim]
    vars_ = [_var("i") for _ in kept]
    k = _var("k")
    n = shape[s.dim]
    kk: Expr = binop("-", n - 1, k) if s.reverse else k
    idx = list(vars_)
    idx.insert(s.dim, kk)
    acc = _acc_buffer(dt.compute_type(s.dst.dtype))
    a0 = [const(0)]
    inner = For(k, const(0), const(n), "serial", Seq([
        Store(acc, a0, binop("+", Load(acc, a0), Load(s.src, idx)), loc=s.loc),
        Store(s.dst, idx, Load(acc, a0), loc=s.loc)]), loc=s.loc)
    body = Seq([Alloc(acc, Const(0, acc.dtype), loc=s.loc), inner])
    return _loops(vars_, kept, body, s.loc) if kept else body


def lower_atomic_add(s: AtomicAdd) -> Stmt:
    """Element adds past the end of a global tensor are dropped (like its stores); those past the
    end of an on-chip buffer are left to check_local_accesses (they raise LaunchError, as stores
    do). A tile add (several elements) drops its out-of-bounds edge elements, as T.copy does."""
    shape = s.dst.squeezed() or [1]
    element = not s.dst.squeezed()
    on_chip = s.dst.buffer.scope in LOCAL_SCOPES
    if not isinstance(s.src, Region):
        if on_chip or not _needs_guard(s.dst):
            return s
        return If(_in_bounds(s.dst.buffer, s.dst.starts), s, loc=s.loc)
    vars_ = [_var("i") for _ in shape]
    didx = _region_index(s.dst, vars_ if s.dst.squeezed() else [])
    sidx = _region_index(s.src, vars_ if s.src.squeezed() else [])
    val: Expr = Load(s.src.buffer, sidx)
    if _needs_guard(s.src):
        val = Select(_in_bounds(s.src.buffer, sidx), val, const(0), val.dtype)
    st: Stmt = AtomicAdd(Region(s.dst.buffer, didx, [1] * s.dst.buffer.ndim, s.loc), val, dict(s.options),
                         loc=s.loc)
    if _needs_guard(s.dst) and not (element and on_chip):
        st = If(_in_bounds(s.dst.buffer, didx), st, loc=s.loc)
    return _loops(vars_, shape, st, s.loc)


def gemm_uses_microkernel(s: Gemm) -> bool:
    """float32-storage operands in C: float32, and 16/8-bit floats (held as float in local buffers)."""
    return all(dt.compute_type(r.buffer.dtype) == "float32" for r in (s.A, s.B, s.C))


def lower_gemm_to_loops(s: Gemm) -> Stmt:
    m, n = s.C.as_2d()
    kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
    i, j, k = _var("i"), _var("j"), _var("k")

    def at(r: Region, row: Expr, col: Expr) -> Load:
        rd, cd = r.matrix_dims()
        idx = list(r.starts)
        if rd >= 0:
            idx[rd] = binop("+", idx[rd], row)
        if cd >= 0:
            idx[cd] = binop("+", idx[cd], col)
        return Load(r.buffer, idx)

    a = at(s.A, k, i) if s.transpose_A else at(s.A, i, k)
    b = at(s.B, j, k) if s.transpose_B else at(s.B, k, j)
    c = at(s.C, i, j)
    acc_t = dt.compute_type(s.C.buffer.dtype)
    acc = _acc_buffer(acc_t)
    a0 = [const(0)]
    from ...ir.nodes import Cast

    prod = binop("*", Cast(a, acc_t), Cast(b, acc_t))
    inner = For(k, const(0), const(kdim), "serial", Store(acc, a0, binop("+", Load(acc, a0), prod), loc=s.loc),
                {"reduction": (acc, "+")}, loc=s.loc)
    start = Const(0, acc_t) if s.clear_accum else c
    body = Seq([Alloc(acc, start, loc=s.loc), inner, Store(s.C.buffer, c.indices, Load(acc, a0), loc=s.loc)])
    return _loops([i, j], [m, n], body, s.loc)


def lower_gemm(s: Gemm) -> Stmt:
    if gemm_uses_microkernel(s):
        return s  # the C backend calls its micro-kernel
    log.debug("%s: T.gemm with dtypes %s/%s -> %s has no micro-kernel (float32 storage only); lowered to "
              "loops", s.loc, s.A.buffer.dtype, s.B.buffer.dtype, s.C.buffer.dtype)
    return lower_gemm_to_loops(s)


# the cpu target's lowering of each tile op (statement -> statement); ops without one stay as they are
register_rules("cpu.lower", {Copy: lower_copy, Fill: lower_fill, Reduce: lower_reduce, CumSum: lower_cumsum,
                             AtomicAdd: lower_atomic_add, Gemm: lower_gemm})


def lower_tile_ops(func: PrimFunc) -> PrimFunc:
    def rewrite(s: Stmt) -> Stmt:
        rule = s.rule("cpu.lower")
        return rule(s) if rule is not None else s

    body = map_stmt(func.body, rewrite) or Seq([])
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source)
