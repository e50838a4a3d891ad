"""Thread-level IR: what one CUDA thread of a block does, explicitly (issue 14 item 2, step 1 of the
plan in docs/tilelang.md).

A thread-level program is ordinary IR (Kernel, Alloc of shared buffers, For / If / Let / Store /
Load on buffers) plus the nodes here: the thread index, per-thread registers, barriers, cp.async
copies with their commit / wait groups, warp shuffles, intrinsics, the constant-trip per-thread
loop and block-uniform regions. It holds no tile ops: those are lowered into it (step 2).

Each class is `Ruled` like the tile ops: its structure (children / exprs / reads / writes /
rebuild) lives here; its rules live where the tables are: "print" in ir/printer.py, "verify" and
"thread.verify" (`verify_thread`: the program-wide checks) in ir/verifier.py, "thread.interp" in
backends/thread_interp.py (the block's threads as a numpy lane axis).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import tilehal

from . import dtypes as dt
from .layout import Fragment
from .nodes import Buffer, Expr, Load, Seq, Stmt, Var, const

# ---------------------------------------------------------------- expressions


@dataclass(eq=False)
class ThreadIdx(Expr):
    """`threadIdx.x` of the enclosing T.Kernel (the `_tx` of the CUDA codegen): one value per lane."""

    dtype: str = dt.INDEX


SHUFFLE_KINDS = ("xor", "down", "up", "idx")  # __shfl_xor_sync / _down / _up / __shfl_sync


@dataclass(eq=False)
class Shuffle(Expr):
    """`__shfl_<kind>_sync(0xffffffff, value, lane, width)`: the value another lane of the warp holds.
    `lane` is the xor mask (xor), the offset (down / up) or the source lane (idx), within segments
    of `width` lanes; a source past the segment (down / up) gives the lane its own value."""

    kind: str
    value: Expr
    lane: Expr
    width: int = 32

    @property
    def dtype(self) -> str:
        return self.value.dtype

    def children(self) -> list[Expr]:
        return [self.value, self.lane]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Shuffle(self.kind, children[0], children[1], self.width)


# ---------------------------------------------------------------- statements


@dataclass(eq=False)
class RegBuffer(Stmt):
    """Allocate per-thread registers: `buffer` (scope "local", shape (nregs,)) holds, in each thread,
    that thread's `nregs` elements of `fragment` (when the registers hold a fragment tile)."""

    buffer: Buffer
    fragment: Fragment | None = None
    init: Expr | None = None  # every register starts at this value (else zero)
    scalar: bool = False  # one register, spelled as a C scalar (`float acc = 0;`) by the CUDA printer
    unroll_init: bool = True  # the CUDA printer's `#pragma unroll` on the init loop
    vec: bool = False  # a vector temporary, spelled `tilehal::Vec<T, nregs>` by the CUDA printer

    @property
    def nregs(self) -> int:
        return int(self.buffer.shape[0].value)

    def exprs(self) -> list[Expr]:
        return [self.init] if self.init is not None else []

    def rebuild(self, tr: Any) -> Stmt:
        return RegBuffer(self.buffer, self.fragment, tr.expr(self.init) if self.init is not None else None, self.scalar,
                         self.unroll_init, self.vec, loc=self.loc)


BARRIER_KINDS = ("block",)  # __syncthreads (named barriers: a later kind)


@dataclass(eq=False)
class Barrier(Stmt):
    """Every thread of the block waits here until all have arrived (`__syncthreads()`)."""

    kind: str = "block"

    side_effects = True

    def rebuild(self, tr: Any) -> Stmt:
        return Barrier(self.kind, loc=self.loc)


ASYNC_COPY_BYTES = (4, 8, 16)  # cp.async.ca / .cg sizes


