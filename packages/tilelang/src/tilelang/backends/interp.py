"""The reference interpreter (target "interp"): executes tile IR with numpy; the semantic oracle.

Thread blocks run one after another. A `T.Parallel` loop runs as numpy vector code: its loop
variable becomes an index array ("lanes") and the body is evaluated once for all iterations,
with `if` on lane-dependent conditions turned into masks. Arithmetic on 16/8-bit floats is done
in float32 and rounded when stored, as the compiled backends do. Loads past the end of a buffer
read zero (so `T.if_then_else` guards are safe); element stores past the end of a global tensor are
dropped (as on cpu), past the end of an on-chip buffer they raise.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import tilehal

from ..errors import CompileError
from ..ir import dtypes as dt
from ..ir.nodes import (
    FUNCTIONS,
    REDUCE_OPS,
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
    While,
    register_rules,
)
from ..ir.visit import seq_rule


def np_dtype(name: str) -> np.dtype:
    return tilehal.to_numpy_dtype(name)


def _compute(arr: np.ndarray, name: str) -> np.ndarray:
    ct = dt.compute_type(name)
    return arr.astype(np_dtype(ct)) if ct != name else arr


class Interpreter:
    def __init__(self, func: PrimFunc) -> None:
        self.func = func

    # ------------------------------------------------------------ entry

    def run(self, buffers: dict[Buffer, np.ndarray], dyn: dict[Var, int]) -> None:
        self.bufs: dict[Buffer, np.ndarray] = dict(buffers)
        self.env: dict[Var, Any] = dict(dyn)
        self.mask: np.ndarray | None = None
        self.lanes = 0
        with np.errstate(all="ignore"):
            self.stmt(self.func.body)

    # ------------------------------------------------------------ expressions

    def expr(self, e: Expr) -> Any:
        rule = e.rule("interp")
        if rule is None:
            raise CompileError(f"interp: unknown expression {type(e).__name__}")
        return rule(self, e)

    # ------------------------------------------------------------ expression rules (the "interp" table)

    def const(self, e: Const) -> Any:
        return np_dtype(dt.compute_type(e.dtype)).type(e.value)

    def var(self, e: Var) -> Any:
        try:
            return self.env[e]
        except KeyError:
            raise CompileError(f"interp: variable {e.name} is unbound") from None

    def load_expr(self, e: Load) -> Any:
        return self.load(e.buffer, [self.expr(i) for i in e.indices])

    def not_(self, e: Not) -> Any:
        return np.logical_not(self.expr(e.a))

    def cast(self, e: Cast) -> Any:
        v = np.asarray(self.expr(e.value))
        target = np_dtype(e.dtype)
        if dt.is_int(e.dtype) and v.dtype.kind == "f":
            v = np.trunc(v)
        out = v.astype(target)
        return _compute(out, e.dtype) if out.ndim else _compute(out, e.dtype)[()]

    def select(self, e: Select) -> Any:
        c = self.expr(e.cond)
        a, b = self.expr(e.a), self.expr(e.b)
        ty = np_dtype(e.dtype)
        return np.where(c, np.asarray(a, dtype=ty), np.asarray(b, dtype=ty))

    def binop(self, e: BinOp) -> Any:
        a, b = self.expr(e.a), self.expr(e.b)
        op = e.op
        if op in ("and", "or"):
            return np.logical_and(a, b) if op == "and" else np.logical_or(a, b)
        if op in ("<", "<=", ">", ">=", "==", "!="):
            return {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
                    "!=": np.not_equal}[op](a, b)
        ty = np_dtype(e.dtype)
        if dt.is_int(e.dtype):
            ty = np.dtype(np.int64)  # index arithmetic never overflows in practice; C uses 64-bit too
        a = np.asarray(a).astype(ty, copy=False)
        b = np.asarray(b).astype(ty, copy=False)
        if op == "+":
            r = a + b
        elif op == "-":
            r = a - b
        elif op == "*":
            r = a * b
        elif op == "/":
            r = a / b
        elif op == "//":
            r = np.floor_divide(a, b)
        elif op == "%":
            r = np.mod(a, b)
        elif op == "max":
            r = np.maximum(a, b)
        elif op == "min":
            r = np.minimum(a, b)
        elif op in ("&", "|", "^", "<<", ">>"):
            ty = np_dtype(e.dtype)  # bit operations act on the declared width (int8 >> 4 sign-extends from bit 7)
            a, b = np.asarray(a).astype(ty), np.asarray(b).astype(ty)
            r = {"&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor, "<<": np.left_shift,
                 ">>": np.right_shift}[op](a, b)
        else:
            raise CompileError(f"interp: unknown operator {op}")
        r = np.asarray(r).astype(ty, copy=False)
        return r if r.ndim else r[()]

    def call(self, e: Call) -> Any:
        ty = np_dtype(e.dtype)
        args = [np.asarray(self.expr(a)).astype(ty, copy=False) for a in e.args]
        fn = FUNCTIONS.get(e.fn)
        if fn is None:
            raise CompileError(f"interp: unknown function T.{e.fn}")
        r = np.asarray(fn.numpy(*args)).astype(ty, copy=False)
        return r if r.ndim else r[()]

    # ------------------------------------------------------------ memory

    def load(self, buf: Buffer, idx: list[Any]) -> Any:
        arr = self.bufs[buf]
        if all(np.ndim(i) == 0 for i in idx):
            t = tuple(int(i) for i in idx)
            if all(0 <= i < n for i, n in zip(t, arr.shape)):
                v = arr[t]
            else:
                v = arr.dtype.type(0)
            return _compute(np.asarray(v), buf.dtype)[()]
        bidx = np.broadcast_arrays(*[np.asarray(i, dtype=np.int64) for i in idx])
        valid = np.ones(bidx[0].shape, dtype=bool)
        clipped = []
        for i, n in zip(bidx, arr.shape):
            valid &= (i >= 0) & (i < n)
            clipped.append(np.clip(i, 0, max(n - 1, 0)))
        vals = arr[tuple(clipped)] if arr.size else np.zeros(bidx[0].shape, arr.dtype)
        vals = np.where(valid, vals, arr.dtype.type(0))
        return _compute(vals, buf.dtype)

    def store(self, buf: Buffer, idx: list[Any], value: Any, loc: Any = None) -> None:
        arr = self.bufs[buf]
        val = np.asarray(value)
        if self.mask is None and val.ndim == 0 and all(np.ndim(i) == 0 for i in idx):
            t = tuple(int(i) for i in idx)
            if buf.scope == "global" and not all(0 <= i < n for i, n in zip(t, arr.shape)):
                return  # dropped, as on cpu (guard_global_accesses)
            self._check_bounds(buf, [np.asarray(i) for i in t], arr.shape, loc)
            arr[t] = val.astype(arr.dtype)
            return
        parts = [np.asarray(i, dtype=np.int64) for i in idx] + [val]
        if self.mask is not None:
            parts.append(self.mask)
        b = np.broadcast_arrays(*parts)
        n = len(idx)
        sel = b[n + 1] if self.mask is not None else None
        ids = [x[sel] if sel is not None else x.ravel() for x in b[:n]]
        vals = b[n][sel] if sel is not None else b[n].ravel()
        if buf.scope == "global":  # out-of-bounds element stores to global tensors are dropped (as on cpu)
            ok = np.ones(vals.shape, dtype=bool)
            for i, n_ in zip(ids, arr.shape):
                ok &= (i >= 0) & (i < n_)
            if not ok.all():
                ids, vals = [i[ok] for i in ids], vals[ok]
        self._check_bounds(buf, ids, arr.shape, loc)
        arr[tuple(ids)] = vals.astype(arr.dtype)

    def _check_bounds(self, buf: Buffer, ids: list[np.ndarray], shape: tuple, loc: Any) -> None:
        for d, (i, n) in enumerate(zip(ids, shape)):
            if i.size and (i.min() < 0 or i.max() >= n):
                where = f"{loc}: " if loc else ""
                raise tilehal.LaunchError(f"{where}store to {buf.name}: index {d} out of bounds "
                                          f"(range [{i.min()}, {i.max()}], size {n})")

    def region_index(self, r: Region) -> tuple[list[np.ndarray], np.ndarray]:
        """Open-mesh indices of a tile and the mask of its in-bounds elements."""
        arr = self.bufs[r.buffer]
        starts = [self.expr(s) for s in r.starts]
        if any(np.ndim(s) for s in starts):
            raise CompileError("interp: tile ops inside T.Parallel loops are not supported", r.loc)
        axes = [int(s) + np.arange(n) for s, n in zip(starts, r.extents)]
        mesh = np.ix_(*axes)
        valid = np.ones(tuple(r.extents), dtype=bool)
        for m, n in zip(mesh, arr.shape):
            valid = valid & (m >= 0) & (m < n)
        return list(mesh), valid

    def read_region(self, r: Region) -> np.ndarray:
        """The tile's values in compute precision, squeezed to its non-unit extents; zero past the end."""
        arr = self.bufs[r.buffer]
        mesh, valid = self.region_index(r)
        clipped = tuple(np.clip(m, 0, max(n - 1, 0)) for m, n in zip(mesh, arr.shape))
        vals = np.where(valid, arr[clipped], arr.dtype.type(0))
        return _compute(vals, r.buffer.dtype).reshape(r.squeezed() or [1])

    def write_region(self, r: Region, values: np.ndarray) -> None:
        arr = self.bufs[r.buffer]
        mesh, valid = self.region_index(r)
        vals = np.broadcast_to(np.asarray(values).reshape(r.extents) if np.ndim(values) else values, r.extents)
        full = np.broadcast_arrays(*mesh)
        sel = tuple(m[valid] for m in full)
        arr[sel] = vals[valid].astype(arr.dtype)

    # ------------------------------------------------------------ statements

    def stmt(self, s: Stmt) -> None:
        s.apply("interp", self, "interp: unknown statement {op}")

    # ------------------------------------------------------------ rules (the "interp" table)

    def kernel(self, s: Kernel) -> None:
        grid = [int(self.expr(g)) for g in s.grid]
        for idx in itertools.product(*(range(n) for n in grid)):
            for v, i in zip(s.block_vars, idx):
                self.env[v] = i
            self.stmt(s.body)

    def alloc(self, s: Alloc) -> None:
        b = s.buffer
        arr = np.zeros(b.static_shape(), dtype=np_dtype(b.dtype))
        if s.init is not None:
            arr[...] = np.asarray(self.expr(s.init)).astype(arr.dtype)
        self.bufs[b] = arr

    def let(self, s: Let) -> None:
        self.env[s.var] = self.expr(s.value)

    def store_stmt(self, s: Store) -> None:
        self.store(s.buffer, [self.expr(i) for i in s.indices], self.expr(s.value), s.loc)

    def while_(self, s: While) -> None:
        while True:
            c = self.expr(s.cond)
            if np.ndim(c):
                raise CompileError("interp: a while condition that differs between T.Parallel lanes is not "
                                   "supported", s.loc)
            if not c:
                break
            self.stmt(s.body)

    def if_(self, s: If) -> None:
        c = self.expr(s.cond)
        if np.ndim(c) == 0:
            if c:
                self.stmt(s.then)
            elif s.orelse is not None:
                self.stmt(s.orelse)
        else:
            saved = self.mask
            base = np.asarray(c, dtype=bool) if saved is None else (saved & c)
            self.mask = base
            self.stmt(s.then)
            if s.orelse is not None:
                self.mask = ~np.asarray(c, dtype=bool) if saved is None else (saved & ~c)
                self.stmt(s.orelse)
            self.mask = saved

    def copy(self, s: Copy) -> None:
        self.write_region(s.dst, self.read_region(s.src).reshape(s.dst.squeezed() or [1]))

    def fill(self, s: Fill) -> None:
        ty = np_dtype(dt.compute_type(s.dst.buffer.dtype))
        self.write_region(s.dst, np.asarray(self.expr(s.value)).astype(ty))

    def cumsum(self, s: CumSum) -> None:
        src = _compute(self.bufs[s.src], s.src.dtype)
        x = np.flip(src, s.dim) if s.reverse else src
        r = np.cumsum(x, axis=s.dim, dtype=x.dtype)
        self.bufs[s.dst][...] = (np.flip(r, s.dim) if s.reverse else r).astype(self.bufs[s.dst].dtype)

    def atomic_add(self, s: AtomicAdd) -> None:
        if not isinstance(s.src, Region) and self.lanes:
            return self.atomic_add_lanes(s)
        if s.dst.buffer.scope != "global" and not s.dst.squeezed():  # an element add: checked like a store
            idx = [np.asarray(self.expr(st), dtype=np.int64).reshape(-1) for st in s.dst.starts]
            self._check_bounds(s.dst.buffer, idx, self.bufs[s.dst.buffer].shape, s.loc)
        cur = self.read_region(s.dst)
        add = self.read_region(s.src) if isinstance(s.src, Region) else np.asarray(self.expr(s.src))
        self.write_region(s.dst, (cur + add.reshape(cur.shape) if np.ndim(add) else cur + add))

    def atomic_add_lanes(self, s: AtomicAdd) -> None:
        """`T.atomic_add(dst[i, j], v)` inside T.Parallel: one add per active lane, in lane order when
        lanes hit the same element (each add rounds to the storage type, as the C backend does)."""
        arr = self.bufs[s.dst.buffer]
        parts = [np.asarray(self.expr(st), dtype=np.int64) for st in s.dst.starts] + [np.asarray(self.expr(s.src))]
        if self.mask is not None:
            parts.append(self.mask)
        b = np.broadcast_arrays(*parts)
        n = len(s.dst.starts)
        sel = b[n + 1] if self.mask is not None else np.ones(b[0].shape, dtype=bool)
        ids = [x[sel] for x in b[:n]]
        vals = b[n][sel].astype(np_dtype(dt.compute_type(s.dst.buffer.dtype)))
        if s.dst.buffer.scope == "global":  # out-of-bounds adds to a global tensor are dropped, like its stores
            ok = np.ones(vals.shape, dtype=bool)
            for i, n_ in zip(ids, arr.shape):
                ok &= (i >= 0) & (i < n_)
            if not ok.all():
                ids, vals = [i[ok] for i in ids], vals[ok]
        self._check_bounds(s.dst.buffer, ids, arr.shape, s.loc)
        flat = np.ravel_multi_index(ids, arr.shape) if ids[0].size else ids[0]
        if np.unique(flat).size == flat.size:
            cur = _compute(arr[tuple(ids)], s.dst.buffer.dtype)
            arr[tuple(ids)] = (cur + vals).astype(arr.dtype)
            return
        view = arr.reshape(-1)
        for f, v in zip(flat.tolist(), vals):
            view[f] = (_compute(view[f:f + 1], s.dst.buffer.dtype) + v).astype(arr.dtype)[0]

    def loop(self, s: For) -> None:
        start, extent = self.expr(s.start), self.expr(s.extent)
        if np.ndim(start) or np.ndim(extent):
            raise CompileError("interp: loop bounds that differ between T.Parallel lanes are not supported", s.loc)
        start, extent = int(start), int(extent)
        if s.kind != "parallel":
            for i in range(start, start + extent):
                self.env[s.var] = i
                self.stmt(s.body)
            self.env.pop(s.var, None)
            return
        saved_env, saved_mask = dict(self.env), self.mask
        for k, v in self.env.items():
            if isinstance(v, np.ndarray) and v.ndim == self.lanes:
                self.env[k] = v[..., None]
        if self.mask is not None:
            self.mask = self.mask[..., None]
        self.lanes += 1
        self.env[s.var] = (start + np.arange(extent, dtype=np.int64)).reshape((1,) * (self.lanes - 1) + (extent,))
        try:
            self.stmt(s.body)
        finally:
            self.lanes -= 1
            self.env, self.mask = saved_env, saved_mask

    def gemm(self, s: Gemm) -> None:
        acc_t = dt.compute_type(s.C.buffer.dtype)
        work = np.float64 if acc_t == "float64" else (np.int64 if dt.is_int(acc_t) else np.float32)
        a = self.read_region(s.A).reshape(s.A.as_2d()).astype(work)
        b = self.read_region(s.B).reshape(s.B.as_2d()).astype(work)
        if s.transpose_A:
            a = a.T
        if s.transpose_B:
            b = b.T
        prod = a @ b
        c = prod if s.clear_accum else self.read_region(s.C).reshape(prod.shape).astype(work) + prod
        self.write_region(s.C, c)

    def reduce(self, s: Reduce) -> None:
        src = _compute(self.bufs[s.src], s.src.dtype)
        op = REDUCE_OPS[s.kind][0]
        if s.kind.startswith("abs"):
            src = np.abs(src)
        r = np.sum(src, axis=s.dim, dtype=src.dtype) if op == "+" else {"max": np.max, "min": np.min}[op](src, axis=s.dim)
        dst = self.bufs[s.dst]
        r = r.reshape(dst.shape)
        if not s.clear:
            old = _compute(dst, s.dst.dtype)
            r = _COMBINE[REDUCE_OPS[s.kind][0]](old, r)
        dst[...] = r.astype(dst.dtype)


_COMBINE = {"+": np.add, "max": np.maximum, "min": np.minimum}  # REDUCE_OPS operators

register_rules("interp", {
    Const: Interpreter.const, Var: Interpreter.var, Load: Interpreter.load_expr, BinOp: Interpreter.binop,
    Not: Interpreter.not_, Cast: Interpreter.cast, Select: Interpreter.select, Call: Interpreter.call,
    Seq: seq_rule, Kernel: Interpreter.kernel, Alloc: Interpreter.alloc, For: Interpreter.loop,
    Let: Interpreter.let, Store: Interpreter.store_stmt, While: Interpreter.while_, If: Interpreter.if_,
    Copy: Interpreter.copy, Fill: Interpreter.fill, Gemm: Interpreter.gemm, Reduce: Interpreter.reduce,
    CumSum: Interpreter.cumsum, AtomicAdd: Interpreter.atomic_add,
})


class InterpKernel:
    """What the runtime calls for target "interp"."""

    def __init__(self, func: PrimFunc) -> None:
        self.func = func

    def source(self) -> str:
        return self.func.script()

    def __call__(self, arrays: list[np.ndarray], dyn: dict[Var, int]) -> None:
        Interpreter(self.func).run(dict(zip(self.func.params, arrays)), dyn)
