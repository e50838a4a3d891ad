"""The thread-level interpreter: runs a thread-level program (ir/thread.py) with the block's threads
as a numpy lane axis, so a lowering to threads is checked against the tile interpreter on the CPU.

Blocks run one after another. Inside a block every thread runs in lock-step: a value that differs
between threads is an array of shape (threads,), `T.get_thread_binding()` is `arange(threads)`, a
register buffer is an array (threads, nregs), shared and global memory are common to all lanes,
an `if` on a per-thread condition masks the lanes (as the tile interpreter's T.Parallel does). A
shuffle permutes lanes inside each warp; a barrier is a no-op in lock-step (checked to be reached
by all threads or none); a cp.async poisons its destination when issued (NaN for floats, all-ones
bits for integers, as cuda_emu does) and lands when the AsyncWait that retires its group runs, so a
missing wait reads poison. Lock-step lanes check index arithmetic, layouts and waits, not races
(cuda_emu keeps that job).

Rules live in the "thread.interp" table; a node without one runs its tile "interp" rule.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import tilehal

from ..errors import CompileError
from ..ir import dtypes as dt
from ..ir.layout import Fragment
from ..ir.nodes import Alloc, Buffer, Expr, For, Kernel, PrimFunc, Stmt, TileOp, Var, register_rules
from ..ir.thread import (
    INTRINSICS,
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
from .interp import Interpreter, _compute, np_dtype

WARP = 32


def _poison(arr: np.ndarray, ids: tuple) -> None:
    """Fill `arr[ids]` with all-ones bits (NaN for every float type, -1 for signed integers)."""
    bits = arr.view(np.dtype(f"u{arr.dtype.itemsize}"))
    bits[ids] = np.iinfo(bits.dtype).max


class ThreadInterpreter(Interpreter):
    # ------------------------------------------------------------ entry

    def run(self, buffers: dict[Buffer, np.ndarray], dyn: dict[Var, int]) -> None:
        self.threads = 0  # > 0 inside a kernel
        self.regs: set[Buffer] = set()
        self.in_uniform = 0
        self.open: list[tuple] = []  # cp.async copies issued since the last commit
        self.groups: list[list[tuple]] = []  # committed groups, oldest first
        self.breaks: list[np.ndarray] = []  # per enclosing ThreadFor: the lanes that left it
        self.wg_open: list[tuple] = []  # wgmma issued since the last commit: (accumulator, [(buffer, elements)])
        self.wg_groups: list[list[tuple]] = []  # committed wgmma groups still in flight, oldest first
        # shared-memory accesses since the last barrier, per buffer: (writer, reader) per element (see `track`)
        self.races: dict[Buffer, tuple[np.ndarray, np.ndarray]] = {}
        self.arena: np.ndarray | None = None  # the block's shared-memory bytes (thread programs of the CUDA lowering)
        self.arena_views: dict[Buffer, tuple[int, int]] = {}  # shared buffer -> (byte offset in the arena, itemsize)
        self.arena_key = Buffer("shared memory (bytes)", (), "uint8", "shared")  # the arena in `bufs` and `races`
        super().run(buffers, dyn)

    def expr(self, e: Expr) -> Any:
        rule = e.rule("thread.interp") or e.rule("interp")
        if rule is None:
            raise CompileError(f"thread interp: unknown expression {type(e).__name__}")
        return rule(self, e)

    def stmt(self, s: Stmt) -> None:
        rule = s.rule("thread.interp") or s.rule("interp")
        if rule is None:
            raise CompileError(f"thread interp: unknown statement {type(s).__name__}", s.loc)
        rule(self, s)

    def lanes_of(self, v: Any, dtype: Any = None) -> np.ndarray:
        """`v` (a scalar or a per-lane array) as an array of shape (threads,)."""
        a = np.asarray(v) if dtype is None else np.asarray(v, dtype=dtype)
        return np.broadcast_to(a, (self.threads,))

    def active(self) -> np.ndarray:
        return np.ones(self.threads, dtype=bool) if self.mask is None else self.lanes_of(self.mask, bool)

    # ------------------------------------------------------------ memory: registers get the lane index first

    def load(self, buf: Buffer, idx: list[Any]) -> Any:
        if buf in self.regs:
            self.wgmma_hazard(buf, None, "read", None)
            idx = [np.arange(self.threads, dtype=np.int64), *idx]
        elif buf.scope in ("shared", "global") and len(idx) == 1 and self.threads:
            self.track(buf, idx[0], False, None)
        return super().load(buf, idx)

    def store(self, buf: Buffer, idx: list[Any], value: Any, loc: Any = None) -> None:
        if buf in self.regs:
            self.wgmma_hazard(buf, None, "written", loc)
            idx = [np.arange(self.threads, dtype=np.int64), *idx]
        elif buf.scope in ("shared", "global") and len(idx) == 1 and self.threads:
            if buf.scope == "shared" and (self.wg_open or self.wg_groups):
                self.wgmma_hazard(buf, np.asarray(idx[0], dtype=np.int64).ravel(), "written", loc)
            self.track(buf, idx[0], True, loc, uniform_value=np.ndim(value) == 0, values=value)
        super().store(buf, idx, value, loc)

    def track(self, buf: Buffer, idx: Any, write: bool, loc: Any, lanes: np.ndarray | None = None,
              uniform_value: bool = False, values: Any = None) -> None:
        """Record the executing threads' accesses to elements `idx` of `buf` (shared memory, or a global tensor:
        within a block) since the last barrier and
        raise LaunchError on a race the lock-step lanes would hide: an element written by one thread and read
        or written by another with no __syncthreads() between. Per element: the writer (0 none, lane + 1, -1
        every thread stored one value: uniform code) and the reader (-1 none, a lane, -2 several). `idx`: a
        scalar (every executing thread: uniform code) or per lane (leading axis = threads); `lanes` (same
        shape as `idx`) names the threads when the access is not the executing lanes' (a cp.async landing).
        Several threads storing one value to one element (the replicas of a fragment) is no race.
        Shared buffers that are views of the block's arena are tracked by byte there, so two buffers the
        planner placed on the same bytes count as one memory."""
        view = self.arena_views.get(buf)
        if view is not None:
            off, isz = view
            i = np.asarray(idx, dtype=np.int64)
            if i.ndim == 0 and lanes is None:  # uniform code: byte by byte (each a scalar access)
                for k in range(isz):
                    self.track(self.arena_key, off + int(i) * isz + k, write, loc, None, uniform_value, None)
                return
            b = off + i[..., None] * isz + np.arange(isz)
            if lanes is not None:
                lanes = np.broadcast_to(np.asarray(lanes, dtype=np.int64)[..., None], b.shape)
            if values is not None:
                v = np.asarray(values)
                values = np.broadcast_to(v[..., None] if v.ndim else v, b.shape)
            return self.track(self.arena_key, b, write, loc, lanes, uniform_value, values)
        n = int(np.prod(self.bufs[buf].shape))
        st = self.races.get(buf)
        if st is None:
            st = self.races[buf] = (np.zeros(n, np.int64), np.full(n, -1, np.int64))
        wr, rd = st
        i = np.asarray(idx, dtype=np.int64)
        if lanes is not None:
            lane, elem = np.asarray(lanes, dtype=np.int64).ravel(), i.ravel()
        else:
            on = self.active()
            if i.ndim == 0:
                who = np.nonzero(on)[0]
                if who.size == 0:
                    return
                if who.size > 1 and (not write or uniform_value):  # uniform code: every thread, one value
                    if 0 <= i < n:
                        if write and (wr[i] > 0 or rd[i] >= 0 or rd[i] == -2):
                            self._race(buf, int(i), "stored by every thread after one thread accessed it", loc)
                        if not write and wr[i] > 0:
                            self._race(buf, int(i), f"read by every thread, written by thread {int(wr[i]) - 1}", loc)
                        if write:
                            wr[i] = -1
                        elif rd[i] != -2:
                            rd[i] = -2
                    return
                lane, elem = who, np.full(who.shape, int(i))
            else:
                if i.shape[0] != self.threads:
                    i = np.broadcast_to(i, (self.threads,) + i.shape)
                shape = (-1,) + (1,) * (i.ndim - 1)
                sel = np.broadcast_to(on.reshape(shape), i.shape)
                lane = np.broadcast_to(np.arange(self.threads).reshape(shape), i.shape)[sel]
                vals = np.broadcast_to(np.asarray(values), i.shape)[sel] if values is not None else None
                elem = i[sel]
        if lanes is not None or i.ndim == 0:
            vals = None
        ok = (elem >= 0) & (elem < n)  # out-of-bounds accesses report themselves
        lane, elem = lane[ok], elem[ok]
        if elem.size == 0:
            return
        pairs = np.unique(elem * self.threads + lane)
        e_u, n_lanes = np.unique(pairs // self.threads, return_counts=True)
        shared_here = e_u[n_lanes > 1]  # elements several threads touch in this one access
        w = wr[elem]
        if write:
            same = np.zeros(elem.shape, dtype=bool)
            if shared_here.size:
                if vals is None:
                    self._race(buf, int(shared_here[0]), "written by two threads at once", loc)
                multi = np.isin(elem, shared_here)
                v = np.asarray(vals)[ok][multi]
                order = np.argsort(elem[multi], kind="stable")
                es, vs = elem[multi][order], v[order]
                starts = np.r_[0, np.nonzero(np.diff(es))[0] + 1]
                differ = np.maximum.reduceat(vs, starts) != np.minimum.reduceat(vs, starts)
                if differ.any():
                    self._race(buf, int(es[starts[np.nonzero(differ)[0][0]]]), "written by two threads at once "
                                                                              "(different values)", loc)
                same = multi
            r = rd[elem]
            bad = ((w > 0) & (w != lane + 1)) | (w == -1) | ((r >= 0) & (r != lane)) | (r == -2)
            if bad.any():
                k = int(np.nonzero(bad)[0][0])
                other = int(w[k]) - 1 if w[k] > 0 else ("every thread" if w[k] == -1 else
                                                        (int(r[k]) if r[k] >= 0 else "several threads"))
                self._race(buf, int(elem[k]), f"written by thread {int(lane[k])} after {other} accessed it", loc)
            wr[elem] = np.where(same, -1, lane + 1)
        else:
            bad = (w > 0) & (w != lane + 1)
            if bad.any():
                k = int(np.nonzero(bad)[0][0])
                self._race(buf, int(elem[k]), f"read by thread {int(lane[k])}, written by thread {int(w[k]) - 1}", loc)
            r = rd[elem]
            rd[elem] = np.where((r == -1) | (r == lane), lane, -2)
            if shared_here.size:
                rd[shared_here] = -2

    def accessed(self, buf: Buffer, elems: np.ndarray) -> int | None:
        """An element of `elems` some thread accessed since the last barrier (None: none)."""
        view = self.arena_views.get(buf)
        key, idx = buf, np.asarray(elems, dtype=np.int64).ravel()
        if view is not None:
            key, idx = self.arena_key, (view[0] + idx[:, None] * view[1] + np.arange(view[1])).ravel()
        st = self.races.get(key)
        if st is None:
            return None
        hit = (st[0][idx] != 0) | (st[1][idx] != -1)
        return int(np.asarray(elems).ravel()[np.nonzero(hit)[0][0] // (view[1] if view else 1)]) if hit.any() else None

    def _race(self, buf: Buffer, elem: int, what: str, loc: Any) -> None:
        raise tilehal.LaunchError(f"{loc or ''}: shared {buf.name}[{elem}] {what} with no __syncthreads() between "
                                  f"(a race on the GPU)")

    def wgmma_hazard(self, buf: Buffer, elems: np.ndarray | None, what: str, loc: Any) -> None:
        """LaunchError when `buf` (its elements `elems`; None: the accumulator registers) is touched by
        ordinary code while a wgmma that uses it is in flight (issued, not yet retired by a wgmma_wait):
        the tensor cores read the operands and own the accumulators until then."""
        for acc, operands in self.wg_open + [op for g in self.wg_groups for op in g]:
            if elems is None and buf is acc:
                raise tilehal.LaunchError(f"{loc or ''}: accumulator {buf.name} {what} while a wgmma on it is in "
                                          f"flight (wgmma_wait first)")
            if elems is not None:
                for b, used in operands:
                    if b is buf and np.isin(elems, used).any():
                        raise tilehal.LaunchError(f"{loc or ''}: shared {buf.name} {what} while a wgmma reading it "
                                                  f"is in flight (the stage is refilled too early)")

    # ------------------------------------------------------------ rules (the "thread.interp" table)

    def kernel(self, s: Kernel) -> None:
        grid = [int(self.expr(g)) for g in s.grid]
        threads = int(np.prod(s.threads))
        for idx in itertools.product(*(range(n) for n in grid)):
            for v, i in zip(s.block_vars, idx):
                self.env[v] = i
            self.threads, self.open, self.groups = threads, [], []
            # the block's dynamic shared memory: garbage on the GPU, poison here (all-ones bytes: NaN, -1), so a read
            # before any write (a missing zero-initialization) shows
            arena = s.attrs.get("smem_arena_bytes")
            self.arena = np.full(int(arena), 0xFF, np.uint8) if arena is not None else None
            self.arena_views = {}
            if self.arena is not None:
                self.bufs[self.arena_key] = self.arena
            self.wg_open, self.wg_groups = [], []
            self.races = {}
            try:
                self.stmt(s.body)
            finally:
                self.threads = 0  # copies still in flight at the block's end never land (nothing reads them)

    def thread_idx(self, e: ThreadIdx) -> Any:
        if not self.threads:
            raise CompileError("thread interp: T.get_thread_binding() outside a kernel")
        if self.in_uniform:
            raise CompileError("thread interp: T.get_thread_binding() inside a T.uniform() region")
        return np.arange(self.threads, dtype=np.int64)

    def shuffle(self, e: Shuffle) -> Any:
        val = self.lanes_of(self.expr(e.value))
        arg = self.lanes_of(self.expr(e.lane), np.int64)
        lane = np.arange(self.threads, dtype=np.int64)
        seg, w = lane - lane % e.width, e.width
        pos = lane % w
        if e.kind == "xor":
            src = pos ^ arg
        elif e.kind == "down":
            src = np.where(pos + arg < w, pos + arg, pos)
        elif e.kind == "up":
            src = np.where(pos - arg >= 0, pos - arg, pos)
        else:  # idx
            src = arg % w
        src = seg + np.where((src >= 0) & (src < w), src, pos)
        if (src >= self.threads).any():
            raise tilehal.LaunchError(f"T.shfl_{e.kind}: a source lane past the block's {self.threads} threads "
                                      f"(a partial warp)")
        return val[src]

    def alloc(self, s: Alloc) -> None:
        if s.buffer.scope in ("fragment", "local"):
            raise CompileError(f"thread interp: {s.buffer.name} is alloc_{s.buffer.scope}; per-thread storage is "
                               f"T.alloc_reg", s.loc)
        off = s.options.get("arena_offset")
        if off is not None and self.arena is not None:  # a view of the block's shared-memory bytes
            t = np_dtype(s.buffer.dtype)
            nbytes = int(np.prod(s.buffer.static_shape())) * t.itemsize
            if off < 0 or off + nbytes > self.arena.size:
                raise tilehal.LaunchError(f"{s.loc or ''}: shared {s.buffer.name} at bytes [{off}, {off + nbytes}) "
                                          f"outside the kernel's {self.arena.size} bytes of shared memory")
            self.bufs[s.buffer] = self.arena[off:off + nbytes].view(t)
            self.arena_views[s.buffer] = (int(off), t.itemsize)
            return
        super().alloc(s)

    def reg_buffer(self, s: RegBuffer) -> None:
        regs = np.zeros((self.threads, s.nregs), dtype=np_dtype(s.buffer.dtype))
        if s.init is not None:
            regs[...] = np.asarray(self.lanes_of(self.expr(s.init)))[:, None]
        self.bufs[s.buffer] = regs
        self.regs.add(s.buffer)

    def barrier(self, s: Barrier) -> None:
        self.races = {}
        arrived = self.active()
        if arrived.any() and not arrived.all():
            raise tilehal.LaunchError(f"{s.loc or ''}: T.sync_threads() reached by {int(arrived.sum())} of "
                                      f"{self.threads} threads (the others never arrive)")

    def async_copy(self, s: AsyncCopy) -> None:
        dst, src = self.bufs[s.dst], self.bufs[s.src]
        on = self.active()
        if s.pred is not None:
            pred = self.lanes_of(self.expr(s.pred), bool)
        else:
            pred = np.ones(self.threads, dtype=bool)
        k = np.arange(s.n, dtype=np.int64)

        def elems(idx: list[Expr]) -> list[np.ndarray]:
            lanes = [self.lanes_of(self.expr(i), np.int64)[:, None] for i in idx]
            lanes[-1] = lanes[-1] + k
            return [np.broadcast_to(x, (self.threads, s.n)) for x in lanes]

        d_idx, s_idx = elems(s.dst_idx), elems(s.src_idx)
        d_sel = [x[on] for x in d_idx]
        s_sel = [x[on & pred] for x in s_idx]
        self._check_bounds(s.dst, d_sel, dst.shape, s.loc)
        for d, (i, n) in enumerate(zip(s_sel, src.shape)):
            if i.size and (i.min() < 0 or i.max() >= n):
                raise tilehal.LaunchError(f"{s.loc or ''}: T.cp_async from {s.src.name}: index {d} out of bounds "
                                          f"(range [{i.min()}, {i.max()}], size {n})")
        item = dst.dtype.itemsize
        for name, arr, sel in ((s.dst.name, dst, d_sel), (s.src.name, src, s_sel)):
            if sel[0].size:
                off = np.ravel_multi_index([x[:, 0] for x in sel], arr.shape) * item
                if (off % s.nbytes).any():
                    raise tilehal.LaunchError(f"{s.loc or ''}: T.cp_async of {s.nbytes} bytes: {name} address not "
                                              f"{s.nbytes}-byte aligned (byte offset {int(off[off % s.nbytes][0])})")
        if len(d_sel) == 1:
            self.wgmma_hazard(s.dst, d_sel[0].ravel(), "overwritten by cp.async", s.loc)
        _poison(dst, tuple(d_sel))
        self.open.append((s.dst, d_idx, s.src, s_idx, on, pred))

    def async_commit(self, s: AsyncCommit) -> None:
        self.groups.append(self.open)
        self.open = []

    def async_wait(self, s: AsyncWait) -> None:
        while len(self.groups) > s.n:
            for dbuf, d_idx, sbuf, s_idx, on, pred in self.groups.pop(0):
                dst, src = self.bufs[dbuf], self.bufs[sbuf]
                got = on & pred
                dst[tuple(x[got] for x in d_idx)] = src[tuple(x[got] for x in s_idx)]
                zero = on & ~pred
                dst[tuple(x[zero] for x in d_idx)] = 0
                if len(d_idx) == 1 and dbuf.scope == "shared":  # the issuing thread's bytes, once landed
                    lanes = np.broadcast_to(np.arange(self.threads)[:, None], d_idx[0].shape)
                    self.track(dbuf, d_idx[0][on], True, s.loc, lanes=lanes[on])

    def intrinsic(self, s: Intrinsic) -> None:
        fn = _INTRINSIC_RULES.get(s.name)
        if fn is None or s.name not in INTRINSICS:
            raise CompileError(f"thread interp: intrinsic {s.name!r} has no interpretation", s.loc)
        outs = fn(self, [self.expr(i) for i in s.ins], s)
        for o, v in zip(s.outs, outs):
            self.store(o.buffer, [self.expr(i) for i in o.indices], v, s.loc)

    def thread_for(self, s: ThreadFor) -> None:
        saved = self.mask
        self.breaks.append(np.zeros(self.threads, dtype=bool))
        try:
            for j in range(s.trips):
                self.env[s.var] = j
                left = ~self.breaks[-1]
                if not left.any():
                    break
                self.mask = left if saved is None else self.lanes_of(saved, bool) & left
                self.stmt(s.body)
        finally:
            self.breaks.pop()
            self.mask = saved
        self.env.pop(s.var, None)

    def break_if(self, s: BreakIf) -> None:
        if not self.breaks:
            raise CompileError("thread interp: a break outside T.thread_for", s.loc)
        leave = self.active() & self.lanes_of(self.expr(s.cond), bool)
        self.breaks[-1] |= leave
        self.mask = self.active() & ~leave

    def strided_for(self, s: StridedFor) -> None:
        saved = self.mask
        start = self.lanes_of(self.expr(s.start), np.int64)
        stop = self.lanes_of(self.expr(s.stop), np.int64)
        try:
            i = 0
            while True:
                v = start + i * s.step
                on = (v < stop) & (np.ones(self.threads, dtype=bool) if saved is None else self.lanes_of(saved, bool))
                if not on.any():
                    break
                self.env[s.var] = v
                self.mask = on
                self.stmt(s.body)
                i += 1
        finally:
            self.mask = saved
        self.env.pop(s.var, None)

    def scope(self, s: Scope) -> None:
        """Names declared inside end with the scope (a C block): a Let that shadows an outer variable
        (a pipeline prologue's copy of the loop variable) does not leak out."""
        saved = dict(self.env)
        try:
            self.stmt(s.body)
        finally:
            self.env.clear()
            self.env.update(saved)

    def uniform(self, s: Uniform) -> None:
        self.in_uniform += 1
        try:
            self.stmt(s.body)
        finally:
            self.in_uniform -= 1

    def loop(self, s: For) -> None:
        if s.kind not in ("serial", "unroll"):
            raise CompileError(f"thread interp: T.{s.kind} loop in a thread-level program (lower it first)", s.loc)
        super().loop(s)

    def tile_op(self, s: TileOp) -> None:
        raise CompileError(f"thread interp: tile op {type(s).__name__} in a thread-level program (lower it first)",
                           s.loc)


def _fma(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
    a, b, c = (np.asarray(x, dtype=np.float64) for x in ins)
    # fp32 operands: the product is exact in float64 and the sum rounds there, then to float32 (the same
    # as __fmaf_rn's single rounding but for rare double-rounding ties)
    return [(a * b + c).astype(np.float32)]


def _cvt(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
    to = dt.canonical(s.attrs["dtype"])
    v = np.asarray(ins[0])
    if dt.is_int(to) and v.dtype.kind == "f":
        v = np.rint(v)  # cvt.rni
    return [_compute(v.astype(np_dtype(to)), to)]


def _whole_warps(it: ThreadInterpreter, s: Intrinsic) -> None:
    """A warp-collective instruction needs every lane of every warp (lock-step, no divergence)."""
    if it.threads % WARP or not it.active().all():
        raise tilehal.LaunchError(f"{s.loc or ''}: {s.name} reached by {int(it.active().sum())} of {it.threads} "
                                  f"threads: it needs every lane of each warp")


def _bits(v: Any, dtype: str) -> np.ndarray:
    """The storage bits of per-lane values of `dtype` (compute type in, unsigned ints of its width out)."""
    a = np.asarray(v).astype(np_dtype(dtype))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Elements of `dtype` from their storage bits, in the compute type."""
    t = np_dtype(dtype)
    return _compute(np.ascontiguousarray(bits).view(t), dtype)


def _ldmatrix(trans: bool):
    def rule(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
        _whole_warps(it, s)
        ref = s.ins[0]
        mem = it.bufs[ref.buffer]
        byte = mem.view(np.uint8)
        off = it.lanes_of(it.expr(ref.indices[0]), np.int64) * mem.dtype.itemsize  # each lane's row address
        if (off % 16).any():
            raise tilehal.LaunchError(f"{s.loc or ''}: {s.name}: a row address of {ref.buffer.name} is not 16-byte "
                                      f"aligned (byte offset {int(off[off % 16 != 0][0])})")
        if off.min() < 0 or off.max() + 16 > byte.size:
            raise tilehal.LaunchError(f"{s.loc or ''}: {s.name}: row address outside {ref.buffer.name}")
        rows = byte[off[:, None] + np.arange(16)].reshape(-1, 4, 8, 8, 2)  # (warps, matrix, row, b16 unit, byte)
        per = 16 // mem.dtype.itemsize
        elems = off[:, None] // mem.dtype.itemsize + np.arange(per)
        it.track(ref.buffer, elems, False, s.loc, lanes=np.broadcast_to(np.arange(it.threads)[:, None], elems.shape))
        lane = np.arange(WARP)
        g, t = lane // 4, lane % 4
        out = []
        for i in range(4):
            m = rows[:, i]  # (warps, 8 rows, 8 units, 2 bytes)
            if not trans:
                pair = np.stack([m[:, g, 2 * t], m[:, g, 2 * t + 1]], axis=2)  # (warps, lane, 2 units, 2 bytes)
            else:
                pair = np.stack([m[:, 2 * t, g], m[:, 2 * t + 1, g]], axis=2)
            out.append(np.ascontiguousarray(pair).reshape(-1, 4).view(np.uint32).reshape(-1))
        return out

    return rule


def _mma(k: int):
    def rule(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
        _whole_warps(it, s)
        dtype = dt.canonical(s.attrs["dtype"])
        per = 4 // np_dtype(dtype).itemsize  # elements per 32-bit register: 2 (16-bit) or 4 (8-bit)
        nw = it.threads // WARP

        def regs(vals: list[Any]) -> np.ndarray:  # (warps, lane, reg, element) in the compute type
            words = np.stack([it.lanes_of(v).astype(np.uint32) for v in vals], axis=1)
            return _values(words.view(np.uint8).reshape(len(words), -1), dtype).reshape(nw, WARP, len(vals), per)

        a, b = regs(ins[0:4]), regs(ins[4:6])
        lane = np.arange(WARP)
        g, t = lane // 4, lane % 4
        A = np.zeros((nw, 16, k), np.float64)
        Bm = np.zeros((nw, k, 8), np.float64)
        half = k // 2
        for r, (row0, col0) in enumerate(((0, 0), (8, 0), (0, half), (8, half))):
            for e in range(per):
                A[:, g + row0, col0 + per * t + e] = a[:, :, r, e]
        for r, k0 in enumerate((0, half)):
            for e in range(per):
                Bm[:, k0 + per * t + e, g] = b[:, :, r, e]
        D = A @ Bm  # exact: products of 16/8-bit values and their sums fit fp64 (rounding to fp32 once)
        c = np.stack([it.lanes_of(v) for v in ins[6:10]], axis=1).reshape(nw, WARP, 4)
        acc_int = np.asarray(ins[6]).dtype.kind in "iu"
        out = []
        for r, (row0, col) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
            d = D[:, g + row0, 2 * t + col]
            val = c[:, :, r].astype(np.float64) + d
            out.append(val.astype(np.int32 if acc_int else np.float32).reshape(-1))
        return out

    return rule


def _wgmma_commit(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
    it.wg_groups.append(it.wg_open)
    it.wg_open = []
    return []


def _wgmma_wait(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
    while len(it.wg_groups) > int(s.attrs["n"]):
        it.wg_groups.pop(0)
    return []


def _pack2_bits(it: ThreadInterpreter, ins: list[Any], s: Intrinsic) -> list[Any]:
    dtype = dt.canonical(s.attrs["dtype"])
    lo, hi = (_bits(it.lanes_of(v), dtype).astype(np.uint32) for v in ins)
    return [lo | (hi << 16)]


_INTRINSIC_RULES = {"fma": _fma, "cvt": _cvt, "fence_proxy_async": lambda it, ins, s: [],
                    "ldmatrix_x4": _ldmatrix(False), "ldmatrix_x4_trans": _ldmatrix(True),
                    "mma_m16n8k16": _mma(16), "mma_m16n8k32": _mma(32),
                    "pack2_bits": _pack2_bits, "wgmma_fence": lambda it, ins, s: [], "wgmma_commit": _wgmma_commit,
                    "wgmma_wait": _wgmma_wait, "wgmma_fence_operands": lambda it, ins, s: []}
# (one per INTRINSICS entry; the wgmma instruction itself is the Wgmma node of backends/cuda/emit.py)

register_rules("thread.interp", {
    Kernel: ThreadInterpreter.kernel, ThreadIdx: ThreadInterpreter.thread_idx, Shuffle: ThreadInterpreter.shuffle,
    Alloc: ThreadInterpreter.alloc, RegBuffer: ThreadInterpreter.reg_buffer, Barrier: ThreadInterpreter.barrier,
    AsyncCopy: ThreadInterpreter.async_copy, AsyncCommit: ThreadInterpreter.async_commit,
    AsyncWait: ThreadInterpreter.async_wait, Intrinsic: ThreadInterpreter.intrinsic,
    ThreadFor: ThreadInterpreter.thread_for, Uniform: ThreadInterpreter.uniform, For: ThreadInterpreter.loop,
    Scope: ThreadInterpreter.scope, StridedFor: ThreadInterpreter.strided_for, BreakIf: ThreadInterpreter.break_if,
    TileOp: ThreadInterpreter.tile_op,
})


def fragment_indices(frag: Fragment) -> np.ndarray:
    """(threads, nregs, ndim) int64: the tile index that each thread's register holds under `frag`
    (entries past the tile's shape are padding)."""
    tx = np.arange(frag.threads, dtype=np.int64)[:, None]
    reg = np.arange(frag.nregs, dtype=np.int64)[None, :]
    out = np.zeros((frag.threads, frag.nregs, len(frag.shape)), dtype=np.int64)
    for d, axes in enumerate(frag.dims):
        for a in axes:
            v = (tx // a.tstride) % a.extent if a.kind == "t" else (reg // frag.reg_stride(d, a)) % a.extent
            out[:, :, d] += v * a.coeff
    return out


def tile_of_registers(regs: np.ndarray, frag: Fragment) -> np.ndarray:
    """The tile that register arrays (threads, nregs) hold under `frag`; LaunchError when two
    replicas of an element differ or an element of the tile is held by no thread."""
    idx = fragment_indices(frag)
    inside = np.all(idx < np.asarray(frag.shape), axis=-1)
    where, vals = idx[inside], regs[inside]
    tile = np.zeros(frag.shape, dtype=regs.dtype)
    tile[tuple(where.T)] = vals
    seen = np.zeros(frag.shape, dtype=bool)
    seen[tuple(where.T)] = True
    if not seen.all():
        raise tilehal.LaunchError(f"{frag!r}: {int((~seen).sum())} tile elements held by no thread")
    same = (tile[tuple(where.T)] == vals) | (np.isnan(vals) if vals.dtype.kind == "f" else False)
    if not same.all():
        raise tilehal.LaunchError(f"{frag!r}: replicas of an element hold different values")
    return tile


def run_thread(func: PrimFunc, arrays: list[np.ndarray], dyn: dict[Var, int] | None = None) -> None:
    """Run thread-level `func` on numpy `arrays` (its params, in order; written in place)."""
    ThreadInterpreter(func).run(dict(zip(func.params, arrays)), dict(dyn or {}))
