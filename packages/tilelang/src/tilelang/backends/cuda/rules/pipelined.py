"""CUDA lowering of T.Pipelined(num_stages>=2): cp.async multi-buffer prefetch of global->shared copies."""

from __future__ import annotations

import numpy as np

from ....ir.nodes import Alloc, Buffer, Const, Copy, Expr, For, Gemm, If, Kernel, Let, Load, Seq, Var
from ....ir.thread import AsyncCommit, AsyncWait, Intrinsic, Scope
from ....ir.visit import walk_expr, walk_stmts
from ..common import SMEM_LIMIT, esize, log
from ..emit import Comment, MbarArray, MbarArriveExpectTx, MbarInitAll, MbarRef, MbarWait
from ..lower_thread import TX, B, C, P


class PipelineRules:
    def _async_wgmma(self, rest: list, copies: list) -> Gemm | None:
        """The loop's last statement when it is a wgmma whose accumulator nothing else in the loop touches
        and whose operands only the pipelined copies write: its wgmma group may then stay in flight into
        the next iteration (invisible to the program: the accumulator is read after the loop, where the
        group is waited for)."""
        if not rest or not isinstance(rest[-1], Gemm) or self.inf.gemms[id(rest[-1])].kind != "wgmma":
            return None
        g = rest[-1]
        filled = {c.dst.buffer for c in copies}
        others = rest[:-1]
        if any(g.C.buffer in self.reads(o) or g.C.buffer in self.writes(o) for o in others):
            log.debug("%s: wgmma waits for itself: the loop reads its accumulator %s", g.loc, g.C.buffer.name)
            return None
        for r in (g.A, g.B):
            b = r.buffer
            if b.scope != "shared" or (b not in filled and any(b in self.writes(o) for o in others)):
                log.debug("%s: wgmma waits for itself: operand %s is written in the loop", g.loc, b.name)
                return None
        log.debug("%s: T.gemm on wgmma stays in flight across T.Pipelined iterations (one group)", g.loc)
        return g

    def _read_only_global(self, buf: Buffer) -> bool:
        """A global tensor no statement of the kernel writes."""
        return buf.scope == "global" and not any(buf in self.writes(st) for st in self.all_stmts
                                                 if not isinstance(st, (Seq, For, If, Kernel)))

    def _plan_pipelines(self) -> None:
        self.pipes: dict[int, list[Copy]] = {}
        self.stages: dict[Buffer, int] = {}
        all_stmts = self.all_stmts
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
            candidates = []
            for c in body:
                if not (isinstance(c, Copy) and self._async_copy_ok(c)):
                    continue
                free = {x for e in c.src.starts for x in walk_expr(e) if isinstance(x, (Var, Load))}
                # a load from a global tensor the kernel never writes (a page table) is the same value when the
                # prefetch evaluates it for a later iteration: allowed, its indices checked with the rest
                if any(isinstance(x, Load) and not self._read_only_global(x.buffer) for x in free) \
                        or (free & local_vars):
                    log.debug("%s: T.copy into %s not pipelined: its source depends on values computed in the loop",
                              c.loc, c.dst.buffer.name)
                    continue
                candidates.append(c)
            for i, c in enumerate(body):
                if not any(c is x for x in candidates):
                    continue
                buf = c.dst.buffer
                # several copies of this loop may fill parts of one buffer (a KV tile gathered page by page)
                others = [st for st in all_stmts if st is not c and not isinstance(st, (Seq, For, If, Kernel))
                          and not any(st is x for x in candidates) and (buf in self.writes(st))]
                outside = [st for st in all_stmts if id(st) not in inside and not isinstance(st, (Seq, For, If, Kernel))
                           and not isinstance(st, Alloc) and (buf in self.reads(st) or buf in self.writes(st))]
                before = [st for st in body[:i] if buf in self.reads(st)]
                if others or outside or before:
                    log.debug("%s: T.copy into %s not pipelined: the buffer is used outside this loop or written "
                              "elsewhere", c.loc, buf.name)
                    continue
                chosen.append(c)
                self.stages[buf] = n
            if chosen:
                self.pipes[id(loop)] = chosen
                for c in chosen:
                    plan = self._tma_plan(c)
                    if plan is not None:
                        self.tma_plans[id(c)] = plan
            else:
                log.debug("%s: T.Pipelined(num_stages=%d) has no global->shared copy to prefetch; runs serially",
                          loop.loc, n)
        self._plan_block_order()
        if self.warp_specialize:
            self._plan_ws()

    def _plan_block_order(self) -> None:
        """Longest blocks first: when the trip count of a pipelined loop at the top of the kernel body grows
        with a block index (causal attention: query block bx runs ~bx + 1 KV blocks), that index is dispatched
        from its largest value down, so the long blocks start in the first waves and the short ones fill the
        tail. Blocks are independent, so any order gives the same result; evaluated with the interpreter at
        the index's two ends (the other block indices 0, the top-level lets before the loop computed)."""
        self.block_reverse: int | None = None
        k = self.kernel
        if not all(isinstance(g, Const) for g in k.grid) or not k.block_vars:
            return
        from ...interp import Interpreter

        seq: list = []

        def flat(x) -> None:
            for st in (x.body if isinstance(x, Seq) else [x]):
                if isinstance(st, Seq):
                    flat(st)
                else:
                    seq.append(st)

        flat(k.body)

        def trips(env: dict, loop: For):
            it = Interpreter.__new__(Interpreter)
            it.env = dict(env)
            it.bufs = {}
            try:
                for st in seq:
                    if st is loop:
                        return int(it.expr(loop.extent))
                    if isinstance(st, Let):
                        it.env[st.var] = it.expr(st.value)
            except Exception:  # a value the interpreter cannot compute without the kernel's data
                return None
            return None

        best = (0, None)
        for loop in seq:
            if not (isinstance(loop, For) and id(loop) in self.pipes):
                continue
            for i, (v, g) in enumerate(zip(k.block_vars, k.grid)):
                n = int(g.value)
                if n < 2:
                    continue
                base = {b: 0 for b in k.block_vars} | {lt.var: 0 for lt in self.lets}
                lo, hi = trips({**base, v: 0}, loop), trips({**base, v: n - 1}, loop)
                if lo is not None and hi is not None and hi - lo > best[0]:
                    best = (hi - lo, i)
        if best[1] is not None:
            self.block_reverse = best[1]
            log.debug("%s: block index %s dispatched from its largest value down (the pipelined loop runs %d more "
                      "iterations at its end than at 0)", k.loc, k.block_vars[best[1]].name, best[0])

    def _plan_ws(self) -> None:
        """pass_configs cuda_warp_specialize: the kernel's one TMA pipeline is fed by a producer warpgroup
        (threads T .. T+127; one thread issues every stage's loads as soon as the consumers released it on
        the stage's `empty` mbarrier) while the T.Kernel's T threads (whole warpgroups) consume: wait for the
        stage's `full` mbarrier, compute, release. No block-wide barrier per iteration is left; the
        consumers' own barriers become named barrier 1 over T threads, and with T + 128 > 256 threads the
        producer gives its registers to the consumers (setmaxnreg 40 / 232 or 240). The producer's loop runs
        before the kernel body (it must not execute the body's thread-distributed statements), so the loop
        bounds and the copies' coordinates may use only block indices, top-level lets and the loop index."""
        k = self.kernel

        def no(why: str) -> None:
            log.debug("%s: no warp specialization: %s", k.loc, why)

        loops = [lp for lp in self.all_stmts if isinstance(lp, For) and id(lp) in self.pipes]
        if len(loops) != 1:
            return no(f"{len(loops)} pipelined loops with prefetched copies (one is handled)")
        loop = loops[0]
        copies = self.pipes[id(loop)]
        if any(id(c) not in self.tma_plans for c in copies):
            return no("a pipelined copy is not on TMA")
        if not self.has_wgmma:
            return no("no wgmma in the kernel")
        if self.threads % 128 or self.threads + 128 > 1024:
            return no(f"threads={self.threads} is not whole warpgroups (or too many with a producer)")

        def top(seq) -> bool:  # the loop sits in the kernel body's statement lists, under no if / loop
            body = seq.body if isinstance(seq, Seq) else [seq]
            return any(st is loop or (isinstance(st, Seq) and top(st)) for st in body)

        if not top(k.body):
            return no("the pipelined loop is nested in a loop or an if")
        allowed = set(k.block_vars) | {lt.var for lt in self.lets} | set(self.func.dynamic_vars) | {loop.var}
        # lets of the kernel body before the loop (`loop_range = T.min(...)`) are re-evaluated by the producer
        top_lets: dict[Var, Let] = {}

        def collect(seq) -> bool:
            for st in (seq.body if isinstance(seq, Seq) else [seq]):
                if st is loop:
                    return True
                if isinstance(st, Let):
                    top_lets[st.var] = st
                elif isinstance(st, Seq) and collect(st):
                    return True
            return False

        collect(k.body)
        need: list[Let] = []

        def ok(e) -> bool:
            for x in walk_expr(e):
                if isinstance(x, Load):
                    return False
                if isinstance(x, Var) and x not in allowed:
                    lt = top_lets.get(x)
                    if lt is None or not ok(lt.value):
                        return False
                    allowed.add(x)
                    need.append(lt)
            return True

        exprs = [loop.start, loop.extent] + [e for c in copies for e in c.src.starts]
        if not all(ok(e) for e in exprs):
            return no("the loop bounds or a copy's coordinates use values computed in the kernel")
        self.ws_lets = need
        if self.persistent:
            if all(isinstance(g, Const) for g in k.grid):
                self.persistent_tiles = int(np.prod([int(g.value) for g in k.grid]))
                log.debug("%s: persistent: min(%d tiles, SMs) blocks loop over the grid's tiles", k.loc,
                          self.persistent_tiles)
            else:
                log.debug("%s: not persistent: the grid is not constant", k.loc)
        log.debug("%s: warp-specialized: a producer warpgroup issues the TMA loads of T.Pipelined, %d consumer "
                  "threads", loop.loc, self.threads)
        self.ws_loop = loop
        if self.ws_multicast:
            self._plan_multicast(loop, copies)

    def _plan_multicast(self, loop: For, copies: list) -> None:
        """pass_configs cuda_ws_multicast: clusters of 2 CTAs along the grid's second dim (blockIdx.y pairs) share
        the tile of a pipelined copy whose coordinates do not use the second block index (a GEMM's B tile when
        by indexes M): each CTA's producer loads half of its rows and multicasts them to both CTAs, so each
        tile is read from L2 once per pair. The pair's block indices come from a grid of half the rows of CTA
        pairs (through T.use_swizzle's panels), the second one as 2 * pair + rank; a stage is refilled once the
        consumers of both CTAs released it (each consumer warp arrives on both CTAs' `empty` barriers); the CTAs
        of a cluster meet at the start (barriers initialized) and at the end (no remote arrival after exit)."""
        k = self.kernel

        def no(why: str) -> None:
            log.debug("%s: no TMA multicast: %s", k.loc, why)

        if self.persistent:
            return no("a persistent kernel")
        if len(k.block_vars) < 2 or not all(isinstance(g, Const) for g in k.grid):
            return no("fewer than two block indices or a grid that is not constant")
        if int(k.grid[1].value) % 2:
            return no(f"the grid's second dim ({int(k.grid[1].value)}) is odd")
        if getattr(self, "block_reverse", None) is not None:
            return no("the blocks are dispatched longest first")
        vy = k.block_vars[1]
        bounds = self._copy_coords_of([loop.start, loop.extent])
        if any(x is vy for e in bounds for x in walk_expr(e)):
            return no("the loop's trip count depends on the second block index (the pair must run it alike)")
        shared = [c for c in copies if not any(x is vy for e in self._copy_coords(c) for x in walk_expr(e))]
        if len(shared) != 1 or len(shared) == len(copies):
            return no("not exactly one pipelined copy whose tile is the same for both CTAs of a pair")
        c = shared[0]
        plan = self.tma_plans[id(c)]
        rows = plan["spec"].box_rows
        half = rows // 2
        if rows % 2 or (half * plan["spec"].box_cols * esize(plan["spec"].dtype)) % 1024:
            return no(f"the shared tile's {rows} rows do not halve on 1 KiB boundaries (the swizzle's period)")
        spec = plan["spec"]
        from .tma import TmaSpec

        plan["spec"] = TmaSpec(spec.param, spec.dtype, half, spec.box_cols, spec.swizzle)
        self.tma_specs[plan["index"]] = plan["spec"]
        plan["multicast"] = (3, half, "_cta_rank")
        self.mc_cluster = [1, 2, 1]
        log.debug("%s: TMA multicast: clusters of 2 CTAs (blockIdx.y pairs) share T.copy %s -> %s, each loading "
                  "%d of its %d rows", c.loc, c.src.buffer.name, c.dst.buffer.name, half, rows)

    def _ws_two_ctas(self, bounds: str, smem_bytes: int, frag_regs: int) -> str:
        """pass_configs cuda_ws_two_ctas: two warp-specialized CTAs per SM (`__launch_bounds__(T + 32, 2)`) when
        their shared memory fits twice and the consumers' fragments fit the registers: one CTA's pipeline fill and
        epilogue then run while the other's main loop keeps the tensor cores busy (a persistent kernel hides the
        fill only). The producer is one warp, not a warpgroup, and nobody changes registers (no setmaxnreg): ptxas
        compiles the whole kernel for the launch's r0 = 65536 / (2 (T + 32)) registers per thread (with a producer
        warpgroup two CTAs would get 80 for T = 256: too few for one m64n128 wgmma; 112 with a warp). The caller
        (generate_cuda) builds the kernel again without the option when this returns `bounds` unchanged."""
        k = self.kernel

        def no(why: str) -> str:
            log.debug("%s: one warp-specialized CTA per SM (cuda_ws_two_ctas not applied): %s", k.loc, why)
            return bounds

        if 2 * (smem_bytes + 1024) > SMEM_LIMIT + 1024:
            return no(f"{smem_bytes} B of shared memory per CTA do not fit twice in an SM")
        lt = self.launch_threads
        r0 = 65536 // (2 * lt) // 8 * 8
        if frag_regs + 32 > r0:
            return no(f"{frag_regs} fragment registers per consumer thread do not fit {r0} (two CTAs per SM)")
        self.two_ctas_applied = True
        log.debug("%s: two warp-specialized CTAs per SM (a producer warp): %d B of shared memory each, %d registers "
                  "per thread (%d fragment registers)", k.loc, smem_bytes, r0, frag_regs)
        return f"{lt}, 2"

    def _copy_coords(self, c: Copy) -> list:
        """The expressions a pipelined copy's source coordinates depend on (lets of the body resolved)."""
        return self._copy_coords_of(list(c.src.starts))

    def _copy_coords_of(self, exprs: list) -> list:
        out, todo = [], list(exprs)
        lets = {lt.var: lt.value for lt in self.ws_lets}
        seen: set = set()
        while todo:
            e = todo.pop()
            out.append(e)
            for x in walk_expr(e):
                if isinstance(x, Var) and x in lets and x not in seen:
                    seen.add(x)
                    todo.append(lets[x])
        return out

    def pipelined(self, s: For) -> None:
        if s is self.ws_loop:
            return self._pipelined_ws(s)
        copies = self.pipes[id(s)]
        n = int(s.annotations["num_stages"])
        start_x, ext_x = self.lower_expr(s.start), self.lower_expr(s.extent)
        bufs = [c.dst.buffer for c in copies]
        tma = [self.tma_plans[id(c)] for c in copies if id(c) in self.tma_plans]
        on_tma = {id(p["copy"]) for p in tma}
        cp = [c for c in copies if id(c) not in on_tma]
        self.add(Comment(f"T.Pipelined: {n} stages of {', '.join(b.name for b in bufs)} "
                         f"({'TMA + mbarrier' if tma else ''}{', ' if tma and cp else ''}{'cp.async' if cp else ''})",
                         loc=s.loc))
        bar = None
        if tma:  # the stages' mbarriers (thread 0 initializes them; everyone waits on them)
            bar = Buffer(self.fresh("bar"), (C(n),), "int64", "shared")
            self.add(MbarArray(bar, self.mbarriers))
            self.mbarriers += n
            self.add(MbarInitAll(bar, 1))
            self.sync()
        tma_bytes = sum(p["bytes"] for p in tma)

        def issue(stage: Expr) -> None:
            for c in cp:
                self.stage_expr[c.dst.buffer] = stage
                self.copy_async(c)
            if tma:
                self.begin()
                self.add(MbarArriveExpectTx(MbarRef(bar, stage), tma_bytes))
                for p in tma:
                    size = int(np.prod(p["copy"].dst.buffer.static_shape()))
                    self.tma_issue(p, B(P(stage), "*", C(size)), MbarRef(bar, stage))
                self.add(If(B(TX, "==", C(0), "bool"), self.end()))

        body = s.body.body if isinstance(s.body, Seq) else [s.body]
        rest = [c for c in body if not any(c is x for x in copies)]
        agemm = self._async_wgmma(rest, copies)
        # how far ahead the prefetch runs: n - 1 stages, or n - 2 when the in-flight wgmma's stage is
        # refilled two iterations later behind the loop's only barrier (pass_configs cuda_wgmma_one_barrier)
        lag = agemm is not None and n >= 3 and self.one_barrier
        if agemm is not None and self.one_barrier and not lag:
            log.debug("%s: cuda_wgmma_one_barrier needs num_stages >= 3 (got %d): two barriers per iteration",
                      s.loc, n)
        ahead = n - 2 if lag else n - 1
        for st in range(ahead):
            self.begin()
            self.add(Let(s.var, B(start_x, "+", C(st))))  # the loop variable of iteration st (a shadow in C)
            self.begin()
            issue(C(st))
            self.add(If(B(C(st), "<", ext_x, "bool"), self.end()))
            if cp:
                self.add(AsyncCommit())
            self.add(Scope(self.end()))

        def prefetch() -> None:
            self.begin()
            nxt = self.v(self.fresh("knext"))
            self.add(Let(nxt, B(s.var, "+", C(ahead))))
            self.begin()
            self.add(Let(s.var, nxt))
            issue(P(B(P(B(nxt, "-", P(start_x))), "%", C(n))))
            self.add(If(B(nxt, "<", B(start_x, "+", ext_x), "bool"), self.end()))
            if cp:
                self.add(AsyncCommit())
            self.add(Scope(self.end()))

        # one barrier per iteration: after it, stage k has landed for every thread and every thread is
        # done with stage k-1 (read in the previous iteration), which the prefetch then refills. With the
        # loop's last statement a wgmma left in flight (one group) across iterations, the refill of
        # stage k-1 waits for a second barrier after that wgmma's issue: by then every warpgroup has
        # waited for its wgmma of iteration k-1, and the tensor cores run iteration k meanwhile. TMA
        # stages land on their mbarrier: use u of a stage waits for phase parity u & 1.
        # With `lag` (prefetch n - 2 ahead) the refill after the wgmma's issue goes into the stage of
        # iteration k-2: every warpgroup waited for its wgmma of k-2 (wgmma_wait<1> after issuing k-1)
        # before this iteration's barrier, so the second barrier is not needed; the refill is issued
        # before this iteration's wgmma_wait<1>, while the tensor cores work on k-1 and k.
        self.begin()
        stage = self.v(self.fresh("stage"))
        self.add(Let(stage, B(P(B(s.var, "-", P(start_x))), "%", C(n))))
        if cp:
            self.add(AsyncWait(ahead - 1))
        if tma:
            self.add(MbarWait(MbarRef(bar, stage), B(P(B(P(B(s.var, "-", P(start_x))), "/", C(n))), "&", C(1))))
        self.sync()
        if agemm is None:
            prefetch()
        for b in bufs:
            self.stage_expr[b] = stage
        self._wg_defer_ok = agemm is None  # T.gemm(wg_wait=-1) groups: settled before the next refill
        for c in rest:
            self._wg_async = c if c is agemm else None
            self._wg_defer_wait = lag and c is agemm
            self.stmt(c)
            self._wg_async = None
            self._wg_defer_wait = False
        self.wg_wait(0)
        self._wg_defer_ok = False
        if lag:
            prefetch()
            self.add(Intrinsic("wgmma_wait", [], [], {"n": 1}))
        elif agemm is not None:
            self.sync()
            prefetch()
        self.add(For(s.var, start_x, ext_x, "serial", self.end(), loc=s.loc))
        if agemm is not None:
            self.add(Intrinsic("wgmma_wait", [], [], {"n": 0}))
            self.add(Intrinsic("wgmma_fence_operands", [], [], {"buffer": agemm.C.buffer.name}))
        if cp:
            self.add(AsyncWait(0))
        self._loop_done(s)

    def _loop_done(self, s) -> None:
        """After a pipelined loop: its last iteration's accesses are still in flight for other threads."""
        r, w = self.tracked(s)
        self.pending_r |= r
        self.pending_w |= w

    def _ws_loop_done(self, s, pt: bool, ext) -> None:
        """After a warp-specialized consumer loop; in a persistent kernel the stage counter _kb moves on by
        the loop's trip count (the next tile's loop starts where this one stopped)."""
        if pt:
            self.emit(f"_kb += {ext};")
        self._loop_done(s)

    def _ws_pingpong(self, rest: list, agemm) -> Gemm | None:
        """The gemm two consumer warpgroups take turns on (the loop body's first statement that is a wgmma
        T.gemm), when the loop has two consumer warpgroups, each owning its own rows in every wgmma
        (warpgroups split M), no wgmma left in flight across iterations, and no consumer barrier in the body
        (found by emitting the body once on the side: a barrier there would deadlock the turns)."""
        if not self.ws_pingpong or self.threads != 256 or agemm is not None:
            return None
        gemms = [c for c in rest if isinstance(c, Gemm)]
        if not gemms or any(self.inf.gemms[id(g)].kind != "wgmma" or self.inf.gemms[id(g)].warps_m != 2
                            for g in gemms):
            log.debug("%s: no pingpong: not every gemm of the loop is a wgmma split over 2 warpgroups' rows",
                      self.kernel.loc)
            return None
        from ..emit import emit_body

        saved = (set(self.pending_r), set(self.pending_w), self.scratch_bytes)
        self.begin()
        for c in rest:
            self.stmt(c)
        trial = "\n".join(emit_body(self, self.end()))
        self.pending_r, self.pending_w, self.scratch_bytes = saved
        if "__syncthreads" in trial:
            log.debug("%s: no pingpong: the loop body has a consumer barrier", self.kernel.loc)
            return None
        first = next(c for c in rest if isinstance(c, Gemm))
        log.debug("%s: pingpong: the two consumer warpgroups take turns issuing %s", first.loc, "T.gemm")
        return first

    def _ws_overlap(self, rest: list, agemm) -> tuple | None:
        """FlashAttention-3's intra-warpgroup overlap for a warp-specialized loop whose body is `pre; G1; mid;
        G2` (two wgmma T.gemms, G2 last; pre and mid touch registers only): (pre, G1, free, bound, G2), where
        `bound` are the statements of mid that touch G2's register operand or accumulator (or depend on one
        that does) and `free` the others. The loop is then emitted rotated (`_pipelined_ws_overlap`):
        iteration k issues G1(k), then G2(k-1), waits for G1(k) only, runs free(k) (the softmax) while G2(k-1)
        still runs on the tensor cores, waits for G2(k-1), then runs bound(k) (the rescale of G2's accumulator,
        the cast into its operand). Same result: G2(k-1) commutes with pre(k) and G1(k) (they do not touch
        its accumulator, nor write its operands), and free(k) with every bound statement before it."""
        k = self.kernel

        def no(why: str) -> None:
            log.debug("%s: no gemm/softmax overlap: %s", k.loc, why)

        if not self.ws_overlap or agemm is not None:
            return None
        gi = [i for i, c in enumerate(rest) if isinstance(c, Gemm)]
        if len(gi) != 2 or gi[1] != len(rest) - 1:
            return no("the loop body is not `... gemm ... gemm` with the second gemm last")
        g1, g2 = rest[gi[0]], rest[gi[1]]
        if any(self.inf.gemms[id(g)].kind != "wgmma" for g in (g1, g2)):
            return no("a gemm of the loop is not on wgmma")
        pre, mid = rest[:gi[0]], rest[gi[0] + 1:gi[1]]
        for st in pre + mid:
            if any(isinstance(x, Gemm) or (isinstance(x, For) and x.kind == "pipelined") for x in walk_stmts(st)):
                return no("a gemm or pipelined loop between the two gemms")
            if any(b.scope in ("shared", "global") for b in self.writes(st)):
                return no("the loop writes shared or global memory between the gemms")
        a2, c2, c1 = g2.A.buffer, g2.C.buffer, g1.C.buffer
        if c1 is c2 or c1 is a2 or g2.B.buffer.scope != "shared":
            return no("the gemms share an accumulator or the second one's B is not in shared memory")
        for st in pre + [g1]:
            if c2 in self.reads(st) | self.writes(st) or a2 in self.writes(st):
                return no("the first gemm (or what precedes it) touches the second one's operands")
        free, bound = [], []
        for st in mid:
            r, w = self.reads(st), self.writes(st)
            if (r | w) & {a2, c2} or any(self.writes(b) & (r | w) or self.reads(b) & w for b in bound):
                bound.append(st)
            else:
                free.append(st)
        if not free:
            return no("every statement between the gemms touches the second gemm's operands")
        log.debug("%s: gemm/softmax overlap: the next iteration's first T.gemm is issued before %d statements "
                  "that run under the second T.gemm (%d wait for it)", g1.loc, len(free), len(bound))
        return pre, g1, free, bound, g2

    def _overlap_pin(self, free: list) -> str | None:
        """C expression: the sum of the registers of the smallest float fragment / local buffer the last free
        statement writes (None: it writes none)."""
        best = None
        for st in reversed(free):
            for b in self.writes(st):
                if b.scope not in ("fragment", "local") or b.dtype != "float32" or b.scope == "var":
                    continue
                n = self.inf.layouts[b].nregs if b.scope == "fragment" else int(np.prod(b.static_shape()))
                if best is None or n < best[0]:
                    best = (n, b)
            if best is not None:
                break
        if best is None or best[0] > 8:
            return None
        name = self.tbuf(best[1]).name
        return " + ".join(f"{name}[{i}]" for i in range(best[0]))

    def _ws_split_groups(self, rest: list, copies: list, agemm, carried: bool, mc: bool,
                         overlap: tuple | None) -> list | None:
        """pass_configs cuda_ws_split_stages: the pipelined copies grouped by the statements of the loop body that
        read them, [(copies, first reader, last reader)] in reader order (indices into `rest`; a copy nothing reads
        has len(rest) for both), when there are two or more groups; None otherwise. Each group then gets its own
        `full` / `empty` mbarriers: the consumers wait for a group right before its first reader and release it
        right after its last, so flash attention's K stage is free for the producer once S = Q K^T is done (before
        the softmax), while V is still being read. With the gemm/softmax overlap the groups must be exactly
        (read by the first gemm or before it) and (read by the second gemm only)."""
        k = self.kernel

        def no(why: str) -> None:
            log.debug("%s: no split stages: %s", k.loc, why)

        if not self.ws_split:
            return None
        if agemm is not None:
            return no("the loop's wgmma stays in flight across iterations (its copies are released a stage late)")
        if mc:
            return no("TMA multicast (the peer's releases count one empty barrier per stage)")
        if carried:
            return no("the loop body has a consumer barrier")
        if any(isinstance(x, Gemm) and int(x.options.get("wg_wait", 0) or 0) < 0 for c in rest for x in walk_stmts(c)):
            return no("a T.gemm(wg_wait=-1) leaves its wgmma group in flight past its statement")
        keyed: dict[tuple[int, int], list] = {}
        for c in copies:
            idx = [i for i, st in enumerate(rest) if c.dst.buffer in self.reads(st)]
            keyed.setdefault((idx[0], idx[-1]) if idx else (len(rest), len(rest)), []).append(c)
        if len(keyed) < 2:
            return no("every pipelined copy is read by the same statements")
        groups = [(cs, a, b) for (a, b), cs in sorted(keyed.items())]
        if overlap is not None:
            g1 = next(i for i, c in enumerate(rest) if c is overlap[1])
            last = len(rest) - 1
            if len(groups) != 2 or groups[0][2] > g1 or groups[1][1:] != (last, last):
                return no("with the gemm/softmax overlap the copies must be read by the first gemm (or before) and "
                          "by the second gemm only")
        log.debug("%s: split stages: %s", k.loc, "; ".join(
            f"{'+'.join(c.dst.buffer.name for c in cs)} waited before statement {a}, released after {b}"
            for cs, a, b in groups))
        return groups

    def _pipelined_ws_overlap(self, s: For, ov: tuple, full: str, empty: str, n: int, start: str, ext: str,
                              it: str, pingpong: bool = False, split: list | None = None) -> None:
        """The consumers' loop of `_ws_overlap`, rotated: a prologue iteration (pre, G1 waited, mid), the loop
        from the second iteration (G1(k) and G2(k-1) in flight together), an epilogue G2 of the last one. The
        second gemm reads its B operand (V) from the previous iteration's stage, released once it is done.
        `split` (cuda_ws_split_stages): [(full, empty)] of the first gemm's copies (K) and of the second's (V):
        K(k) is waited for before G1(k) and released once G1(k) is done (before the softmax), V(k-1) waited for
        before G2(k-1) and released once it is done."""
        pre, g1, free, bound, g2 = ov
        (kfull, kempty), (vfull, vempty) = split if split is not None else ((full, empty), (full, empty))
        v = s.var.name
        bufs = [c.dst.buffer for c in self.pipes[id(s)]]

        def stages(x: str) -> None:
            for b in bufs:
                self.stage_expr[b] = x

        T = self.threads

        def turn() -> None:  # pingpong: this warpgroup's turn to issue its gemms (named barriers 2 and 3)
            if pingpong:
                self.emit(f"tilehal::named_barrier_sync(2 + (_tx >> 7), {T});  // pingpong: this warpgroup's turn")

        def gemm(g: Gemm, stage: str | None, wait: bool, hand_over: str | None = None) -> None:
            """`hand_over`: the condition under which this warpgroup passes the turn after the gemm's commit."""
            if stage is not None:
                stages(stage)
            if g is g2 and packed is not None:
                self._wg_packed[id(g2)] = packed
            if pingpong and hand_over is not None:
                self._wg_after_commit = g
                self._wg_after_commit_line = (f"if ({hand_over}) tilehal::named_barrier_arrive(3 - (_tx >> 7), {T});  "
                                              f"// pingpong: the other's turn")
            self._wg_async = None if wait else g
            self._wg_defer_wait = not wait
            self.stmt(g)
            self._wg_async = None
            self._wg_defer_wait = False
            self._wg_after_commit = None
            self._wg_packed.pop(id(g2), None)

        def waited(nleft: int, acc: Buffer) -> None:
            self.add(Intrinsic("wgmma_wait", [], [], {"n": nleft}))
            self.add(Intrinsic("wgmma_fence_operands", [], [], {"buffer": self.tbuf(acc).name}))

        arrive = "if ((_tx & 31) == 0) tilehal::mbarrier_arrive"
        # a register A operand of G2 is packed right after the cast that writes it (the end of bound), into
        # registers declared before the loop: 32-bit pairs live across the back edge, not one register per value
        packed = None
        if self.inf.gemms[id(g2)].a_major == "reg" and g2.A.buffer.scope == "fragment":
            packed = self.wg_pack_a(g2, self.fresh("pa"), pack=False)
            self._wg_packed.pop(id(g2), None)
        self.emit(f"// T.Pipelined: consumers wait for each stage on {full}, release it on {empty}; the next "
                  f"iteration's first gemm overlaps this one's softmax (FlashAttention-3)")
        self.open(f"if (({ext}) > 0)")
        if pingpong:  # FlashAttention-3's two schedules together: the warpgroups also take turns on the gemms
            self.emit(f"if ((_tx >> 7) == 1) tilehal::named_barrier_arrive(2, {T});  // pingpong: warpgroup 0 first")
        self.emit(f"const int {v} = {start};")
        st0 = self.fresh("stage")
        self.emit(f"const int {st0} = {it} % {n};")
        self.emit(f"tilehal::mbarrier_wait(&{kfull}[{st0}], ({it} / {n}) & 1);")
        stages(st0)
        for c in pre:
            self.stmt(c)
        turn()
        gemm(g1, st0, True, "true")
        if split is not None:  # K(0) is free once S(0) is done
            self.emit(f"{arrive}(&{kempty}[{st0}]);")
        for c in free + bound:
            self.stmt(c)
        if packed is not None:
            self.wg_pack_a(g2, "", packed)
        self.close()
        self.open(f"for (int {v} = {start} + 1; {v} < {start} + {ext}; ++{v})")
        stage, prev = self.fresh("stage"), self.fresh("prev")
        self.emit(f"const int {stage} = {it} % {n};")
        self.emit(f"const int {prev} = ({stage} + {n - 1}) % {n};")
        self.emit(f"tilehal::mbarrier_wait(&{kfull}[{stage}], ({it} / {n}) & 1);")
        stages(stage)
        for c in pre:
            self.stmt(c)
        turn()
        gemm(g1, stage, False)
        if split is not None:  # V(k-1), landed on its own barrier (the prologue or the previous iteration did not wait)
            self.emit(f"tilehal::mbarrier_wait(&{vfull}[{prev}], (({it} - 1) / {n}) & 1);")
        gemm(g2, prev, False, "true")
        waited(1, g1.C.buffer)
        if split is not None:  # K(k) is free once S(k) is done: the producer refills it during the softmax
            self.emit(f"{arrive}(&{kempty}[{stage}]);")
        stages(stage)
        for c in free:
            self.stmt(c)
        # ptxas schedules the wgmma wait (WARPGROUP.DEPBAR) early, into the softmax, unless a shared-memory store
        # precedes it (seen in the SASS: it orders the wait after shared stores only; register fences are not
        # instructions): each warp stores the sum of the last free statement's smallest float output (flash
        # attention: the running row sums, which depend on every exponential of the tile) to its own word after
        # the pipeline's mbarriers, so the softmax stays under the second gemm
        pin = self._overlap_pin(free)
        if pin is not None:
            slot = self.mbarriers
            self.mbarriers += -(-self.threads // 32 // 2)  # one 4-byte word per consumer warp, in 8-byte units
            self.emit(f"reinterpret_cast<volatile float*>(_tl_mbar + {slot})[_tx >> 5] = {pin};  "
                      f"// keeps the softmax before the wait (ptxas orders the wait after a shared store)")
        waited(0, g2.C.buffer)
        self.emit(f"{arrive}(&{vempty}[{prev}]);")
        for c in bound:
            self.stmt(c)
        if packed is not None:
            self.wg_pack_a(g2, "", packed)
        self.close()
        self.open(f"if (({ext}) > 0)")
        self.emit(f"const int {v} = {start} + ({ext}) - 1;")
        last = self.fresh("stage")
        self.emit(f"const int {last} = {it} % {n};")
        if split is not None:
            self.emit(f"tilehal::mbarrier_wait(&{vfull}[{last}], ({it} / {n}) & 1);")
        turn()
        gemm(g2, last, True, "(_tx >> 7) == 0")  # warpgroup 1's last turn passes nothing on: the counts balance
        self.emit(f"{arrive}(&{vempty}[{last}]);")
        self.close()

    def _pipelined_ws(self, s: For) -> None:
        """The consumers' side of a warp-specialized TMA pipeline (the producer's is `ws_prologue`)."""
        copies = self.pipes[id(s)]
        n = int(s.annotations["num_stages"])
        start, ext = self.expr(s.start), self.expr(s.extent)
        v = s.var.name
        plans = [self.tma_plans[id(c)] for c in copies]
        nbytes = sum(p["bytes"] for p in plans)
        T = self.threads
        mc = self.mc_cluster is not None  # TMA multicast across a cluster of 2 CTAs (_plan_multicast)
        pt_early = self.persistent_tiles
        # the consumers' statements (decided before the producer is written: split stages change both sides)
        body = s.body.body if isinstance(s.body, Seq) else [s.body]
        rest = [c for c in body if not any(c is x for x in copies)]
        agemm = self._async_wgmma(rest, copies)
        bufs = [c.dst.buffer for c in copies]
        # shared memory other than the stages written in the loop: one consumer barrier per iteration orders
        # an iteration's last accesses before the next one's first (the loop-carried hazards the block-wide
        # barrier of the plain pipeline covered); buffers only read need the writes before the loop done
        reads, writes = set(), set()
        for c in rest:
            r, w = self.tracked(c)
            reads |= r
            writes |= w
        carried = bool(writes - set(bufs))
        overlap = None if carried or mc else self._ws_overlap(rest, agemm)
        split = self._ws_split_groups(rest, copies, agemm, carried, mc, overlap)
        full, empty = self.fresh("full"), self.fresh("empty")
        fo, eo = self.mbarriers, self.mbarriers + n
        self.mbarriers += 2 * n
        # producer: init both barrier arrays (all threads then meet at the kernel's only __syncthreads),
        # then its warpgroup leaves the body; one thread loops over the stages
        # cuda_ws_two_ctas: a producer warp (threads T .. T+31) instead of a warpgroup, no setmaxnreg (_ws_two_ctas)
        self.ws_producer_warp = self.ws_two_ctas and not pt_early and not mc
        if self.ws_two_ctas and not self.ws_producer_warp:
            log.debug("%s: one warp-specialized CTA per SM (cuda_ws_two_ctas not applied): a %s kernel", s.loc,
                      "persistent" if pt_early else "TMA multicast")
        pro = [f"// T.Pipelined: {n} stages of {', '.join(c.dst.buffer.name for c in copies)}, warp-specialized "
               f"(threads {T}..{T + (31 if self.ws_producer_warp else 127)} issue the TMA loads)",
               f"tilehal::u64* {full} = _tl_mbar + {fo};  // stage landed (1 arrival + the TMA bytes)",
               f"tilehal::u64* {empty} = _tl_mbar + {eo};  // stage free (one arrival per consumer warp)"]
        # cuda_ws_split_stages: group g's barriers; group 0 keeps `full` / `empty`
        bars = [(full, empty)]
        for cs, _, _ in (split or [])[1:]:
            gf, ge = self.fresh("full"), self.fresh("empty")
            pro += [f"tilehal::u64* {gf} = _tl_mbar + {self.mbarriers};  // stage of "
                    f"{', '.join(c.dst.buffer.name for c in cs)} landed",
                    f"tilehal::u64* {ge} = _tl_mbar + {self.mbarriers + n};  // ... and free"]
            self.mbarriers += 2 * n
            bars.append((gf, ge))
        init = " ".join(f"tilehal::mbarrier_init(&{f}[_s], 1); tilehal::mbarrier_init(&{e}[_s], {T // 32 * (2 if mc else 1)});"
                        for f, e in bars)
        pro += [f"if (_tx == 0) {{ for (int _s = 0; _s < {n}; ++_s) {{ {init} }} "
                f"tilehal::fence_barrier_init(); }}",
                "tilehal::cluster_sync();  // both CTAs' barriers initialized before any multicast or remote arrival"
                if mc else "__syncthreads();"]
        if mc:
            pro.insert(0, "const unsigned _cta_rank = tilehal::cluster_ctarank();  // its half of the shared tile")
        pt = self.persistent_tiles
        it = f"(_kb + {v} - ({start}))" if pt else f"({v} - ({start}))"  # pipeline iteration (all tiles)
        self.begin()
        self.open(f"if (_tx >= {T})")
        many = T + 128 > 256 and not self.ws_producer_warp
        if many:
            self.emit("tilehal::setmaxnreg_dec<40>();")
        groups = list(zip(bars, [copies] if split is None else [g[0] for g in split]))
        # pass_configs cuda_ws_split_producers (with split stages and a producer warpgroup): each group's loads are
        # issued by a thread of its own (lane 0 of producer warp g), so K(k + 1) never waits behind V(k)'s stage,
        # which the overlap form frees an iteration after its load (ncu, session 29: the consumers' V wait)
        progs = [groups]
        if self.ws_split_producers and split is not None and not self.ws_producer_warp and len(groups) <= 4:
            progs = [[g] for g in groups]
            log.debug("%s: split stages: %d producer threads, one per group of copies", s.loc, len(progs))
        elif self.ws_split_producers:
            log.debug("%s: cuda_ws_split_producers not applied (%s)", s.loc,
                      "no split stages" if split is None else "a producer warp" if self.ws_producer_warp else
                      "more than 4 groups")
        for pi, prog in enumerate(progs):
            self.open(f"if (_tx == {T + 32 * pi})")
            if pt:
                self.emit("int _kb = 0;")
                self.open(f"for (int _tile = blockIdx.x; _tile < {pt}; _tile += gridDim.x)")
                for ln in self.block_index_lines("_tile"):
                    self.emit(ln)
            for lt in self.ws_lets:
                self.let(lt)
            self.open(f"for (int {v} = {start}; {v} < {start} + {ext}; ++{v})")
            self.emit(f"const int _s = {it} % {n};")
            for (f, e), cs in prog:
                gplans = [p for p in plans if any(p["copy"] is c for c in cs)]
                gbytes = nbytes if split is None else sum(p["bytes"] for p in gplans)
                self.emit(f"if ({it} >= {n}) tilehal::mbarrier_wait(&{e}[_s], (({it} / {n}) - 1) & 1);")
                self.emit(f"tilehal::mbarrier_arrive_expect_tx(&{f}[_s], {gbytes});")
                for p in gplans:
                    size = int(np.prod(p["copy"].dst.buffer.static_shape()))
                    self.tma_issue(p, f"_s * {size}", f"&{f}[_s]")
            self.close()
            if pt:
                self.emit(f"_kb += {ext};")
                self.close()
            self.close()
        if mc:  # the peer's consumers may still arrive on this CTA's barriers
            self.emit("tilehal::cluster_sync();")
        self.emit("return;")
        self.close()
        if many:
            # 65536 registers: 128 x 40 for the producer, the rest (multiple of 8, <= 256) for the consumers
            regs = min(248, (65536 - 128 * 40) // T // 8 * 8)
            self.emit(f"tilehal::setmaxnreg_inc<{regs}>();")
        from ..emit import emit_body

        self.ws_prologue = ["  " + ln for ln in pro] + emit_body(self, self.end())
        # consumers
        if not carried and ((reads | writes) & self.pending_w or writes & self.pending_r):
            self.sync()
        pingpong = self._ws_pingpong(rest, agemm)
        if overlap is not None:
            self._pipelined_ws_overlap(s, overlap, full, empty, n, start, ext, it, pingpong is not None,
                                       bars if split is not None else None)
            self._ws_loop_done(s, pt, ext)
            return
        if pingpong is not None:
            # the two consumer warpgroups take turns issuing the loop's first gemm (named barriers 2 and 3):
            # one's softmax-like middle part then runs while the other's gemms use the tensor cores. Warpgroup 1
            # lets warpgroup 0 go first; it does not arrive after its last turn (the counts balance per loop).
            self.emit(f"if ((_tx >> 7) == 1) tilehal::named_barrier_arrive(2, {T});  // pingpong: warpgroup 0 first")
        self.emit(f"// T.Pipelined: consumers wait for each stage on {full}, release it on {empty}")
        self.open(f"for (int {v} = {start}; {v} < {start} + {ext}; ++{v})")
        stage = self.fresh("stage")
        self.emit(f"const int {stage} = {it} % {n};")
        if split is None:
            self.emit(f"tilehal::mbarrier_wait(&{full}[{stage}], ({it} / {n}) & 1);")
        if carried:
            self.sync()
        for b in bufs:
            self.stage_expr[b] = stage
        self._wg_defer_ok = agemm is None  # T.gemm(wg_wait=-1) groups are settled below, before the release
        last = len(rest) - 1
        for i, c in enumerate(rest):
            for (f, _), (_, a, _) in zip(bars, split or []):  # split stages: a group lands before its first reader
                if a == i:
                    self.emit(f"tilehal::mbarrier_wait(&{f}[{stage}], ({it} / {n}) & 1);")
            self._wg_async = c if c is agemm else None
            if c is pingpong:
                self.emit(f"tilehal::named_barrier_sync(2 + (_tx >> 7), {T});  // pingpong: this warpgroup's turn")
                self._wg_after_commit = c
                self._wg_after_commit_line = (f"if ((_tx >> 7) == 0 || {v} + 1 < {start} + {ext}) "
                                              f"tilehal::named_barrier_arrive(3 - (_tx >> 7), {T});  // the other's turn")
            self.stmt(c)
            self._wg_async = None
            self._wg_after_commit = None
            for (_, e), (_, _, b) in zip(bars, split or []):  # ... and is free after its last (its wgmma waited)
                if b == i and i < last:
                    sw = "" if isinstance(c, Gemm) else "__syncwarp(); "  # every lane of the warp done reading
                    self.emit(f"{sw}if ((_tx & 31) == 0) tilehal::mbarrier_arrive(&{e}[{stage}]);  // split stages")
        self.wg_wait(0)  # every deferred wgmma of this iteration is done before its stage is released
        self._wg_defer_ok = False
        if split is not None:  # the groups the last statement (or nothing) reads
            for (_, e), (_, _, b) in zip(bars, split):
                if b >= last:
                    self.emit(f"if ((_tx & 31) == 0) tilehal::mbarrier_arrive(&{e}[{stage}]);")
            self.close()
            self._ws_loop_done(s, pt, ext)
            return
        # release: with the wgmma of this iteration in flight (wgmma_wait<1>: the one of the previous
        # iteration is done), the previous stage; otherwise this one (everything reading it is done); with
        # multicast on both CTAs' barriers (the peer's producer writes into this CTA's stage too)
        rel = ("tilehal::mbarrier_arrive(&{b}), tl_mbar_arrive_peer(&{b}, _cta_rank ^ 1)" if mc else
               "tilehal::mbarrier_arrive(&{b})")
        if agemm is not None:
            self.emit(f"if ({v} > {start} && (_tx & 31) == 0) {rel.format(b=f'{empty}[({stage} + {n - 1}) % {n}]')};")
        else:
            self.emit(f"if ((_tx & 31) == 0) {rel.format(b=f'{empty}[{stage}]')};")
        self.close()
        if agemm is not None:
            self.emit("tilehal::wgmma_wait<0>();")
            self.emit(f"tilehal::wgmma_fence_operands({agemm.C.buffer.name});")
            if pt:  # the last stage of this tile is free for the next tile's loads
                self.emit(f"if (({ext}) > 0 && (_tx & 31) == 0) "
                          f"tilehal::mbarrier_arrive(&{empty}[(_kb + ({ext}) - 1) % {n}]);")
        self._ws_loop_done(s, pt, ext)