@dataclass(eq=False)
class AsyncCopy(Stmt):
    """cp.async of `n` contiguous elements (last dim) from global `src[src_idx]` to shared
    `dst[dst_idx]`, per thread. With `pred` false the thread's copy writes zeros (src-size 0).
    The data lands when an AsyncWait retires the group a later AsyncCommit closes it into."""

    dst: Buffer
    dst_idx: list[Expr]
    src: Buffer
    src_idx: list[Expr]
    n: int
    pred: Expr | None = None

    side_effects = True

    @property
    def nbytes(self) -> int:
        return self.n * tilehal.get_dtype(self.dst.dtype).itemsize

    def exprs(self) -> list[Expr]:
        return [*self.dst_idx, *self.src_idx] + ([self.pred] if self.pred is not None else [])

    def reads(self) -> set[Buffer]:
        return {self.src}

    def writes(self) -> set[Buffer]:
        return {self.dst}

    def rebuild(self, tr: Any) -> Stmt:
        return AsyncCopy(self.dst, [tr.expr(i) for i in self.dst_idx], self.src, [tr.expr(i) for i in self.src_idx],
                         self.n, tr.expr(self.pred) if self.pred is not None else None, loc=self.loc)


@dataclass(eq=False)
class AsyncCommit(Stmt):
    """`cp.async.commit_group`: the thread's copies issued since the last commit become one group."""

    side_effects = True

    def rebuild(self, tr: Any) -> Stmt:
        return AsyncCommit(loc=self.loc)


@dataclass(eq=False)
class AsyncWait(Stmt):
    """`cp.async.wait_group n`: wait until at most `n` of the thread's committed groups are in flight."""

    n: int = 0

    side_effects = True

    def rebuild(self, tr: Any) -> Stmt:
        return AsyncWait(self.n, loc=self.loc)


@dataclass(frozen=True)
class IntrinsicSpec:
    """What an intrinsic means: `n_in` operands, `n_out` results, `attrs` it needs; its
    interpretation is the "thread.interp" table's entry for the name (backends/thread_interp.py)."""

    name: str
    n_in: int
    n_out: int
    attrs: tuple[str, ...] = ()


# The intrinsics the thread IR knows (step 2 adds ldmatrix / mma.sync / wgmma with their
# fragment semantics). One table for the printer, the verifier and the interpreter.
INTRINSICS = {s.name: s for s in [
    IntrinsicSpec("fma", 3, 1),  # __fmaf_rn(a, b, c): a * b + c rounded once
    IntrinsicSpec("cvt", 1, 1, ("dtype",)),  # __float2half_rn & co: round to attrs["dtype"], back to compute type
    # fence.proxy.async.shared::cta: shared memory written by threads / cp.async is next read by the async proxy
    # (wgmma, TMA); no effect on values (the interpreter's memory has one proxy)
    IntrinsicSpec("fence_proxy_async", 0, 0),
    # ldmatrix.sync.aligned.m8n8.x4.shared.b16 (.trans): in: the shared-memory element each lane addresses (lanes
    # 8i..8i+7: the rows of matrix i); out: the lane's 4 32-bit registers, register i = matrix i's b16 pair
    # (row lane / 4, units 2 (lane % 4), +1), or with .trans (rows 2 (lane % 4), +1 of unit lane / 4)
    IntrinsicSpec("ldmatrix_x4", 1, 4),
    IntrinsicSpec("ldmatrix_x4_trans", 1, 4),
    # mma.sync.aligned.m16n8k16 (16-bit A/B) / m16n8k32 (8-bit A/B), row.col: in: A's 4 32-bit registers, B's 2,
    # the 4 accumulators; out: the 4 accumulators + A @ B (fp32 or int32), in the PTX ISA's fragment layouts;
    # attrs["dtype"]: the A / B element type
    IntrinsicSpec("mma_m16n8k16", 10, 4, ("dtype",)),
    IntrinsicSpec("mma_m16n8k32", 10, 4, ("dtype",)),
    # two 16-bit values' bits packed into one 32-bit register (the first in the low half); attrs["dtype"]: their type
    IntrinsicSpec("pack2_bits", 2, 1, ("dtype",)),
    # wgmma.fence / commit_group / wait_group n and the compiler fence on accumulators: ordering only (the
    # interpreter runs each wgmma when issued, so they change no value)
    IntrinsicSpec("wgmma_fence", 0, 0),
    IntrinsicSpec("wgmma_commit", 0, 0),
    IntrinsicSpec("wgmma_wait", 0, 0, ("n",)),
    IntrinsicSpec("wgmma_fence_operands", 0, 0, ("buffer",)),
]}


