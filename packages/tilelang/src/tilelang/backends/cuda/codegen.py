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

The kernel body is built as a thread-level program (ir/thread.py nodes, with lower_thread.py's
ThreadBuilder: the memory references, core statements and T.Parallel loops live there, the tile
ops' rules in rules/) and printed by emit.py; the same program runs on the thread interpreter
(target "cuda_threads"). The kernel head (parameters, block indices, the shared-memory arena) and the
warp-specialized pipelines are still written as text here.
"""

from __future__ import annotations

import itertools

import numpy as np

from ...errors import CompileError
from ...ir import dtypes as dt
from ...ir.nodes import (
    Alloc,
    BinOp,
    Buffer,
    Cast,
    Const,
    Copy,
    Expr,
    Fill,
    For,
    If,
    Kernel,
    Let,
    Load,
    PrimFunc,
    Region,
    Seq,
    Stmt,
    Store,
    Var,
    register_rules,
)
from ...ir.visit import (
    buffers_read,
    buffers_written,
    child_stmts,
    seq_rule,
    stmt_exprs,
    walk_expr,
    walk_stmts,
)
from ..cexpr import C_MATH, CExprEmitter
from .common import (
    _LOW,
    SMEM_ALIGN,
    SMEM_LIMIT,
    ParCtx,
    SmemInfo,
    _nonneg,
    cuda_type,
    esize,
    float_literal,
    log,
    value_type,
)
from .emit import emit_body
from .infer import LayoutInference, infer_layouts
from .lower_thread import ThreadBuilder
from .rules import (
    IN_PARALLEL,
    UNIFORM,
    AtomicRules,
    CopyRules,
    CumSumRules,
    FillRules,
    GemmRules,
    PipelineRules,
    ReduceRules,
    WgmmaRules,
)
from .rules.tma import TmaRules

PRELUDE = r"""
#include <tilehal/tilehal.cuh>
template <typename T> __device__ __forceinline__ T tl_max(T a, T b) { return a > b ? a : b; }
template <typename T> __device__ __forceinline__ T tl_min(T a, T b) { return a < b ? a : b; }
template <typename T> __device__ __forceinline__ T tl_floordiv(T a, T b) {
  T q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
template <typename T> __device__ __forceinline__ T tl_floormod(T a, T b) {
  T r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""
WGMMA_PRELUDE = r"""#include <tilehal/mbarrier.cuh>
#include <tilehal/wgmma.cuh>
#include <tilehal/wgmma16_ops.cuh>
"""
TMA_PRELUDE = r"""#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
"""
# TMA multicast (pass_configs cuda_ws_multicast): a consumer warp's release of a stage on the peer CTA's `empty`
# barrier, with mbarrier.arrive's default .release.cta semantics (tilehal::mbarrier_arrive_cluster's
# .release.cluster orders every prior memory access cluster-wide: not needed here, the stage was read by the
# tensor cores, whose wgmma_wait came first; the R2 run of 2026-12-02 was 1.3-2.2x slower with it)
# float32 math forms chosen by pass_configs (issue 21, session 29; ncu + SASS of flash attention on the H200):
#   cuda_fast_exp2: T.exp2 as one `ex2.approx.ftz.f32` (MUFU.EX2). CUDA's exp2f is `ex2.approx.f32` without .ftz,
#     which ptxas turns into FSETP + FMUL + MUFU.EX2 + FMUL per call (the hardware unit flushes subnormals, so
#     subnormal results are rebuilt by scaling); same 2 ulp accuracy, results below 2^-126 become 0
#     (the public TileLang gets this form through --use_fast_math, `tl.enable_fast_math`).
#   cuda_fmnmx: float max / min as `max.NaN.f32` / `min.NaN.f32` (one FMNMX; NaN in, NaN out, as the
#     interpreter's np.maximum / np.minimum); `a > b ? a : b` is FSETP + FSEL, a two-instruction dependency per
#     step of a reduction chain.
#   cuda_fast_div: float32 division as __fdividef (KernelCodegen.binop; flash attention's final O / row sum).
#   cuda_tree_reduce: rules/reduce.py. `tl.enable_fast_math` (the public TileLang's --use_fast_math) turns on all four.
MATH_OPTIONS = {"cuda_fast_exp2": "fast_exp2", "cuda_fmnmx": "fmnmx", "cuda_tree_reduce": "tree_reduce",
                "cuda_fast_div": "fast_div"}
# codegen flags passed the same way (no float semantics: not part of tl.enable_fast_math)
FLAG_OPTIONS = {"cuda_ws_split_producers": "split_producers"}


def math_options(options: dict) -> frozenset[str]:
    """The MATH_OPTIONS pass_configs turn on (each defaults to `tl.enable_fast_math`, an explicit False wins)."""
    fast = bool(options.get("tl.enable_fast_math"))
    return (frozenset(v for k, v in MATH_OPTIONS.items() if options.get(k, fast)) |
            frozenset(v for k, v in FLAG_OPTIONS.items() if options.get(k)))


FAST_EXP2_PRELUDE = r"""__device__ __forceinline__ float tl_exp2f_ftz(float x) {
  float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
"""
FMNMX_PRELUDE = r"""template <> __device__ __forceinline__ float tl_max<float>(float a, float b) {
  float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
template <> __device__ __forceinline__ float tl_min<float>(float a, float b) {
  float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
"""
FAST_EXP2_MATH = {**C_MATH, "exp2": ("tl_exp2f_ftz", "exp2")}
MULTICAST_PRELUDE = r"""__device__ __forceinline__ void tl_mbar_arrive_peer(tilehal::u64* bar, unsigned cta) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(tilehal::smem_addr(bar)), "r"(cta)
               : "memory");
}
"""



class KernelCodegen(ThreadBuilder, CExprEmitter, CopyRules, FillRules, GemmRules, WgmmaRules, ReduceRules, CumSumRules,
                    AtomicRules, PipelineRules, TmaRules):
    """Lowers one T.Kernel; statements are lowered by their rule in the "cuda" / "cuda.parallel"
    tables (registered below; the tile ops' rules are the mixins of rules/)."""

    TARGET = "CUDA"

    def __init__(self, func: PrimFunc, kernel: Kernel, name: str, lets: list[Let], wgmma: bool = True,
                 tma: bool = True, one_barrier: bool = False, warp_specialize: bool = False,
                 persistent: bool = False, pingpong: bool = False, overlap: bool = False,
                 multicast: bool = False, split_stages: bool = False, two_ctas: bool = False,
                 math: frozenset[str] = frozenset()) -> None:
        self.func = func
        # pass_configs cuda_fast_exp2 / cuda_fmnmx / cuda_tree_reduce (MATH_OPTIONS): the float32 instruction
        # forms of T.exp2, max / min and the per-thread part of T.reduce_* (see MATH_PRELUDES, rules/reduce.py)
        self.math = frozenset(math)
        if "fast_exp2" in self.math:
            self.MATH = FAST_EXP2_MATH
        self.kernel = kernel
        self.name = name
        self.lets = lets
        self.threads = 1
        for t in kernel.threads:
            self.threads *= int(t)
        if self.threads % 32 or self.threads > 1024:
            raise CompileError(f"T.Kernel threads={self.threads}: the CUDA backend needs a multiple of 32 threads, "
                               f"at most 1024", kernel.loc)
        try:
            self.inf: LayoutInference = infer_layouts(kernel, allow_wgmma=wgmma)
        except CompileError as e:
            if not wgmma or "cannot infer a layout" not in str(e):
                raise
            # the wgmma accumulator layouts (m64 blocks per warpgroup) can conflict where mma.sync's do not
            # (two gemms whose row vectors meet in one T.Parallel loop): the kernel keeps mma.sync
            log.debug("%s: wgmma layouts cannot be inferred together (%s); T.gemm on mma.sync in this kernel",
                      kernel.loc, str(e).splitlines()[0])
            self.inf = infer_layouts(kernel, allow_wgmma=False)
        self.has_wgmma = any(p.kind == "wgmma" for p in self.inf.gemms.values())
        self._builder_init()  # the thread-level body (lower_thread.py), printed by emit.py
        self.ids = itertools.count()
        self.smem: dict[Buffer, SmemInfo] = {}
        self.stage_expr: dict[Buffer, str] = {}
        self.scratch_bytes = 0
        self.mbarriers = 0  # 8-byte mbarriers of TMA pipelines, after the buffers and scratch (plan_smem)
        self.par: ParCtx | None = None
        self.pending_w: set[Buffer] = set()
        self.pending_r: set[Buffer] = set()
        self._wg_async: Stmt | None = None  # the wgmma T.Pipelined leaves in flight (rules/pipelined.py)
        self._wg_defer_wait = False  # ... and waits for itself, after the refill (cuda_wgmma_one_barrier)
        self._wg_after_commit: Stmt | None = None  # a wgmma followed by `_wg_after_commit_line` (pingpong)
        # T.gemm(wg_wait=-1) inside a warp-specialized pipelined loop: wgmma groups committed and not waited for,
        # oldest first; each is waited for right before the first later statement touching its accumulator or
        # writing its operands, and all of them before the loop releases its stage (rules/pipelined.py)
        self._wg_pending: list = []
        self._wg_defer_ok = False
        self._wg_after_commit_line = ""
        self._wg_packed: dict[int, Buffer] = {}  # id(T.gemm) -> its register A operand, packed ahead (wg_pack_a)
        self.dyn_names = {v.name for v in func.dynamic_vars}
        self._rw: dict[int, tuple[frozenset[Buffer], frozenset[Buffer]]] = {}
        self._index_rw(kernel.body)
        self.all_stmts: list[Stmt] = list(walk_stmts(kernel.body))
        self.ranges: dict[Var, tuple[int, int]] = {}
        self.hopper = wgmma  # sm_90a features: wgmma, TMA
        self.use_tma = tma  # pass_configs tl.disable_tma_lower: pipelined copies stay on cp.async
        # pass_configs cuda_wgmma_one_barrier: a pipelined wgmma loop refills the stage read two iterations
        # back after its only barrier (rules/pipelined.py) instead of the previous one after a second barrier
        self.one_barrier = one_barrier
        # pass_configs cuda_warp_specialize: a TMA pipeline gets a producer warpgroup (rules/pipelined.py)
        self.warp_specialize = warp_specialize
        self.ws_loop: For | None = None  # the pipelined loop the producer warpgroup feeds
        self.ws_prologue: list[str] = []  # barrier init + the producer's branch, before the kernel body
        self.launch_threads = 0  # threads + the producer warpgroup's 128 when warp-specialized
        self.persistent = persistent  # pass_configs cuda_persistent (with warp specialization)
        self.ws_pingpong = pingpong  # pass_configs cuda_ws_pingpong: consumer warpgroups take turns
        # pass_configs cuda_ws_overlap (opt-in; slower than the plain loop on the H200 in R1 of 2026-12-02): a gemm
        # -> softmax -> gemm loop issues the next iteration's first gemm before this one's middle part
        # (rules/pipelined.py `_ws_overlap`)
        self.ws_overlap = overlap
        # pass_configs cuda_ws_multicast: 2-CTA clusters share one pipelined tile through TMA multicast
        self.ws_multicast = multicast
        # pass_configs cuda_ws_split_stages (opt-in, not timed yet): each group of pipelined copies read by
        # different statements (flash attention's K and V) gets its own full / empty mbarriers, waited for before
        # its first reader and released after its last (rules/pipelined.py `_ws_split_groups`)
        self.ws_split = split_stages
        # pass_configs cuda_ws_split_producers (session 29, opt-in): with split stages, a producer thread per group
        self.ws_split_producers = "split_producers" in self.math
        # pass_configs cuda_ws_two_ctas (opt-in, not timed yet): two warp-specialized CTAs per SM where shared
        # memory and registers allow (one CTA's pipeline fill and epilogue under the other's main loop)
        self.ws_two_ctas = two_ctas
        self.ws_producer_warp = False  # ... its producer is one warp (rules/pipelined.py `_pipelined_ws`)
        self.two_ctas_applied = False  # ... and two CTAs fit an SM (`_ws_two_ctas`; else built again without it)
        self.mc_cluster: list[int] | None = None  # the cluster dims when multicast applies (rules/pipelined.py)
        self.persistent_tiles = 0  # the grid's tiles a persistent kernel loops over
        self.tma_specs: list = []  # TmaSpec per descriptor parameter, in parameter order
        self.tma_bufs: set[Buffer] = set()
        self.tma_plans: dict[int, dict] = {}
        self._plan_ranges()
        self._plan_swizzle()
        self._plan_pipelines()
        self._plan_zero_init()

    # ================================================================ planning

    def _index_rw(self, s: Stmt) -> tuple[frozenset[Buffer], frozenset[Buffer]]:
        """Buffers read / written by every statement of the kernel, computed once bottom-up (the
        barrier, pipeline and smem planners ask for them per statement; walking each subtree again
        made code generation quadratic in the kernel size)."""
        kids = child_stmts(s)
        if not kids:
            rw = (frozenset(buffers_read(s)), frozenset(buffers_written(s)))
        else:
            r = {x.buffer for e in stmt_exprs(s) for x in walk_expr(e) if isinstance(x, Load)}
            w: set[Buffer] = set()
            for c in kids:
                cr, cw = self._index_rw(c)
                r |= cr
                w |= cw
            rw = (frozenset(r), frozenset(w))
        self._rw[id(s)] = rw
        return rw

    def _plan_ranges(self) -> None:
        """Value ranges of block indices (from the grid), loop variables (start and extent) and lets,
        outer before inner: bounds checks that the ranges prove are left out (a full tile's copy at
        a block's offset never passes the end of a tensor whose size the tile divides)."""
        k = self.kernel
        unknown: set[Var] = set()

        def bind(v: Var, iv: tuple[int, int] | None) -> None:  # a variable bound twice gets the hull
            if iv is None or v in unknown:
                unknown.add(v)
                self.ranges.pop(v, None)
                return
            old = self.ranges.get(v)
            self.ranges[v] = iv if old is None else (min(old[0], iv[0]), max(old[1], iv[1]))

        for v, g in zip(k.block_vars, k.grid):
            iv = self.interval(g)
            bind(v, (0, iv[1] - 1) if iv is not None and iv[1] >= 1 else None)
        for let in self.lets:
            bind(let.var, self.interval(let.value))
        for s in self.all_stmts:
            if isinstance(s, For):
                st, ext = self.interval(s.start), self.interval(s.extent)
                bind(s.var, (st[0], st[1] + ext[1] - 1) if st is not None and ext is not None and ext[1] >= 1
                     else None)
            elif isinstance(s, Let):
                bind(s.var, self.interval(s.value))

    def interval(self, e: Expr) -> tuple[int, int] | None:
        """(lo, hi) of an integer expression over the known ranges, or None."""
        if isinstance(e, Const):
            if isinstance(e.value, bool) or not isinstance(e.value, int):
                return None
            return (int(e.value), int(e.value))
        if isinstance(e, Var):
            return self.ranges.get(e)
        if isinstance(e, Cast) and not dt.is_float(e.dtype):
            return self.interval(e.value)
        if not isinstance(e, BinOp) or dt.is_float(e.dtype):
            return None
        a, b = self.interval(e.a), self.interval(e.b)
        if a is None or b is None:
            return None
        op = e.op
        if op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if op == "*":
            ps = [x * y for x in a for y in b]
            return (min(ps), max(ps))
        if op == "//" and b[0] == b[1] and b[0] > 0:
            return (a[0] // b[0], a[1] // b[0])
        if op == "%" and b[0] == b[1] and b[0] > 0:
            return (a[0], a[1]) if 0 <= a[0] and a[1] < b[0] else (0, b[0] - 1)
        if op == "max":
            return (max(a[0], b[0]), max(a[1], b[1]))
        if op == "min":
            return (min(a[0], b[0]), min(a[1], b[1]))
        return None

    def reads(self, s: Stmt) -> frozenset[Buffer]:
        rw = self._rw.get(id(s))
        return rw[0] if rw is not None else frozenset(buffers_read(s))

    def writes(self, s: Stmt) -> frozenset[Buffer]:
        rw = self._rw.get(id(s))
        return rw[1] if rw is not None else frozenset(buffers_written(s))

    def _plan_zero_init(self) -> None:
        """Shared buffers whose first access is not a full, unconditional write start at zero (the
        interpreter's allocation semantics); the others are left as they are (no wasted pass)."""
        self.zero_init: set[Buffer] = set()
        first: dict[Buffer, bool] = {}
        rows: dict[Buffer, set[int]] = {}  # dim-0 indices written so far by unconditional full-row copies

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
            reads, writes = self.reads(s), self.writes(s)
            for b in reads | writes:
                if b.scope != "shared" or b in first:
                    continue
                full = False
                if b in writes and b not in reads and not cond and isinstance(s, (Copy, Fill)):
                    r, shape = s.dst, b.static_shape()
                    full = tuple(r.extents) == shape and all(isinstance(x, Const) and x.value == 0 for x in r.starts)
                    # copies of consecutive row blocks (a KV tile gathered page by page) fill it together
                    if not full and shape and all(isinstance(x, Const) for x in r.starts) \
                            and tuple(r.extents[1:]) == shape[1:] and all(x.value == 0 for x in r.starts[1:]):
                        got = rows.setdefault(b, set())
                        got.update(range(r.starts[0].value, r.starts[0].value + int(r.extents[0])))
                        if len(got) < shape[0]:
                            continue  # not decided yet: the next statements may write the other rows
                        full = True
                first[b] = full
        visit(self.kernel.body, False)
        self.zero_init = {b for b, full in first.items() if not full}
        for b in self.zero_init:
            log.debug("shared buffer %s is read before it is fully written: zero-initialized", b.name)

    # ================================================================ emission helpers

    def fresh(self, base: str) -> str:
        return f"_{base}{next(self.ids)}"

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

    def value_ctype(self, dtype: str) -> str:
        return value_type(dtype)

    def round_to(self, dtype: str, code: str) -> str | None:
        """Round to the narrow type, keep computing in float."""
        if dtype not in _LOW:
            return None
        return f"tilehal::to_float(tilehal::from_float<{cuda_type(dtype)}>((float)({code})))"

    def minmax(self, op: str, dtype: str, a: str, b: str) -> str:
        return f"tl_{op}<{value_type(dtype)}>({a}, {b})"

    def binop(self, e: BinOp) -> str:
        # pass_configs cuda_fast_div: float32 `a / b` as __fdividef (MUFU.RCP + FMUL, 2 ulp) instead of the IEEE
        # division (reciprocal, Newton steps and an FCHK range check with a slow path: ~10 instructions)
        if e.op == "/" and "fast_div" in self.math and e.dtype == "float32":
            return f"__fdividef({self.cast_to(e.a, e.dtype)}, {self.cast_to(e.b, e.dtype)})"
        return super().binop(e)

    def int_divmod(self, e: BinOp, a: str, b: str) -> str:
        if _nonneg(e.a) and _nonneg(e.b):
            return f"({a} {'/' if e.op == '//' else '%'} {b})"
        return f"tl_floor{'div' if e.op == '//' else 'mod'}<{value_type(e.dtype)}>({a}, {b})"

    # ---------------------------------------------------------------- memory references

    def dim(self, s: Expr) -> str:
        return str(int(s.value)) if isinstance(s, Const) else s.name

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

        return (expand({b for b in self.reads(s) if keep(b)}), expand({b for b in self.writes(s) if keep(b)}))

    def hazard(self, s: Stmt) -> None:
        r, w = self.tracked(s)
        if ((r | w) & self.pending_w) or (w & self.pending_r):
            self.sync()
        self.pending_r |= r
        self.pending_w |= w

    def stmt(self, s: Stmt) -> None:
        if self.par is not None:
            return self.par_stmt(s)
        if self._wg_pending:
            self._wg_settle(s)
        s.apply("cuda", self, "CUDA codegen: unsupported statement {op}")

    def _wg_settle(self, s: Stmt) -> None:
        """Wait for the deferred wgmma groups `s` depends on: the newest one whose accumulator `s` reads or
        writes, or whose operands it writes, and every older one (wgmma.wait_group counts in commit order)."""
        r, w = self.reads(s), self.writes(s)
        last = -1
        for i, g in enumerate(self._wg_pending):
            if g.C.buffer in r or g.C.buffer in w or g.A.buffer in w or g.B.buffer in w:
                last = i
        if last >= 0:
            self.wg_wait(len(self._wg_pending) - 1 - last)

    def wg_wait(self, keep: int = 0) -> None:
        """wgmma.wait_group(keep): all but the `keep` newest deferred groups are done; fence their accumulators."""
        from ...ir.thread import Intrinsic

        done, self._wg_pending = self._wg_pending[:len(self._wg_pending) - keep], self._wg_pending[len(self._wg_pending) - keep:]
        if not done:
            return
        self.add(Intrinsic("wgmma_wait", [], [], {"n": keep}))
        for g in done:
            self.add(Intrinsic("wgmma_fence_operands", [], [], {"buffer": g.C.buffer.name}))

    # ---------------------------------------------------------------- T.Parallel (the statement rules of the "cuda" and
    # "cuda.parallel" tables, the memory references and the thread loops are in lower_thread.py: they build nodes)

    def par_body(self, s: Stmt, ctx: ParCtx) -> None:
        saved = self.par
        self.par = ctx
        try:
            self.par_stmt(s)
        finally:
            self.par = saved

    def par_stmt(self, s: Stmt) -> None:
        s.apply("cuda.parallel", self, "{op} inside a T.Parallel loop is not supported on cuda")

    # ---------------------------------------------------------------- regions

    # ---------------------------------------------------------------- helpers shared by the op rules

    def _full(self, r: Region) -> bool:
        return tuple(r.extents) == r.buffer.static_shape() and all(isinstance(x, Const) and x.value == 0
                                                                     for x in r.starts)

    def _tile_names(self, r: Region) -> list[str]:
        return [self.fresh("c") for _ in (r.squeezed() or [1])]

    # ================================================================ the kernel

    def place_smem(self) -> None:
        """Offsets for the shared buffers (before lowering: barriers must know which buffers alias)."""
        allocs = [st for st in self.all_stmts if isinstance(st, Alloc) and st.buffer.scope == "shared"]
        # live ranges over a pre-order numbering of statements; a use inside a loop spans the loop
        order: dict[int, int] = {}
        spans: dict[int, tuple[int, int]] = {}

        def number(s: Stmt, loops: list[int]) -> None:
            i = len(order)
            order[id(s)] = i
            for c in child_stmts(s):
                number(c, loops + ([id(s)] if isinstance(s, For) else []))
            spans[id(s)] = (i, len(order))

        number(self.kernel.body, [])
        live: dict[Buffer, list[int]] = {}

        def uses(s: Stmt, loops: list[Stmt]) -> None:
            if not isinstance(s, (Seq, For, If, Kernel)):
                touched = set(self.reads(s) | self.writes(s))
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
        if self.persistent_tiles:  # the producer refills the stages while the consumers finish a tile: they
            whole = [min((v[0] for v in live.values()), default=0), max((v[1] for v in live.values()), default=0) + 1]
            for c in self.pipes[id(self.ws_loop)]:  # share bytes with no other buffer
                live[c.dst.buffer] = list(whole)
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
                if (b in self.wgmma_bufs or b in self.tma_bufs) and off % 1024:  # swizzle atoms on 1 KiB
                    off = -(-off // 1024) * 1024
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
        # the mbarriers live in the dynamic shared memory too: a static `__shared__` array would make ptxas
        # pad the static part to the 1 KiB alignment of _tl_smem, and a kernel with up to 48 KiB of dynamic
        # shared memory (no opt-in at launch) would then not launch (static + dynamic over 48 KiB)
        mbar_off = -(-total // 8) * 8
        if self.mbarriers:
            total = mbar_off + 8 * self.mbarriers
        if total > SMEM_LIMIT:
            detail = ", ".join(f"{b.name}: {nb} B" for nb, b in sizes)
            raise CompileError(f"T.Kernel needs {total} bytes of shared memory ({detail}"
                               f"{', scratch: ' + str(self.scratch_bytes) + ' B' if self.scratch_bytes else ''}"
                               f"{', mbarriers: ' + str(8 * self.mbarriers) + ' B' if self.mbarriers else ''}); "
                               f"an sm_90 block can use at most {SMEM_LIMIT}", self.kernel.loc)
        decls = []
        for b, info in self.smem.items():
            decls.append(f"{cuda_type(b.dtype)}* {b.name} = reinterpret_cast<{cuda_type(b.dtype)}*>(_tl_smem + "
                         f"{info.offset});")
        if self.scratch_bytes:
            decls.append(f"unsigned char* _tl_scratch = _tl_smem + {scratch_off};")
        if self.mbarriers:
            decls.append(f"tilehal::u64* _tl_mbar = reinterpret_cast<tilehal::u64*>(_tl_smem + {mbar_off});")
        return total, decls

    def block_index_lines(self, tile: str | None) -> list[str]:
        """The definitions of the T.Kernel's block indices: from blockIdx (tile None) or, in a persistent
        kernel, from the linear tile index `tile` over the (constant) grid; through T.use_swizzle's panels."""
        k = self.kernel
        if tile is None:
            axes = ["blockIdx.x", "blockIdx.y", "blockIdx.z"]
            dims = ["gridDim.x", "gridDim.y", "gridDim.z"]
        else:
            g = [int(x.value) for x in k.grid] + [1, 1]
            axes = [f"({tile} % {g[0]})", f"(({tile} / {g[0]}) % {g[1]})", f"({tile} / {g[0] * g[1]})"]
            dims = [str(g[0]), str(g[1]), str(g[2])]
        if getattr(self, "block_reverse", None) is not None:  # longest blocks first (rules/pipelined.py)
            r = self.block_reverse
            axes[r] = f"({dims[r]} - 1 - {axes[r]})"
        pair = tile is None and self.mc_cluster is not None  # TMA multicast: blockIdx.y pairs share a tile
        if pair:
            axes[1], dims[1] = "(blockIdx.y >> 1)", "(gridDim.y >> 1)"
        out = []
        swz = k.attrs.get("swizzle")
        if swz and swz[2] and len(k.block_vars) >= 2:
            panel, order = int(swz[0]), swz[1]
            gx, gy = (dims[0], dims[1]) if order == "row" else (dims[1], dims[0])
            ix, iy = (axes[0], axes[1]) if order == "row" else (axes[1], axes[0])
            bid = tile if tile is not None else f"{iy} * {gx} + {ix}"
            out += [f"// T.use_swizzle(panel_size={panel}, order={order!r}): blocks walk panels of {panel} columns",
                    f"const int _bid = {bid};",
                    f"const int _panel = _bid / ({panel} * {gy});",
                    f"const int _inpanel = _bid % ({panel} * {gy});",
                    f"const int _pw = min({panel}, (int){gx} - _panel * {panel});",
                    "const int _sx = _panel * " f"{panel} + _inpanel % _pw, _sy = _inpanel / _pw;"]
            remap = {ix: "_sx", iy: "_sy"}
            axes = [remap.get(a, a) for a in axes]
        if pair:
            axes[1] = f"(2 * {axes[1]} + (int)(blockIdx.y & 1))"
        for v, a in zip(k.block_vars, axes):
            out.append(f"const int {v.name} = {a};")
        return out

    def _persistent_body(self, body: list[str]) -> list[str]:
        """pass_configs cuda_persistent: the consumers' part of the body (after the warp-specialized prologue)
        loops over the tiles of the grid; the launch has min(tiles, SMs) blocks (backend.py)."""
        n = len(self.ws_prologue)
        pro, rest = body[:n], body[n:]
        # the consumers start after the producer's branch: `setmaxnreg_inc` (if any) stays before the loop
        keep = [ln for ln in rest[:1] if "setmaxnreg_inc" in ln]
        rest = rest[len(keep):]
        loop = [f"  for (int _tile = blockIdx.x; _tile < {self.persistent_tiles}; _tile += gridDim.x) {{"]
        loop += ["    " + ln for ln in self.block_index_lines("_tile")]
        loop += ["  " + ln for ln in rest]
        loop += [f"    tilehal::named_barrier_sync(1, {self.threads});  // this tile's last reads before the next's writes",
                 "  }"]
        return pro + keep + ["  int _kb = 0;  // pipeline iterations of the tiles before this one"] + loop

    def generate(self) -> tuple[str, int]:
        self.written_globals = {b for b in self.writes(self.kernel.body) if b.scope == "global"}
        k = self.kernel
        self.place_smem()
        self.stmt(k.body)
        body = emit_body(self, self.body_root())
        smem_bytes, decls = self.plan_smem()
        if self.ws_loop is not None:
            # the consumers synchronize among themselves (named barrier 1): the producer warpgroup left
            body = [ln.replace("__syncthreads();", f"tilehal::named_barrier_sync(1, {self.threads});")
                    for ln in body]
            body = self.ws_prologue + body
            if self.mc_cluster is not None:  # the consumers meet the peer CTA before exiting (remote arrivals)
                body.append("  tilehal::cluster_sync();")
        params = []
        for p in self.func.params:
            params.append(f"{cuda_type(p.dtype)}* __restrict__ {p.name}")
        for v in self.func.dynamic_vars:
            params.append(f"int {v.name}")
        for i, _ in enumerate(self.tma_specs):
            params.append(f"const __grid_constant__ tilehal::TmaDescriptor _tma{i}")
        # two blocks per SM when their shared memory fits twice and the fragments need few registers (one
        # block's loads and barriers then overlap the other's tensor-core work); ptxas keeps <= 65536 / (2 x
        # threads) registers per thread
        frag_regs = sum(f.nregs for b, f in self.inf.layouts.items() if b.scope == "fragment")
        frag_regs += sum(int(np.prod(a.buffer.static_shape() or (64,))) for a in self.all_stmts
                         if isinstance(a, Alloc) and a.buffer.scope == "local")
        two = (self.ws_loop is None and self.threads <= 512 and 2 * (smem_bytes + 1024) <= SMEM_LIMIT + 1024 and
               frag_regs + 48 <= 65536 // (2 * self.threads))
        if two:
            log.debug("%s: __launch_bounds__(%d, 2): %d B of shared memory, %d fragment registers per thread",
                      self.name, self.threads, smem_bytes, frag_regs)
        bounds = f"{self.threads}, 2" if two else f"{self.threads}"
        if self.ws_loop is not None:
            self.launch_threads = self.threads + (32 if self.ws_producer_warp else 128)
            bounds = f"{self.launch_threads}, 1"
            if self.ws_producer_warp:  # pass_configs cuda_ws_two_ctas (rules/pipelined.py)
                bounds = self._ws_two_ctas(bounds, smem_bytes, frag_regs)
        head = [f'extern "C" __global__ void __launch_bounds__({bounds}) {self.name}({", ".join(params)}) {{',
                "  extern __shared__ __align__(1024) unsigned char _tl_smem[];",
                "  const int _tx = threadIdx.x;"]
        if self.persistent_tiles:
            body = self._persistent_body(body)
        else:
            head += ["  " + ln for ln in self.block_index_lines(None)]
        for let in self.lets:
            head.append(f"  const {value_type(let.var.dtype)} {let.var.name} = {self.expr(let.value)};")
        head += ["  " + d for d in decls]
        src = "\n".join(head + body + ["}"])
        return src, smem_bytes


# statements at the uniform level of a kernel, and inside T.Parallel loops; the tile ops' rules are in rules/
register_rules("cuda", {Seq: seq_rule, Alloc: KernelCodegen.alloc, Let: KernelCodegen.let,
                        If: KernelCodegen.if_, For: KernelCodegen.for_, Store: KernelCodegen.store, **UNIFORM})
register_rules("cuda.parallel", {Seq: seq_rule, Store: KernelCodegen.par_store,
                                 Let: KernelCodegen.let, If: KernelCodegen.par_if, For: KernelCodegen.par_for,
                                 Alloc: KernelCodegen.par_alloc, **IN_PARALLEL})


def generate_cuda(func: PrimFunc, base_name: str, wgmma: bool = True, tma: dict | None = None,
                  use_tma: bool = True, one_barrier: bool = False, warp_specialize: bool = False,
                  launch: dict | None = None, persistent: bool = False,
                  pingpong: bool = False, overlap: bool = False,
                  multicast: bool = False, split_stages: bool = False,
                  two_ctas: bool = False, math: frozenset[str] = frozenset()) -> tuple[str, list[tuple[str, Kernel, int]]]:
    """CUDA source for every T.Kernel of `func`: (source, [(kernel name, Kernel node, smem bytes)]).
    `wgmma`: sm_90a features (T.gemm on wgmma, pipelined copies on TMA); otherwise mma.sync and cp.async
    only. `tma`, when given, receives {kernel name: [TmaSpec]} (the descriptors each kernel takes after
    its tensor and size parameters). `one_barrier`: see KernelCodegen (pass_configs cuda_wgmma_one_barrier).
    `warp_specialize`: TMA pipelines fed by a producer warpgroup; `persistent`: such kernels loop over their
    grid's tiles; `launch`, when given, receives {kernel name: [launch threads, persistent tiles or 0]} for the
    kernels that launch otherwise than their T.Kernel says (+ the producer's threads; min(tiles, SMs) blocks)."""
    body = func.body.body if isinstance(func.body, Seq) else [func.body]
    lets: list[Let] = []
    kernels = []
    parts = []
    uses_wgmma = uses_tma = uses_mc = False
    for s in body:
        if isinstance(s, Let):
            lets.append(s)
        elif isinstance(s, Kernel):
            name = f"{base_name}_k{len(kernels)}"
            cg = KernelCodegen(func, s, name, list(lets), wgmma=wgmma, tma=use_tma, one_barrier=one_barrier,
                               warp_specialize=warp_specialize, persistent=persistent, pingpong=pingpong,
                               overlap=overlap, multicast=multicast, split_stages=split_stages,
                               two_ctas=two_ctas, math=math)
            src, smem = cg.generate()
            if cg.ws_producer_warp and not cg.two_ctas_applied:  # cuda_ws_two_ctas did not fit: as without it
                cg = KernelCodegen(func, s, name, list(lets), wgmma=wgmma, tma=use_tma, one_barrier=one_barrier,
                                   warp_specialize=warp_specialize, persistent=persistent, pingpong=pingpong,
                                   overlap=overlap, multicast=multicast, split_stages=split_stages, math=math)
                src, smem = cg.generate()
            if launch is not None and cg.launch_threads:
                launch[name] = [cg.launch_threads, cg.persistent_tiles] + ([cg.mc_cluster] if cg.mc_cluster else [])
            uses_wgmma |= cg.has_wgmma
            uses_tma |= bool(cg.tma_specs)
            uses_mc |= cg.mc_cluster is not None
            if tma is not None:
                tma[name] = list(cg.tma_specs)
            parts.append(src)
            kernels.append((name, s, smem))
        elif isinstance(s, Seq) and not s.body:
            continue
        else:
            raise CompileError(f"cuda: statements outside T.Kernel ({type(s).__name__}) are not supported", s.loc)
    if not kernels:
        raise CompileError("cuda: the prim_func has no T.Kernel", func.loc)
    prelude = (PRELUDE + (WGMMA_PRELUDE if uses_wgmma else "") + (TMA_PRELUDE if uses_tma else "") +
               (MULTICAST_PRELUDE if uses_mc else "") + (FAST_EXP2_PRELUDE if "fast_exp2" in math else "") +
               (FMNMX_PRELUDE if "fmnmx" in math else ""))
    source = f"// generated by tilelang from {func.name}\n{prelude}\n" + "\n\n".join(parts) + "\n"
    return source, kernels


__all__ = ["KernelCodegen", "MATH_OPTIONS", "SMEM_LIMIT", "generate_cuda", "math_options"]

