"""CUDA lowering of T.Pipelined(num_stages>=2): cp.async multi-buffer prefetch of global->shared copies."""

from __future__ import annotations

import numpy as np

from ....ir.nodes import Alloc, Buffer, Copy, For, Gemm, If, Kernel, Let, Load, Seq, Var
from ....ir.visit import walk_expr, walk_stmts
from ..common import log


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
                          and (buf in self.writes(st))]
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

    def pipelined(self, s: For) -> None:
        copies = self.pipes[id(s)]
        n = int(s.annotations["num_stages"])
        start, ext = self.expr(s.start), self.expr(s.extent)
        v = s.var.name
        bufs = [c.dst.buffer for c in copies]
        tma = [self.tma_plans[id(c)] for c in copies if id(c) in self.tma_plans]
        on_tma = {id(p["copy"]) for p in tma}
        cp = [c for c in copies if id(c) not in on_tma]
        self.emit(f"// T.Pipelined: {n} stages of {', '.join(b.name for b in bufs)} "
                  f"({'TMA + mbarrier' if tma else ''}{', ' if tma and cp else ''}{'cp.async' if cp else ''})")
        bar = None
        if tma:
            bar = self.fresh("bar")
            self.emit(f"tilehal::u64* {bar} = _tl_mbar + {self.mbarriers};  // {n} mbarriers in dynamic shared memory")
            self.mbarriers += n
            self.emit(f"if (_tx == 0) {{ for (int _s = 0; _s < {n}; ++_s) tilehal::mbarrier_init(&{bar}[_s], 1); "
                      f"tilehal::fence_barrier_init(); }}")
            self.sync()
        tma_bytes = sum(p["bytes"] for p in tma)

        def issue(stage_c: str) -> None:
            for c in cp:
                self.stage_expr[c.dst.buffer] = stage_c
                self.copy_async(c)
            if tma:
                self.open("if (_tx == 0)")
                self.emit(f"tilehal::mbarrier_arrive_expect_tx(&{bar}[{stage_c}], {tma_bytes});")
                for p in tma:
                    size = int(np.prod(p["copy"].dst.buffer.static_shape()))
                    self.tma_issue(p, f"({stage_c}) * {size}", f"&{bar}[{stage_c}]")
                self.close()

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
            self.open("")
            self.emit(f"const int {v} = {start} + {st};")
            self.open(f"if ({st} < {ext})")
            issue(str(st))
            self.close()
            if cp:
                self.emit("tilehal::cp_async_commit();")
            self.close()

        def prefetch() -> None:
            self.open("")
            nxt = self.fresh("knext")
            self.emit(f"const int {nxt} = {v} + {ahead};")
            self.open(f"if ({nxt} < {start} + {ext})")
            self.emit(f"const int {v} = {nxt};")
            issue(f"(({nxt} - ({start})) % {n})")
            self.close()
            if cp:
                self.emit("tilehal::cp_async_commit();")
            self.close()

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
        self.open(f"for (int {v} = {start}; {v} < {start} + {ext}; ++{v})")
        stage = self.fresh("stage")
        self.emit(f"const int {stage} = ({v} - ({start})) % {n};")
        if cp:
            self.emit(f"tilehal::cp_async_wait<{ahead - 1}>();")
        if tma:
            self.emit(f"tilehal::mbarrier_wait(&{bar}[{stage}], (({v} - ({start})) / {n}) & 1);")
        self.sync()
        if agemm is None:
            prefetch()
        for b in bufs:
            self.stage_expr[b] = stage
        for c in rest:
            self._wg_async = c if c is agemm else None
            self._wg_defer_wait = lag and c is agemm
            self.stmt(c)
            self._wg_async = None
            self._wg_defer_wait = False
        if lag:
            prefetch()
            self.emit("tilehal::wgmma_wait<1>();")
        elif agemm is not None:
            self.sync()
            prefetch()
        self.close()
        if agemm is not None:
            self.emit("tilehal::wgmma_wait<0>();")
            self.emit(f"tilehal::wgmma_fence_operands({agemm.C.buffer.name});")
        if cp:
            self.emit("tilehal::cp_async_wait<0>();")
        # the last iteration's accesses are still in flight for other threads
        r, w = self.tracked(s)
        self.pending_r |= r
        self.pending_w |= w
