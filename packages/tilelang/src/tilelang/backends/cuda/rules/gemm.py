"""CUDA lowering of T.gemm: ldmatrix + mma.sync with swizzled shared operands, or FMA on CUDA cores
(wgmma.mma_async: rules/wgmma.py); thread-level nodes (lower_thread.py) with ldmatrix / mma.sync intrinsics."""

from __future__ import annotations

import math

import numpy as np

from ....errors import CompileError
from ....ir import dtypes as dt
from ....ir.layout import Axis, Fragment
from ....ir.nodes import Alloc, Buffer, Cast, Const, Copy, Expr, For, Gemm, Region, Seq
from ....ir.thread import Barrier, Intrinsic, RegBuffer, Scope
from ..common import _LOW, _MMA_TAG, esize, log, value_type
from ..emit import Comment, Conv, Decl, ElemRef, NamedRef, OneLine, Ref, RegArray, ToFloat, TStore
from ..infer import GemmPlan
from ..lower_thread import TX, B, C, P, total


class GemmRules:
    def _plan_swizzle(self) -> None:
        """XOR swizzles of the shared operands of tensor-core gemms: (shift, mask, log2 elements per 16
        bytes, atom). 128-byte rows get chunk ^= row % 8 (ldmatrix rows hit distinct banks); the operands
        of wgmma with rows of several 128-byte atoms are stored atom-column by atom-column (`atom` =
        elements per 128 bytes: element (r, c) at (c // atom) * rows * atom + r * atom + swizzled c % atom),
        which is the canonical 128-byte-swizzle layout a wgmma descriptor names; 64 / 32-byte rows get
        the 64 / 32-byte swizzle patterns (the same bits as the hardware modes of those names)."""
        self.swizzled: dict[Buffer, tuple[int, int, int, int]] = {}
        self.wgmma_bufs: set[Buffer] = set()
        for s in self.all_stmts:
            if not isinstance(s, Gemm) or self.inf.gemms[id(s)].kind not in ("mma", "wgmma"):
                continue
            wg = self.inf.gemms[id(s)].kind == "wgmma"
            for r in (s.A, s.B):
                b = r.buffer
                if b.scope != "shared" or b.ndim != 2:
                    continue
                if wg:
                    self.wgmma_bufs.add(b)
                row_bytes = b.static_shape()[-1] * esize(b.dtype)
                lv = int(math.log2(16 // esize(b.dtype)))
                if row_bytes % 128 == 0:
                    atom = 128 // esize(b.dtype) if (wg or b in self.wgmma_bufs) and row_bytes > 128 else 0
                    self.swizzled[b] = (0, 7, lv, max(atom, self.swizzled.get(b, (0, 0, 0, 0))[3]))
                elif row_bytes == 64:
                    self.swizzled[b] = (1, 3, lv, 0)
                elif row_bytes == 32:
                    self.swizzled[b] = (2, 1, lv, 0)
        # a shared tile a fragment in the mma / wgmma accumulator layout is copied to or from: eight rows
        # of one column group per access, which without the swizzle hit one bank (e.g. an epilogue's
        # staging tile)
        mma_frags = {b for b, f in self.inf.layouts.items() if any(a.kind == "t" and a.tstride == 4 and a.extent == 8
                                                                  for a in f.dims[0])} if self.inf.layouts else set()
        staged = set()
        for s in self.all_stmts:
            if isinstance(s, Copy) and {s.src.buffer.scope, s.dst.buffer.scope} == {"fragment", "shared"}:
                fr, sh = (s.src.buffer, s.dst.buffer) if s.src.buffer.scope == "fragment" else (s.dst.buffer,
                                                                                                  s.src.buffer)
                if fr in mma_frags and sh.ndim == 2 and sh not in self.swizzled and sh.static_shape() is not None:
                    staged.add(sh)
        # T.annotate_layout({buf: make_swizzled_layout(buf)}) on other shared buffers: the same swizzle
        for s in self.all_stmts:
            if not isinstance(s, Alloc) or s.buffer in self.swizzled or (s.buffer.layout is None and
                                                                         s.buffer not in staged):
                continue
            b = s.buffer
            kind = "swizzled" if b in staged else getattr(b.layout, "kind", None)
            if b.scope != "shared" or kind != "swizzled" or b.ndim != 2 or b.static_shape() is None:
                log.debug("%s: layout annotation %r of %s (%s) has no effect on cuda", s.loc, b.layout, b.name,
                          b.scope)
                continue
            row_bytes = b.static_shape()[-1] * esize(b.dtype)
            lv = int(math.log2(max(1, 16 // esize(b.dtype))))
            swz = {64: (1, 3, lv, 0), 32: (2, 1, lv, 0)}.get(row_bytes, (0, 7, lv, 0) if row_bytes % 128 == 0 else None)
            if swz is None:
                log.debug("%s: make_swizzled_layout(%s): %d-byte rows have no swizzle here; kept row-major", s.loc,
                          b.name, row_bytes)
                continue
            self.swizzled[b] = swz
            log.debug("%s: %s swizzled (%s; 16-byte chunk ^ row pattern of %d-byte rows)", s.loc, b.name,
                      "a fragment's staging tile" if b in staged else "as annotated", min(row_bytes, 128))

    def gemm(self, s: Gemm) -> None:
        plan = self.inf.gemms[id(s)]
        if plan.kind == "wgmma":
            return self.gemm_wgmma(s, plan)
        if plan.kind == "mma":
            return self.gemm_mma(s, plan)
        return self.gemm_simt(s, plan)

    def _smem_addr(self, r: Region, row: Expr, col: Expr) -> Ref:
        """The shared element at (row, col) of operand tile `r` (an ldmatrix row address)."""
        rd, cd = r.matrix_dims()
        idx = [self.lower_expr(x) for x in r.starts]
        idx[rd] = P(B(idx[rd], "+", row))
        idx[cd] = P(B(idx[cd], "+", col))
        return Ref(self.tbuf(r.buffer), [self.smem_offset_x(r.buffer, idx)])

    def _mma_reg(self, f: Fragment, mi: Expr, nj: Expr, h: Expr, c: Expr) -> Expr:
        """Register of (m16 tile mi, n8 tile nj, half h, column c) in an mma-shaped layout."""
        want = {(0, 16): mi, (1, 8): nj, (0, 8): h, (1, 1): c}
        terms = []
        for d, a in f.reg_order:
            key = (d, a.coeff)
            if key not in want:
                raise CompileError(f"layout {f} is not an mma.sync fragment", self.kernel.loc)
            terms.append(B(P(want[key]), "*", C(f.reg_stride(d, a))))
        return total(terms) or C(0)

    def gemm_mma(self, s: Gemm, plan: GemmPlan) -> None:
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        wm, wn = plan.warps_m, plan.warps_n
        WM, WN = m // wm, n // wn
        MI, NJ = WM // 16, WN // 8
        ks = plan.kstep
        tag = _MMA_TAG[s.A.buffer.dtype]
        fc = self.inf.layouts[s.C.buffer]
        c = s.C.buffer
        acc_t = "int" if c.dtype == "int32" else "float"
        unroll = {"c_extent_bound": True}
        v = self.v
        warp, lane, wm_, wn_, q, r8 = (v(x) for x in ("_warp", "_lane", "_wm", "_wn", "_q", "_r8"))
        kk, mi, p, nj, i = v("_kk"), v("_mi"), v("_p"), v("_nj"), v("_i")
        self.add(Comment(f"T.gemm {m}x{n}x{kdim} {s.A.buffer.dtype}: mma.sync m16n8k{ks}, warps {wm}x{wn}", loc=s.loc))
        self.begin()  # the scope
        self.add(Decl([warp, lane], [B(TX, ">>", C(5)), B(TX, "&", C(31))]))
        self.add(Decl([wm_, wn_], [B(B(P(B(warp, "/", C(wn))), "%", C(wm)), "*", C(WM)), B(P(B(warp, "%", C(wn))), "*", C(WN))]))
        if s.clear_accum:
            self.add(For(i, C(0), C(fc.nregs), "unroll", TStore(self.reg_ref(c, i), C(0)),
                         annotations={"c_extent_bound": True, "c_one_line": True}))
        self.add(Decl([q, r8], [B(lane, ">>", C(3)), B(lane, "&", C(7))]))
        self.begin()  # the k loop
        ra = Buffer("_a", (C(MI), C(4)), "int32", "local")
        rb = Buffer("_b", (C(NJ), C(2)), "int32", "local")
        rt = Buffer("_t", (C(4),), "int32", "local")
        self.add(RegArray(ra, "tilehal::u32"))
        self.add(RegArray(rb, "tilehal::u32"))
        kcol = B(P(B(q, ">>", C(1))), "*", C(8 if ks == 16 else 16))
        a_regs = [ElemRef(ra, [mi, C(j)]) for j in range(4)]
        # A
        self.begin()
        if s.A.buffer.scope == "fragment":
            fa = self.inf.layouts[s.A.buffer]
            two = fa.reg_stride(1, Axis("r", 2, 1))
            for j, (kj, h) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                reg = self._mma_reg(fa, mi, B(B(C(2), "*", kk), "+", C(kj)), C(h), C(0))
                self.add(Intrinsic("pack2_bits", [a_regs[j]], [self.reg_ref(s.A.buffer, reg),
                                                              self.reg_ref(s.A.buffer, B(reg, "+", C(two)))],
                                   {"dtype": s.A.buffer.dtype}))
        elif not s.transpose_A:
            row = B(B(B(wm_, "+", B(mi, "*", C(16))), "+", B(P(B(q, "&", C(1))), "*", C(8))), "+", r8)
            col = B(B(kk, "*", C(ks)), "+", kcol)
            self.add(Intrinsic("ldmatrix_x4", a_regs, [self._smem_addr(s.A, row, col)]))
        else:
            row = B(B(B(kk, "*", C(16)), "+", B(P(B(q, ">>", C(1))), "*", C(8))), "+", r8)
            col = B(B(wm_, "+", B(mi, "*", C(16))), "+", B(P(B(q, "&", C(1))), "*", C(8)))
            self.add(Intrinsic("ldmatrix_x4_trans", a_regs, [self._smem_addr(s.A, row, col)]))
        self.add(For(mi, C(0), C(MI), "unroll", self.end(), annotations=unroll))
        # B, two n8 tiles per ldmatrix.x4
        self.begin()
        self.add(RegArray(rt, "tilehal::u32"))
        t_regs = [ElemRef(rt, [C(j)]) for j in range(4)]
        pair = B(P(B(p, "*", C(2))), "+", P(B(q, ">>", C(1))))
        if s.transpose_B:
            row = B(B(wn_, "+", B(P(B(B(p, "*", C(2)), "+", P(B(q, ">>", C(1))))), "*", C(8))), "+", r8)
            col = B(B(kk, "*", C(ks)), "+", B(P(B(q, "&", C(1))), "*", C(ks // 2)))
            self.add(Intrinsic("ldmatrix_x4", t_regs, [self._smem_addr(s.B, row, col)]))
        else:
            row = B(B(B(kk, "*", C(16)), "+", B(P(B(q, "&", C(1))), "*", C(8))), "+", r8)
            col = B(wn_, "+", B(P(B(B(p, "*", C(2)), "+", P(B(q, ">>", C(1))))), "*", C(8)))
            self.add(Intrinsic("ldmatrix_x4_trans", t_regs, [self._smem_addr(s.B, row, col)]))
        del pair
        p2 = B(C(2), "*", p)
        p21 = B(B(C(2), "*", p), "+", C(1))
        self.add(OneLine(Seq([TStore(ElemRef(rb, [p2, C(0)]), t_regs[0]), TStore(ElemRef(rb, [p2, C(1)]), t_regs[1]),
                              TStore(ElemRef(rb, [p21, C(0)]), t_regs[2]), TStore(ElemRef(rb, [p21, C(1)]), t_regs[3])])))
        self.add(For(p, C(0), C(NJ // 2), "unroll", self.end(), annotations=unroll))
        creg = self._mma_reg(fc, mi, nj, C(0), C(0))
        fn = "mma_m16n8k16" if ks == 16 else "mma_m16n8k32"
        outs = [self.reg_ref(c, creg if k == 0 else B(creg, "+", C(k))) for k in range(4)]
        ins = [ElemRef(ra, [mi, C(j)]) for j in range(4)] + [ElemRef(rb, [nj, C(j)]) for j in range(2)] + list(outs)
        mma = Intrinsic(fn, outs, ins, {"dtype": s.A.buffer.dtype, "tag": tag, "acc_ctype": acc_t})
        inner = For(nj, C(0), C(NJ), "unroll", mma, annotations=unroll)
        self.add(For(mi, C(0), C(MI), "unroll", inner, annotations=unroll))
        self.add(For(kk, C(0), C(kdim // ks), "unroll", self.end(), annotations=unroll))
        self.add(Scope(self.end()))
        # the accumulator registers are in (mi, nj, h, c) order with (h, c) innermost: checked here
        for h, cc, k in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)):
            try:
                st = fc.reg_stride(0, Axis("r", 2, 8)) * h + fc.reg_stride(1, Axis("r", 2, 1)) * cc
            except KeyError:
                st = k
            if st != k:
                raise CompileError(f"T.gemm accumulator {c.name}: registers not in mma order ({fc})", s.loc)

    def gemm_simt(self, s: Gemm, plan: GemmPlan) -> None:
        cbuf = s.C.buffer
        f = self.inf.layouts[cbuf]
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        acc_t = dt.compute_type(cbuf.dtype)
        self.add(Comment(f"T.gemm {m}x{n}x{kdim} on CUDA cores ({plan.reason})", loc=s.loc))
        staged = {}
        off = 0
        for r in (s.A, s.B):
            if r.buffer.scope == "fragment" and r.buffer not in staged:
                staged[r.buffer] = off
                off += int(np.prod(r.buffer.static_shape()))
        views = {}
        if staged:
            base = self.scratch(off * 8)
            self.add(Barrier())
            for b, o in staged.items():
                at = f"((({value_type(b.dtype)}*){base}) + {o})"
                self._scratch_offsets[at] = o * esize(dt.compute_type(b.dtype))
                self.stage_fragment(b, True, at)
                views[b] = (self.scratch_buf(dt.compute_type(b.dtype), at), at)
            self.add(Barrier())
        k = self.v("_k")

        def operand(r: Region, row: Expr, col: Expr) -> Expr:
            b = r.buffer
            rd, cd = r.matrix_dims()
            idx = [self.lower_expr(x) for x in r.starts]
            if rd >= 0:
                idx[rd] = P(B(idx[rd], "+", row))
            if cd >= 0:
                idx[cd] = P(B(idx[cd], "+", col))
            if b in staged:
                shape = b.static_shape()
                flat = idx[0]
                for d in range(1, len(idx)):
                    flat = B(B(P(flat), "*", C(shape[d])), "+", idx[d])
                view, at = views[b]
                return NamedRef(view, [flat], text=at)
            ref = self.mem_ref_x(b, idx)
            return ToFloat(ref) if b.dtype in _LOW else ref

        names = [self.fresh("i"), self.fresh("j")]

        def body(regvars):
            reg = self._reg_by_axes_x(f, f, regvars)
            i, j = (self.v(x) for x in names)
            a = operand(s.A, k, i) if s.transpose_A else operand(s.A, i, k)
            b = operand(s.B, j, k) if s.transpose_B else operand(s.B, k, j)
            acc_b = Buffer("_acc", (C(1),), acc_t, "local")
            acc = Ref(acc_b, [C(0)], True)
            self.add(RegBuffer(acc_b, None, Const(0, dt.INDEX), scalar=True))
            self.add(For(k, C(0), C(kdim), "serial", TStore(acc, B(Cast(a, acc_t), "*", Cast(b, acc_t), acc_t), op="+"),
                         annotations={"c_extent_bound": True}))
            old: Expr = self.reg_ref(cbuf, reg)
            old = ToFloat(old) if cbuf.dtype in _LOW else old
            val: Expr = acc if s.clear_accum else P(B(old, "+", acc, acc_t))
            self.add(TStore(self.reg_ref(cbuf, reg), Conv(acc_t, cbuf.dtype, val)))

        if len(f.shape) != 2:
            raise CompileError(f"T.gemm accumulator {cbuf.name} must be 2-D", s.loc)
        self.layout_loop(f, names, body)
        if staged:
            self.add(Barrier())
