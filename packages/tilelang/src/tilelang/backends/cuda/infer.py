"""Layout inference for the CUDA backend: which thread holds which element of every fragment.

Order (to a fixed point), as in the public TileLang: (1) every `T.gemm` plans its warps and, on
the tensor-core path, fixes its accumulator's layout (and an A operand held in registers);
(2) fragments read or written outside any tile op or `T.Parallel` loop are replicated in every
thread; (3) `T.Parallel` loops, reductions and fragment-to-fragment copies propagate known
layouts to the fragments they touch; (4) when nothing moves, the first unconstrained fragment
gets the default layout and (3) runs again. A conflict, or a fragment access that can only be
served by another thread's registers, is a CompileError naming the source line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ...errors import CompileError
from ...ir import dtypes as dt
from ...ir.layout import Axis, Fragment, default_fragment, mma_accumulator, replicated
from ...ir.nodes import (
    Buffer,
    Const,
    Copy,
    Expr,
    For,
    Gemm,
    Kernel,
    Load,
    Reduce,
    Region,
    Seq,
    Stmt,
    Store,
    TileOp,
    Var,
    register_rules,
)
from ...ir.visit import child_stmts, stmt_exprs, walk_expr, walk_stmts

log = logging.getLogger("tilelang.backends.cuda")

_MMA_K = {"float16": 16, "bfloat16": 16, "float8_e4m3": 32, "float8_e5m2": 32, "int8": 32}


@dataclass
class GemmPlan:
    kind: str  # "wgmma", "mma" or "simt"
    warps_m: int = 1  # wgmma: warpgroups along M
    warps_n: int = 1  # wgmma: warpgroups along N
    kstep: int = 16
    reason: str = ""
    a_major: str = "K"  # wgmma: "K" / "MN" (shared A) or "reg" (A in registers)
    b_major: str = "K"


def wgmma_smem_ok(r: Region, major: str) -> bool:
    """A shared operand wgmma can read through a descriptor: the whole 2-D buffer, its rows a multiple
    of 8, and the contiguous dim a whole number of 128-byte swizzle atoms (K-major rows may also be 64
    or 32 bytes: the 64 / 32-byte swizzle modes)."""
    b = r.buffer
    shape = b.static_shape()
    if b.scope != "shared" or shape is None or len(shape) != 2 or tuple(r.extents) != shape:
        return False
    if not all(isinstance(x, Const) and int(x.value) == 0 for x in r.starts):
        return False
    es = 1 if "8" in b.dtype else 2
    row_bytes = shape[1] * es
    if shape[0] % 8:
        return False
    if major == "MN":
        return row_bytes % 128 == 0
    return row_bytes % 128 == 0 or row_bytes in (64, 32)


def wgmma_accumulator(m: int, n: int, wg_m: int, wg_n: int, threads: int, *, a_operand: bool = False) -> Fragment:
    """The wgmma m64nN accumulator over a (wg_m x wg_n) grid of warpgroups (warpgroup g = tx // 128 at
    row g % wg_m, column g // wg_m), each holding an (m / wg_m) x (n / wg_n) tile as m64 blocks: warp w
    of a warpgroup owns rows 16 w .. 16 w + 15 of each block, registers in (block, n8, half, column)
    order, so block i's accumulators are registers [i * N / 2, (i + 1) * N / 2). With `a_operand`, the
    layout of an A operand in registers (K columns, not split over warpgroups). One warpgroup row of
    m64 blocks (m == 64 wg_m, wg_n == 1) is exactly mma_accumulator(m, n, m // 16, 1): the mma.sync and
    wgmma paths then agree on every fragment derived from it."""
    mw = m // wg_m
    nw = n if a_operand else n // wg_n
    if mw == 64 and (wg_n == 1 or a_operand):
        return mma_accumulator(m, n, m // 16, 1, threads, n_warp_split=not a_operand)
    ri, rj = Axis("r", mw // 64, 64), Axis("r", nw // 8, 8)
    rh, rc = Axis("r", 2, 8), Axis("r", 2, 1)
    d0 = [Axis("t", wg_m, mw, 128), ri, Axis("t", 4, 16, 32), rh, Axis("t", 8, 1, 4)]
    d1 = [Axis("t", 1 if a_operand else wg_n, nw, 128 * wg_m), rj, Axis("t", 4, 2, 1), rc]
    d0 = [a for a in d0 if a.extent > 1]
    d1 = [a for a in d1 if a.extent > 1]
    order = [(d, a) for d, a in [(0, ri), (1, rj), (0, rh), (1, rc)] if a.extent > 1]
    return Fragment((m, n), (tuple(d0), tuple(d1)), tuple(order), threads)


@dataclass
class ParallelNest:
    loop: For
    vars: list[Var]
    extents: list[int | None]
    body: Stmt
    layout: Fragment | None = None  # None: a flat thread-strided loop (no fragment inside)
    frag_access: list[tuple[Buffer, list[Expr]]] = field(default_factory=list)


def parallel_nest(s: For) -> tuple[list[Var], list[Expr], Stmt]:
    vars_, exts = [], []
    while isinstance(s, For) and s.kind == "parallel":
        vars_.append(s.var)
        exts.append(s.extent)
        s = s.body
        if isinstance(s, Seq) and len(s.body) == 1 and isinstance(s.body[0], For) and s.body[0].kind == "parallel":
            s = s.body[0]
    return vars_, exts, s


def _static(e: Expr) -> int | None:
    return int(e.value) if isinstance(e, Const) else None


def frag_accesses(body: Stmt) -> list[tuple[Buffer, list[Expr]]]:
    out = []
    for st in walk_stmts(body):
        if isinstance(st, Store) and st.buffer.scope == "fragment":
            out.append((st.buffer, st.indices))
        for e in stmt_exprs(st):
            for x in walk_expr(e):
                if isinstance(x, Load) and x.buffer.scope == "fragment":
                    out.append((x.buffer, x.indices))
    return out


def _warp_grid(m: int, n: int, warps: int, policy: str, n_align: int = 16) -> tuple[int, int] | None:
    """(warps_m, warps_n) splitting an m x n accumulator into 16 x n_align pieces; all warps if possible
    (a grid of fewer warps leaves the others computing replicas)."""
    best = None
    for wm in range(1, warps + 1):
        for wn in range(1, warps // wm + 1):
            if warps % (wm * wn) or m % (16 * wm) or n % (n_align * wn):
                continue
            if policy == "FullRow":
                pol = (-wm, 0.0)
            elif policy == "FullCol":
                pol = (-wn, 0.0)
            else:
                ratio = (m / wm) / (n / wn)
                pol = (0, abs(ratio - 1.0) if ratio >= 1 else abs(1.0 / ratio - 1.0))
            score = (-(wm * wn), *pol)
            if best is None or score < best[0]:
                best = (score, (wm, wn))
    return best[1] if best else None


def _region_2d_ok(r: Region) -> bool:
    """A shared operand ldmatrix can read: 16-byte rows, the tile's columns in the buffer's last dim."""
    rd, cd = r.matrix_dims()
    nd = r.buffer.ndim
    if cd != nd - 1 or rd < 0:
        return False
    shape = r.buffer.static_shape()
    if shape is None:
        return False
    esize = 1 if "8" in r.buffer.dtype else 2
    ve = 16 // esize
    if (shape[-1] * esize) % 16:
        return False
    start = r.starts[cd]
    return isinstance(start, Const) and int(start.value) % ve == 0


def _wgmma_plan(g: Gemm, threads: int) -> tuple[GemmPlan | None, str]:
    """wgmma.mma_async (sm_90a) when the shapes and layouts allow it, else (None, why not)."""
    a, b, c = g.A.buffer, g.B.buffer, g.C.buffer
    if a.dtype != b.dtype or a.dtype not in ("float16", "bfloat16", "float8_e4m3"):
        return None, f"wgmma is emitted for fp16 / bf16 / fp8 e4m3 inputs, not {a.dtype} x {b.dtype}"
    if c.dtype != "float32":
        return None, f"wgmma accumulates in float32, the accumulator is {c.dtype}"
    if threads % 128:
        return None, f"threads={threads} is not a whole number of warpgroups (128)"
    m, n = g.C.as_2d()
    kdim = g.A.as_2d()[0] if g.transpose_A else g.A.as_2d()[1]
    kstep = 32 if a.dtype == "float8_e4m3" else 16
    if kdim % kstep:
        return None, f"K={kdim} is not a multiple of {kstep}"
    if kstep == 32 and (g.transpose_A or not g.transpose_B or a.scope != "shared"):
        return None, "fp8 wgmma needs A and B K-major in shared memory (transpose_B=True, A not transposed)"
    b_major = "K" if g.transpose_B else "MN"
    if not wgmma_smem_ok(g.B, b_major):
        return None, f"B ({b.name}) is not a whole {b_major}-major shared tile with 128-byte swizzle atoms"
    if a.scope == "fragment":
        if g.transpose_A:
            return None, "an A operand in registers must not be transposed"
        a_major = "reg"
    else:
        a_major = "MN" if g.transpose_A else "K"
        if not wgmma_smem_ok(g.A, a_major):
            return None, f"A ({a.name}) is not a whole {a_major}-major shared tile with 128-byte swizzle atoms"
    ng = threads // 128
    if m % 64:
        return None, f"M={m} is not a multiple of 64"
    # warpgroups along M first (each reads its own A rows; FullCol: along N first), the rest along N
    cands = [d for d in range(ng, 0, -1) if ng % d == 0 and m % (64 * d) == 0]
    if g.policy == "FullCol":
        cands.reverse()
    why = f"M={m} x N={n} does not split over {ng} warpgroups"
    for wg_m in cands:
        wg_n = ng // wg_m
        nw = n // wg_n
        if a_major == "reg" and wg_n != 1:
            why = "an A operand in registers needs the warpgroups split along M only"
        elif n % (8 * wg_n):
            why = f"N={n} does not split into n8 pieces over {wg_n} warpgroups"
        elif b_major == "MN" and nw % 64:
            why = f"an N-major B needs N per warpgroup ({nw}) in whole 64-element swizzle atoms"
        elif nw > 256 and nw % 256:
            why = f"N per warpgroup ({nw}) is over 256 and not a multiple of it"
        else:
            return GemmPlan("wgmma", wg_m, wg_n, kstep, a_major=a_major, b_major=b_major), ""
    return None, why


def plan_gemm(g: Gemm, threads: int, allow_wgmma: bool = True) -> GemmPlan:
    a, b, c = g.A.buffer, g.B.buffer, g.C.buffer
    if a.dtype != b.dtype and not (dt.is_float(a.dtype) and dt.is_float(b.dtype) and
                                    "float32" in (a.dtype, b.dtype)):
        if {a.dtype, b.dtype} <= set(_MMA_K):
            raise CompileError(f"T.gemm: A is {a.dtype} and B is {b.dtype}; the tensor cores need one input type "
                               f"(cast one operand)", g.loc)
    if c.scope != "fragment":
        raise CompileError(f"T.gemm: the accumulator {c.name} must be a T.alloc_fragment buffer on cuda, got "
                           f"scope {c.scope}", g.loc)
    m, n = g.C.as_2d()
    kdim = g.A.as_2d()[0] if g.transpose_A else g.A.as_2d()[1]
    warps = threads // 32

    def simt(why: str) -> GemmPlan:
        log.debug("%s: T.gemm %s x %s -> %s runs on CUDA cores: %s", g.loc, a.dtype, b.dtype, c.dtype, why)
        # an accumulator-shaped layout when the tile allows: row vectors reduced from two gemms agree
        grid = _warp_grid(m, n, warps, g.policy, n_align=8)
        return GemmPlan("simt", grid[0] if grid else 0, grid[1] if grid else 0, reason=why)

    use = g.options.get("use_wgmma")
    if use is not None and not use:
        log.debug("%s: T.gemm(use_wgmma=False): mma.sync", g.loc)
    elif use and not allow_wgmma:
        log.debug("%s: T.gemm(use_wgmma=True): this target has no wgmma (not sm_90a, tl.disable_wgmma, or "
                  "cuda_emu): mma.sync", g.loc)
    if allow_wgmma and use is not False:
        plan, why = _wgmma_plan(g, threads)
        if plan is not None:
            log.debug("%s: T.gemm %s %dx%dx%d -> wgmma.mma_async (A %s, B %s-major, warpgroups %dx%d)", g.loc,
                      a.dtype, m, n, kdim, plan.a_major, plan.b_major, plan.warps_m, plan.warps_n)
            return plan
        if use:
            raise CompileError(f"T.gemm(use_wgmma=True): this gemm cannot run on wgmma: {why}", g.loc)
        log.debug("%s: T.gemm %s %dx%dx%d -> not wgmma: %s", g.loc, a.dtype, m, n, kdim, why)
    if a.dtype != b.dtype or a.dtype not in _MMA_K:
        return simt(f"no mma.sync for {a.dtype} x {b.dtype}")
    want_acc = "int32" if a.dtype == "int8" else "float32"
    if c.dtype != want_acc:
        return simt(f"mma.sync accumulates {a.dtype} in {want_acc}, the accumulator is {c.dtype}")
    kstep = _MMA_K[a.dtype]
    if kdim % kstep:
        return simt(f"K={kdim} is not a multiple of {kstep}")
    if kstep == 32 and (g.transpose_A or not g.transpose_B):
        return simt("8-bit mma.sync needs A row-major and B K-major (transpose_B=True)")
    if b.scope != "shared" or not _region_2d_ok(g.B):
        return simt(f"B ({b.name}, {b.scope}) is not a 16-byte-row shared tile")
    if a.scope == "shared":
        if not _region_2d_ok(g.A):
            return simt(f"A ({a.name}) is not a 16-byte-row shared tile")
    elif a.scope == "fragment":
        if g.transpose_A or kstep != 16:
            return simt("an A operand in registers must be 16-bit and not transposed")
    else:
        return simt(f"A is in {a.scope} memory")
    grid = _warp_grid(m, n, warps, g.policy)
    if grid is None:
        return simt(f"a {m}x{n} tile does not split into 16x16 pieces over {warps} warps")
    return GemmPlan("mma", grid[0], grid[1], kstep)


class LayoutInference:
    def __init__(self, kernel: Kernel, allow_wgmma: bool = True) -> None:
        self.kernel = kernel
        self.allow_wgmma = allow_wgmma
        self.threads = 1
        for t in kernel.threads:
            self.threads *= int(t)
        self.layouts: dict[Buffer, Fragment] = {}
        self.origin: dict[Buffer, str] = {}
        self.gemms: dict[int, GemmPlan] = {}
        self.nests: dict[int, ParallelNest] = {}
        self.uniform: set[Buffer] = set()
        self.fragments: list[Buffer] = []
        self.ops: list[Stmt] = []  # reduce / fragment copies, in program order

    # ------------------------------------------------------------ entry

    def run(self) -> LayoutInference:
        self._collect(self.kernel.body)
        for g in [s for s in walk_stmts(self.kernel.body) if isinstance(s, Gemm)]:
            plan = plan_gemm(g, self.threads, self.allow_wgmma)
            self.gemms[id(g)] = plan
            if plan.kind == "wgmma":
                m, n = g.C.as_2d()
                self._assign(g.C.buffer, wgmma_accumulator(m, n, plan.warps_m, plan.warps_n, self.threads),
                             g.loc, "T.gemm accumulator")
                if g.A.buffer.scope == "fragment":
                    k = g.A.as_2d()[1]
                    self._assign(g.A.buffer, wgmma_accumulator(m, k, plan.warps_m, 1, self.threads, a_operand=True),
                                 g.loc, "T.gemm A operand")
                continue
            if plan.kind == "simt" and plan.warps_m:
                m, n = g.C.as_2d()
                self._assign(g.C.buffer, mma_accumulator(m, n, plan.warps_m, plan.warps_n, self.threads),
                             g.loc, "T.gemm accumulator")
            if plan.kind == "mma":
                m, n = g.C.as_2d()
                self._assign(g.C.buffer, mma_accumulator(m, n, plan.warps_m, plan.warps_n, self.threads),
                             g.loc, "T.gemm accumulator")
                if g.A.buffer.scope == "fragment":
                    k = g.A.as_2d()[1]
                    self._assign(g.A.buffer, mma_accumulator(m, k, plan.warps_m, plan.warps_n, self.threads,
                                                             n_warp_split=False), g.loc, "T.gemm A operand")
        for b in self.uniform:
            if b not in self.layouts:
                self._assign(b, replicated(b.static_shape(), self.threads), None, "scalar use")
        while True:
            self._propagate()
            pending = [b for b in self.fragments if b not in self.layouts]
            if not pending:
                break
            if not self._default_for_loop():
                b = pending[0]
                self._assign(b, default_fragment(b.static_shape(), self.threads, self._vec(b)), None, "default")
        for nest in self.nests.values():
            if nest.frag_access and nest.layout is None:
                self._resolve_nest(nest, final=True)
        return self

    def _vec(self, b: Buffer) -> int:
        size = 1 if "8" in b.dtype and b.dtype != "float16" else (2 if b.dtype in ("float16", "bfloat16") else 4)
        return max(1, 16 // size) if size < 4 else 4

    # ------------------------------------------------------------ collection

    def _collect(self, s: Stmt) -> None:
        from ...ir.nodes import Alloc

        if isinstance(s, Alloc) and s.buffer.scope == "fragment":
            if s.buffer.static_shape() is None:
                raise CompileError(f"fragment {s.buffer.name} needs a static shape on cuda", s.loc)
            self.fragments.append(s.buffer)
        if isinstance(s, For) and s.kind == "parallel":
            vars_, exts, body = parallel_nest(s)
            nest = ParallelNest(s, vars_, [_static(e) for e in exts], body, frag_access=frag_accesses(body))
            self.nests[id(s)] = nest
            for st in walk_stmts(body):
                if isinstance(st, Alloc) and st.buffer.scope == "fragment":
                    self.fragments.append(st.buffer)
                    self.uniform.add(st.buffer)
            return
        if s.rule("cuda.layout") is not None:
            self.ops.append(s)
        if not isinstance(s, TileOp):  # tile ops access fragments through their own rules
            for e in stmt_exprs(s):
                for x in walk_expr(e):
                    if isinstance(x, Load) and x.buffer.scope == "fragment":
                        self.uniform.add(x.buffer)
            if isinstance(s, Store) and s.buffer.scope == "fragment":
                self.uniform.add(s.buffer)
        for c in child_stmts(s):
            self._collect(c)

    # ------------------------------------------------------------ assignment

    def _assign(self, b: Buffer, f: Fragment, loc, why: str) -> None:
        old = self.layouts.get(b)
        if old is None:
            self.layouts[b] = f
            self.origin[b] = why
            return
        if not old.same_mapping(f):
            raise CompileError(f"cannot infer a layout for fragment {b.name}: the {self.origin[b]} needs {old}, "
                               f"this use ({why}) needs {f}", loc)

    # ------------------------------------------------------------ propagation

    def _propagate(self) -> None:
        changed = True
        while changed:
            before = len(self.layouts)
            for nest in self.nests.values():
                if nest.frag_access and nest.layout is None:
                    self._resolve_nest(nest)
            for op in self.ops:
                self._op(op)
            changed = len(self.layouts) != before

    def _access_dims(self, nest: ParallelNest, b: Buffer, idx: list[Expr]) -> list[int | None]:
        """Loop position of each index (None when the index is not a bare loop variable of the nest)."""
        pos = []
        for d, i in enumerate(idx):
            if isinstance(i, Var) and i in nest.vars:
                p = nest.vars.index(i)
                shape = b.static_shape()
                pos.append(p if nest.extents[p] == shape[d] else None)
            else:
                pos.append(None)
        return pos

    def _resolve_nest(self, nest: ParallelNest, final: bool = False) -> None:
        if any(e is None for e in nest.extents):
            loc = nest.loop.loc
            raise CompileError("T.Parallel over fragments needs static extents on cuda", loc)
        layout = None
        # a full-rank access whose layout is known fixes the loop's layout
        for b, idx in nest.frag_access:
            pos = self._access_dims(nest, b, idx)
            if b in self.layouts and None not in pos and len(set(pos)) == len(nest.vars) == len(pos):
                inv = [pos.index(p) for p in range(len(pos))]
                layout = self.layouts[b].permute(inv)
                break
        if layout is None:
            for b, idx in nest.frag_access:
                f = self.layouts.get(b)
                pos = self._access_dims(nest, b, idx)
                if f is None or None in pos:
                    continue
                if len(f.dims) == 0 or all(f.register_only(d) for d in range(len(f.dims))):
                    continue
                par = f.parent
                if par is not None and len(par.shape) == len(nest.vars):
                    # the loop runs over the tile this fragment was reduced from
                    guess = {f.parent_dims[d]: p for d, p in enumerate(pos)}
                    if len(guess) == len(pos) and all(par.shape[pd] == nest.extents[p] for pd, p in guess.items()):
                        rest = [p for p in range(len(nest.vars)) if p not in guess.values()]
                        rest_d = [d for d in range(len(par.shape)) if d not in guess]
                        guess.update(zip(rest_d, rest))
                        perm = [0] * len(nest.vars)
                        for pd, p in guess.items():
                            perm[p] = pd
                        layout = par.permute(perm)
                        break
        if layout is None:
            accessed = {b for b, _ in nest.frag_access}
            if all(b in self.layouts and all(self.layouts[b].register_only(d) for d in range(b.ndim))
                   for b in accessed):
                layout = replicated(tuple(nest.extents), self.threads)
            elif final:
                layout = default_fragment(tuple(nest.extents), self.threads, min(self._vec(b) for b in accessed))
            else:
                return
        nest.layout = layout
        for b, idx in nest.frag_access:
            pos = self._access_dims(nest, b, idx)
            known = self.layouts.get(b)
            if None in pos or len(set(pos)) != len(pos):
                if known is None:
                    self._assign(b, replicated(b.static_shape(), self.threads), nest.loop.loc, "indexed access")
                    known = self.layouts[b]
                for d, p in enumerate(pos):
                    if p is None and not known.register_only(d):
                        raise CompileError(f"cannot infer a layout for fragment {b.name}: index {d} of this access "
                                           f"is not a loop variable, and that dim is spread over threads "
                                           f"({known})", nest.loop.loc)
                continue
            self._assign(b, layout.project(pos) if len(pos) < len(nest.vars) else layout.permute(pos),
                         nest.loop.loc, "T.Parallel loop")

    def _default_for_loop(self) -> bool:
        """Give a default layout to the largest unconstrained fragment some unresolved loop reads or
        writes in full (smaller ones usually derive from it: row vectors reduced from a tile), else a
        default over the first unresolved loop itself (its fragments all being row/column vectors)."""
        best = None
        for nest in self.nests.values():
            if not nest.frag_access or nest.layout is not None:
                continue
            for b, idx in nest.frag_access:
                pos = self._access_dims(nest, b, idx)
                if b not in self.layouts and None not in pos and len(set(pos)) == len(nest.vars) == len(pos):
                    key = (b.ndim, int(np.prod(b.static_shape())))
                    if best is None or key > best[0]:
                        best = (key, b, nest)
        if best is not None:
            _, b, nest = best
            self._assign(b, default_fragment(b.static_shape(), self.threads, self._vec(b)), nest.loop.loc, "default")
            return True
        for nest in self.nests.values():
            if not nest.frag_access or nest.layout is not None:
                continue
            if all(b not in self.layouts for b, _ in nest.frag_access):
                vec = min(self._vec(b) for b, _ in nest.frag_access)
                nest.layout = default_fragment(tuple(nest.extents), self.threads, vec)
                for b, idx in nest.frag_access:
                    pos = self._access_dims(nest, b, idx)
                    if None in pos:
                        continue
                    self._assign(b, nest.layout.project(pos), nest.loop.loc, "T.Parallel loop")
                return True
        return False

    def _op(self, s: Stmt) -> None:
        s.rule("cuda.layout")(self, s)

    # ------------------------------------------------------------ rules (the "cuda.layout" table)

    def reduce_layout(self, s: Reduce) -> None:
        src, dst = s.src, s.dst
        if src.scope != "fragment":
            return
        fs, fd = self.layouts.get(src), self.layouts.get(dst)
        keep = [d for d in range(src.ndim) if d != s.dim]
        if fs is not None:
            proj = fs.project(keep)
            if dst.ndim == src.ndim:
                proj = proj.with_unit_dim(s.dim)
            if dst.scope == "fragment":
                self._assign(dst, proj, s.loc, f"T.reduce of {src.name}")
        elif fd is not None and fd.parent is not None and fd.parent.shape == src.static_shape():
            self._assign(src, fd.parent, s.loc, f"T.reduce into {dst.name}")

    def copy_layout(self, s: Copy) -> None:
        a, b = s.src.buffer, s.dst.buffer
        if a.scope != "fragment" or b.scope != "fragment":
            return  # only fragment -> fragment copies carry a layout across
        if tuple(s.src.extents) != a.static_shape() or tuple(s.dst.extents) != b.static_shape():
            return
        if a in self.layouts and b not in self.layouts:
            self._assign(b, self.layouts[a], s.loc, f"T.copy from {a.name}")
        elif b in self.layouts and a not in self.layouts:
            self._assign(a, self.layouts[b], s.loc, f"T.copy to {b.name}")
        elif a in self.layouts and b in self.layouts and not self.layouts[a].same_mapping(self.layouts[b]):
            log.debug("%s: T.copy %s -> %s between different layouts: goes through shared memory", s.loc,
                      a.name, b.name)


# how layouts propagate through tile ops (gemm accumulators are fixed first, in LayoutInference.run)
register_rules("cuda.layout", {Reduce: LayoutInference.reduce_layout, Copy: LayoutInference.copy_layout})


def infer_layouts(kernel: Kernel, allow_wgmma: bool = True) -> LayoutInference:
    return LayoutInference(kernel, allow_wgmma).run()


__all__ = ["GemmPlan", "wgmma_accumulator", "wgmma_smem_ok", "LayoutInference", "ParallelNest", "frag_accesses", "infer_layouts", "parallel_nest",
           "plan_gemm"]

