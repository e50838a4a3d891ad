"""CUDA lowering of T.gemm on sm_90a: wgmma.mma_async with shared operands named by swizzled smem
descriptors (A from shared memory or registers), fp32 accumulators in the wgmma register layout.

Operand tiles are planned by rules/gemm.py's swizzle planning (the canonical 128-byte-swizzle layout,
atom column by atom column, or the 64 / 32-byte swizzles for narrow K-major rows) and placed on 1 KiB
boundaries; codegen puts fence.proxy.async before every barrier of a kernel that has wgmma (shared
memory written by threads / cp.async is read next by the async proxy). Instructions per tile: for
each k16 step, each m64 block of the warpgroup's rows and each <= 256-wide column slice, one
`tilehal::Wgmma16<N>::ss / rs`; then one commit and wgmma_wait<0> (the accumulators are read by the
next statement, and the pipeline refills the stages right after the next barrier). Thread-level nodes
(lower_thread.py): SmemDesc, DescAdvance and the Wgmma instruction, run by the thread interpreter as a
per-warpgroup matmul on the descriptor-addressed (swizzled) tiles.
"""

from __future__ import annotations

from ....errors import CompileError
from ....ir.layout import Axis, Fragment
from ....ir.nodes import Buffer, Expr, For, Gemm, Let, Region
from ....ir.thread import Intrinsic, Scope
from ..common import esize, log
from ..emit import Comment, Decl, DescAdvance, ElemRef, Ref, RegArray, SmemDesc, Wgmma
from ..infer import GemmPlan
from ..lower_thread import TX, B, C, P, total


