"""CUDA lowering of T.gemm: ldmatrix + mma.sync with swizzled shared operands, or FMA on CUDA cores
(wgmma.mma_async: rules/wgmma.py)."""

from __future__ import annotations

import math

import numpy as np

from ....errors import CompileError
from ....ir import dtypes as dt
from ....ir.layout import Axis, Fragment
from ....ir.nodes import Alloc, Buffer, Copy, Gemm, Region
from ..common import _LOW, _MMA_TAG, esize, log, value_type
from ..infer import GemmPlan


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

    def _smem_addr(self, r: Region, row: str, col: str) -> str:
        rd, cd = r.matrix_dims()
        idx = [self.expr(x) for x in r.starts]
        idx[rd] = f"({idx[rd]} + {row})"
        idx[cd] = f"({idx[cd]} + {col})"
        return f"&{r.buffer.name}[{self.smem_offset(r.buffer, idx)}]"

    def _mma_reg(self, f: Fragment, mi: str, nj: str, h: str, c: str) -> str:
        """Register of (m16 tile mi, n8 tile nj, half h, column c) in an mma-shaped layout."""
        want = {(0, 16): mi, (1, 8): nj, (0, 8): h, (1, 1): c}
        terms = []
        for d, a in f.reg_order:
            key = (d, a.coeff)
            if key not in want:
                raise CompileError(f"layout {f} is not an mma.sync fragment", self.kernel.loc)
            terms.append(f"({want[key]}) * {f.reg_stride(d, a)}")
        return " + ".join(terms) or "0"

    def gemm_mma(self, s: Gemm, plan: GemmPlan) -> None:
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        wm, wn = plan.warps_m, plan.warps_n
        WM, WN = m // wm, n // wn
        MI, NJ = WM // 16, WN // 8
        ks = plan.kstep
        tag = _MMA_TAG[s.A.buffer.dtype]
        fc = self.inf.layouts[s.C.buffer]
        c = s.C.buffer.name
        acc_t = "int" if s.C.buffer.dtype == "int32" else "float"
        self.emit(f"// T.gemm {m}x{n}x{kdim} {s.A.buffer.dtype}: mma.sync m16n8k{ks}, warps {wm}x{wn}")
        self.open("")
        self.emit("const int _warp = _tx >> 5, _lane = _tx & 31;")
        self.emit(f"const int _wm = (_warp / {wn}) % {wm} * {WM}, _wn = (_warp % {wn}) * {WN};")
        if s.clear_accum:
            self.emit("#pragma unroll")
            self.emit(f"for (int _i = 0; _i < {fc.nregs}; ++_i) {c}[_i] = 0;")
        self.emit("const int _q = _lane >> 3, _r8 = _lane & 7;")
        self.emit("#pragma unroll")
        self.open(f"for (int _kk = 0; _kk < {kdim // ks}; ++_kk)")
        self.emit(f"tilehal::u32 _a[{MI}][4];")
        self.emit(f"tilehal::u32 _b[{NJ}][2];")
        kcol = "(_q >> 1) * 8" if ks == 16 else "(_q >> 1) * 16"
        # A
        self.emit("#pragma unroll")
        self.open(f"for (int _mi = 0; _mi < {MI}; ++_mi)")
        if s.A.buffer.scope == "fragment":
            fa = self.inf.layouts[s.A.buffer]
            an = s.A.buffer.name
            regs = [self._mma_reg(fa, "_mi", f"2 * _kk + {j}", str(h), "0") for j, h in ((0, 0), (0, 1), (1, 0), (1, 1))]
            for i, r in enumerate(regs):
                self.emit(f"_a[_mi][{i}] = tilehal::pack2_bits({an}[{r}], {an}[{r} + {fa.reg_stride(1, Axis('r', 2, 1))}]);")
        elif not s.transpose_A:
            row = "_wm + _mi * 16 + (_q & 1) * 8 + _r8"
            col = f"_kk * {ks} + {kcol}"
            self.emit(f"tilehal::ldmatrix_x4(_a[_mi], {self._smem_addr(s.A, row, col)});")
        else:
            row = "_kk * 16 + (_q >> 1) * 8 + _r8"
            col = "_wm + _mi * 16 + (_q & 1) * 8"
            self.emit(f"tilehal::ldmatrix_x4_trans(_a[_mi], {self._smem_addr(s.A, row, col)});")
        self.close()
        # B, two n8 tiles per ldmatrix.x4
        self.emit("#pragma unroll")
        self.open(f"for (int _p = 0; _p < {NJ // 2}; ++_p)")
        self.emit("tilehal::u32 _t[4];")
        if s.transpose_B:
            row = "_wn + (_p * 2 + (_q >> 1)) * 8 + _r8"
            col = f"_kk * {ks} + (_q & 1) * {ks // 2}"
            self.emit(f"tilehal::ldmatrix_x4(_t, {self._smem_addr(s.B, row, col)});")
        else:
            row = "_kk * 16 + (_q & 1) * 8 + _r8"
            col = "_wn + (_p * 2 + (_q >> 1)) * 8"
            self.emit(f"tilehal::ldmatrix_x4_trans(_t, {self._smem_addr(s.B, row, col)});")
        self.emit("_b[2 * _p][0] = _t[0]; _b[2 * _p][1] = _t[1]; _b[2 * _p + 1][0] = _t[2]; _b[2 * _p + 1][1] = _t[3];")
        self.close()
        self.emit("#pragma unroll")
        self.open(f"for (int _mi = 0; _mi < {MI}; ++_mi)")
        self.emit("#pragma unroll")
        self.open(f"for (int _nj = 0; _nj < {NJ}; ++_nj)")
        creg = self._mma_reg(fc, "_mi", "_nj", "0", "0")
        fn = "mma_m16n8k16" if ks == 16 else "mma_m16n8k32"
        self.emit(f"tilehal::{fn}(tilehal::{tag}(), *reinterpret_cast<{acc_t}(*)[4]>(&{c}[{creg}]), _a[_mi], _b[_nj]);")
        self.close()
        self.close()
        self.close()
        self.close()
        # the accumulator registers are in (mi, nj, h, c) order with (h, c) innermost: checked here
        for h, cc, k in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)):
            try:
                st = fc.reg_stride(0, Axis("r", 2, 8)) * h + fc.reg_stride(1, Axis("r", 2, 1)) * cc
            except KeyError:
                st = k
            if st != k:
                raise CompileError(f"T.gemm accumulator {c}: registers not in mma order ({fc})", s.loc)

    def gemm_simt(self, s: Gemm, plan: GemmPlan) -> None:
        cbuf = s.C.buffer
        f = self.inf.layouts[cbuf]
        m, n = s.C.as_2d()
        kdim = s.A.as_2d()[0] if s.transpose_A else s.A.as_2d()[1]
        acc_t = dt.compute_type(cbuf.dtype)
        ct = value_type(acc_t)
        self.emit(f"// T.gemm {m}x{n}x{kdim} on CUDA cores ({plan.reason})")
        staged = {}
        off = 0
        for r in (s.A, s.B):
            if r.buffer.scope == "fragment" and r.buffer not in staged:
                staged[r.buffer] = off
                off += int(np.prod(r.buffer.static_shape()))
        if staged:
            base = self.scratch(off * 8)
            self.emit("__syncthreads();")
            for b, o in staged.items():
                self.stage_fragment(b, True, f"((({value_type(b.dtype)}*){base}) + {o})")
            self.emit("__syncthreads();")

        def operand(r: Region, row: str, col: str) -> str:
            b = r.buffer
            rd, cd = r.matrix_dims()
            if b in staged:
                shape = b.static_shape()
                idx = [self.expr(x) for x in r.starts]
                if rd >= 0:
                    idx[rd] = f"({idx[rd]} + {row})"
                if cd >= 0:
                    idx[cd] = f"({idx[cd]} + {col})"
                flat = idx[0]
                for d in range(1, len(idx)):
                    flat = f"({flat}) * {shape[d]} + {idx[d]}"
                return f"((({value_type(b.dtype)}*){base}) + {staged[b]})[{flat}]"
            idx = [self.expr(x) for x in r.starts]
            if rd >= 0:
                idx[rd] = f"({idx[rd]} + {row})"
            if cd >= 0:
                idx[cd] = f"({idx[cd]} + {col})"
            ref = self.mem_ref(b, idx)
            return f"tilehal::to_float({ref})" if b.dtype in _LOW else ref

        names = [self.fresh("i"), self.fresh("j")]
        cn = [nm for nm in names]

        def body(regvars):
            reg = self._reg_by_axes(f, f, regvars)
            i, j = cn
            a = operand(s.A, "_k", i) if s.transpose_A else operand(s.A, i, "_k")
            b = operand(s.B, j, "_k") if s.transpose_B else operand(s.B, "_k", j)
            self.emit(f"{ct} _acc = 0;")
            self.open(f"for (int _k = 0; _k < {kdim}; ++_k)")
            self.emit(f"_acc += (({ct})({a})) * (({ct})({b}));")
            self.close()
            old = f"tilehal::to_float({cbuf.name}[{reg}])" if cbuf.dtype in _LOW else f"{cbuf.name}[{reg}]"
            val = "_acc" if s.clear_accum else f"({old} + _acc)"
            self.emit(f"{cbuf.name}[{reg}] = {self.conv(val, acc_t, cbuf.dtype)};")

        if len(f.shape) != 2:
            raise CompileError(f"T.gemm accumulator {cbuf.name} must be 2-D", s.loc)
        self.layout_loop(f, names, body)
        if staged:
            self.emit("__syncthreads();")