@dataclass(eq=False)
class Intrinsic(Stmt):
    """`outs = name(ins, **attrs)`: a hardware instruction on per-thread values; each out is an
    element of a buffer (a Load naming the element written, typically a register)."""

    name: str
    outs: list[Load]
    ins: list[Expr]
    attrs: dict = field(default_factory=dict)

    def exprs(self) -> list[Expr]:
        return [i for o in self.outs for i in o.indices] + list(self.ins)

    def writes(self) -> set[Buffer]:
        return {o.buffer for o in self.outs}

    def rebuild(self, tr: Any) -> Stmt:
        outs = [Load(o.buffer, [tr.expr(i) for i in o.indices]) for o in self.outs]
        return Intrinsic(self.name, outs, [tr.expr(i) for i in self.ins], dict(self.attrs), loc=self.loc)


@dataclass(eq=False)
class ThreadFor(Stmt):
    """The per-thread loop over a thread's share of a tile with a constant trip count (the
    `#pragma unroll for (int j = 0; j < trips; ++j)` of the CUDA codegen's flat_loop)."""

    var: Var
    trips: int
    body: Stmt

    def children(self) -> list[Stmt]:
        return [self.body]

    def rebuild(self, tr: Any) -> Stmt:
        return ThreadFor(self.var, self.trips, tr.stmt(self.body) or Seq([]), loc=self.loc)


@dataclass(eq=False)
class Uniform(Stmt):
    """A block-uniform region: scalar code every thread runs identically (block / loop indices,
    no thread index, registers, shuffles, barriers or async copies); the interpreter runs it once."""

    body: Stmt

    def children(self) -> list[Stmt]:
        return [self.body]

    def rebuild(self, tr: Any) -> Stmt:
        return Uniform(tr.stmt(self.body) or Seq([]), loc=self.loc)


@dataclass(eq=False)
class Scope(Stmt):
    """A nested scope (`{ ... }` in C: names declared inside end with it); runs its body."""

    body: Stmt

    def children(self) -> list[Stmt]:
        return [self.body]

    def rebuild(self, tr: Any) -> Stmt:
        return Scope(tr.stmt(self.body) or Seq([]), loc=self.loc)


@dataclass(eq=False)
class StridedFor(Stmt):
    """`for (var = start; var < stop; var += step)` where `start` may differ between threads (the
    thread index): each thread runs its own trip count; a barrier or shuffle inside is an error."""

    var: Var
    start: Expr
    stop: Expr
    step: int
    body: Stmt
    one_line: bool = False  # the CUDA printer writes the (single-statement) body on the loop's line

    def children(self) -> list[Stmt]:
        return [self.body]

    def exprs(self) -> list[Expr]:
        return [self.start, self.stop]

    def rebuild(self, tr: Any) -> Stmt:
        return StridedFor(self.var, tr.expr(self.start), tr.expr(self.stop), self.step,
                          tr.stmt(self.body) or Seq([]), self.one_line, loc=self.loc)


@dataclass(eq=False)
class BreakIf(Stmt):
    """`if (cond) break;` at the top level of a ThreadFor body: a thread whose cond holds leaves the
    loop (skips the rest of this iteration and every later one)."""

    cond: Expr

    def exprs(self) -> list[Expr]:
        return [self.cond]

    def rebuild(self, tr: Any) -> Stmt:
        return BreakIf(tr.expr(self.cond), loc=self.loc)


THREAD_NODES = (ThreadIdx, Shuffle, RegBuffer, Barrier, AsyncCopy, AsyncCommit, AsyncWait, Intrinsic, ThreadFor,
                Uniform, Scope, StridedFor, BreakIf)


def reg_buffer(name: str, nregs: int, dtype: str, fragment: Fragment | None = None) -> RegBuffer:
    """A RegBuffer statement allocating `nregs` registers of `dtype` per thread."""
    return RegBuffer(Buffer(name, (const(int(nregs)),), dt.canonical(dtype), "local"), fragment)