class WgmmaRules:
    def _wg_reg(self, f: Fragment, i: Expr, j: Expr, h: Expr, c: Expr) -> Expr:
        """Register of (m64 block i, n8 chunk j, half h, column c) in a wgmma accumulator layout (an
        mma.sync layout with one m16 tile per warp is the single-block case)."""
        want = {(0, 64): i, (1, 8): j, (0, 8): h, (1, 1): c}
        terms = []
        for d, a in f.reg_order:
            key = (d, a.coeff)
            if key not in want:
                raise CompileError(f"layout {f} is not a wgmma fragment", self.kernel.loc)
            terms.append(B(P(want[key]), "*", C(f.reg_stride(d, a))))
        return total(terms) or C(0)

    def _wg_operand(self, r: Region, major: str, row0: Expr, kk: Expr) -> tuple[Ref, Expr, int, int]:
        """(base element, offset in 16-byte units (the descriptor's address unit) of the k16 step `kk` for
        the 64 (A) or N (B) rows / columns starting at `row0`, swizzle mode, descriptor leading / stride
        bytes) of a wgmma operand in shared memory. Every term is a whole number of units, so each is
        scaled separately: after unrolling, a loop-invariant part plus a constant per instruction."""
        b = r.buffer
        rows, cols = b.static_shape()
        es = esize(b.dtype)
        row_bytes = cols * es
        base = Ref(self.tbuf(b), [self.smem_offset_x(b, [C(0), C(0)])])
        ke = 32 // es  # elements of one k step: 32 bytes (k16 of 16-bit types, k32 of fp8)
        if major == "K":  # a k step is 32 bytes: 2 units
            if row_bytes % 128 == 0:
                atom = 128 // es
                if row_bytes > 128:
                    off = B(B(B(P(B(B(P(kk), "*", C(ke)), "/", C(atom))), "*", C(rows * 8)), "+", B(P(row0), "*", C(8))),
                            "+", B(B(P(B(P(B(P(kk), "*", C(ke))), "%", C(atom))), "/", C(ke)), "*", C(2)))
                else:
                    off = B(B(P(row0), "*", C(8)), "+", B(P(kk), "*", C(2)))
                return base, off, 1, 1024
            if row_bytes == 64:
                return base, B(B(P(row0), "*", C(4)), "+", B(P(kk), "*", C(2))), 2, 512
            return base, B(P(row0), "*", C(2)), 3, 256
        # MN-major: 64-element atoms along the contiguous (M or N) dim, `rows` K-rows each
        off = B(B(P(B(P(row0), "/", C(64))), "*", C(rows * 8)), "+", B(P(kk), "*", C(128)))
        return base, off, 1, 1024

    def wg_pack_a(self, s: Gemm, name: str, into: Buffer | None = None, pack: bool = True) -> Buffer:
        """The register A operand of wgmma T.gemm `s` packed for every k step (u32 [k steps x m64 blocks][4],
        two 16-bit values each), into `into` or a new register array `name` declared here (`pack` False: only
        declared)."""
        plan = self.inf.gemms[id(s)]
        m, _ = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        MI = m // plan.warps_m // 64
        nk = kdim // plan.kstep
        fa = self.inf.layouts[s.A.buffer]
        cstride = fa.reg_stride(1, Axis("r", 2, 1))
        ra = into
        if ra is None:
            ra = Buffer(name, (C(nk * MI), C(4)), "int32", "local")
            self.add(RegArray(ra, "tilehal::u32"))
        if not pack:
            return ra
        kk, mi = self.v("_kk"), self.v("_mi")
        unroll = {"c_extent_bound": True}
        self.begin()
        self.begin()
        row = B(B(kk, "*", C(MI)), "+", mi)
        for i, (j, h) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            r = self._wg_reg(fa, mi, B(B(C(2), "*", kk), "+", C(j)), C(h), C(0))
            self.add(Intrinsic("pack2_bits", [ElemRef(ra, [row, C(i)])],
                               [self.reg_ref(s.A.buffer, r), self.reg_ref(s.A.buffer, B(r, "+", C(cstride)))],
                               {"dtype": s.A.buffer.dtype}))
        self.add(For(mi, C(0), C(MI), "unroll", self.end(), annotations=unroll))
        self.add(For(kk, C(0), C(nk), "unroll", self.end(), annotations=unroll))
        return ra

    def gemm_wgmma(self, s: Gemm, plan: GemmPlan) -> None:
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        wgm, wgn = plan.warps_m, plan.warps_n
        MW, NW = m // wgm, n // wgn
        MI = MW // 64
        NI = max(1, NW // 256)
        NINST = NW // NI
        tag = "tilehal::WgF16()" if s.A.buffer.dtype == "float16" else "tilehal::WgBF16()"
        ks = plan.kstep
        fc = self.inf.layouts[s.C.buffer]
        c = s.C.buffer.name
        wg_wait = int(s.options.get("wg_wait", 0) or 0)
        unroll = {"c_extent_bound": True}
        v = self.v
        wg, wgr, wgc, kk, mi, ni = (v(x) for x in ("_wg", "_wgr", "_wgc", "_kk", "_mi", "_ni"))
        self.add(Comment(f"T.gemm {m}x{n}x{kdim} {s.A.buffer.dtype}: wgmma.mma_async m64n{NINST}k{ks}, A "
                         f"{plan.a_major}, B {plan.b_major}-major, warpgroups {wgm}x{wgn}", loc=s.loc))
        self.begin()  # the scope
        self.add(Let(wg, B(TX, ">>", C(7))))
        self.add(Decl([wgr, wgc], [B(wg, "%", C(wgm)), B(wg, "/", C(wgm))]))
        # the hardware swizzle is a function of the address: operand tiles sit on 1024-byte boundaries
        tb = 1 if plan.b_major == "MN" else 0
        bbase, boff, bswz, bsbo = self._wg_operand(s.B, plan.b_major, B(B(wgc, "*", C(NW)), "+", B(ni, "*", C(NINST))),
                                                   kk)
        blbo = s.B.buffer.static_shape()[0] * 128 if plan.b_major == "MN" else 16
        db, da = v("_db", "int64"), v("_da", "int64")
        self.add(SmemDesc(db, bbase, bswz, blbo, bsbo))
        ta, aoff = 0, None
        if plan.a_major != "reg":
            ta = 1 if plan.a_major == "MN" else 0
            abase, aoff, aswz, asbo = self._wg_operand(s.A, plan.a_major, B(B(wgr, "*", C(MW)), "+", B(mi, "*", C(64))),
                                                       kk)
            albo = s.A.buffer.static_shape()[0] * 128 if plan.a_major == "MN" else 16
            self.add(SmemDesc(da, abase, aswz, albo, asbo))
        ra = None
        nk = kdim // ks
        if plan.a_major == "reg":
            # every k step's A registers packed before the wgmma fence: a register written between two wgmmas
            # of the group makes ptxas insert a warpgroup.arrive there (C7519), which waits for the ones before.
            # Packed earlier by the caller (`wg_pack_a`, the gemm/softmax overlap) when it says so.
            ra = self._wg_packed.get(id(s))
            if ra is None:
                ra = self.wg_pack_a(s, "_a")
        self.add(Intrinsic("wgmma_fence", [], []))
        scale = P(B(kk, ">", C(0), "bool")) if s.clear_accum else C(1)
        self.begin()  # the k loop
        self.begin()  # the m64 blocks
        creg = self._wg_reg(fc, mi, B(ni, "*", C(NINST // 8)), C(0), C(0))
        bdesc = DescAdvance(db, boff)
        acc = self.reg_ref(s.C.buffer, creg)
        if plan.a_major == "reg":
            inst = Wgmma("rs", NINST, 0, tb, tag, s.A.buffer.dtype, acc, None, ra, bdesc, scale,
                         B(B(kk, "*", C(MI)), "+", mi), loc=s.loc)
        else:
            adesc = DescAdvance(da, aoff)
            form = "e4m3" if s.A.buffer.dtype == "float8_e4m3" else "ss"  # fp8: K-major A and B (no transpose)
            inst = Wgmma(form, NINST, ta, tb, tag, s.A.buffer.dtype, acc, adesc, None, bdesc, scale, loc=s.loc)
        self.add(For(ni, C(0), C(NI), "unroll", inst, annotations=unroll))
        self.add(For(mi, C(0), C(MI), "unroll", self.end(), annotations=unroll))
        self.add(For(kk, C(0), C(nk), "unroll", self.end(), annotations=unroll))
        self.add(Intrinsic("wgmma_commit", [], []))
        if self._wg_after_commit is s:  # the pingpong turn of a warp-specialized loop (rules/pipelined.py)
            self.emit(self._wg_after_commit_line)
        if self._wg_async is s:  # T.Pipelined keeps one group in flight (rules/pipelined.py)
            if not self._wg_defer_wait:  # else the pipeline waits after issuing its refill
                self.add(Intrinsic("wgmma_wait", [], [], {"n": 1}))
        elif wg_wait < 0 and self._wg_defer_ok:  # waited for where a later statement needs it (codegen.stmt)
            log.debug("%s: T.gemm(wg_wait=-1): wgmma group left in flight until its accumulator or operands are "
                      "next touched", s.loc)
            self._wg_pending.append(s)
        else:
            if wg_wait != 0:
                log.debug("%s: T.gemm(wg_wait=%d) outside a warp-specialized pipelined loop body: waits for its own "
                          "wgmma", s.loc, wg_wait)
            self.add(Intrinsic("wgmma_wait", [], [], {"n": 0}))
            self.add(Intrinsic("wgmma_fence_operands", [], [], {"buffer": c}))
        self.add(Scope(self.end()))
        # the accumulator registers are in (block, n8, half, column) order: checked here
        for h, cc, k in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)):
            st = fc.reg_stride(0, Axis("r", 2, 8)) * h + fc.reg_stride(1, Axis("r", 2, 1)) * cc
            if st != k:
                raise CompileError(f"T.gemm accumulator {c}: registers not in wgmma order ({fc})", s.loc)
