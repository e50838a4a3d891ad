"""CUDA lowering of T.gemm on sm_90a: wgmma.mma_async with shared operands named by swizzled smem
descriptors (A from shared memory or registers), fp32 accumulators in the wgmma register layout.

Operand tiles are planned by rules/gemm.py's swizzle planning (the canonical 128-byte-swizzle layout,
atom column by atom column, or the 64 / 32-byte swizzles for narrow K-major rows) and placed on 1 KiB
boundaries; codegen puts fence.proxy.async before every barrier of a kernel that has wgmma (shared
memory written by threads / cp.async is read next by the async proxy). Instructions per tile: for
each k16 step, each m64 block of the warpgroup's rows and each <= 256-wide column slice, one
`tilehal::Wgmma16<N>::ss / rs`; then one commit and wgmma_wait<0> (the accumulators are read by the
next statement, and the pipeline refills the stages right after the next barrier).
"""

from __future__ import annotations

from ....errors import CompileError
from ....ir.layout import Axis, Fragment
from ....ir.nodes import Gemm, Region
from ..common import esize, log
from ..infer import GemmPlan


class WgmmaRules:
    def _wg_reg(self, f: Fragment, i: str, j: str, h: str, c: str) -> str:
        """Register of (m64 block i, n8 chunk j, half h, column c) in a wgmma accumulator layout (an
        mma.sync layout with one m16 tile per warp is the single-block case)."""
        want = {(0, 64): i, (1, 8): j, (0, 8): h, (1, 1): c}
        terms = []
        for d, a in f.reg_order:
            key = (d, a.coeff)
            if key not in want:
                raise CompileError(f"layout {f} is not a wgmma fragment", self.kernel.loc)
            terms.append(f"({want[key]}) * {f.reg_stride(d, a)}")
        return " + ".join(terms) or "0"

    def _wg_operand(self, r: Region, major: str, row0: str, kk: str) -> tuple[str, str, int, int]:
        """(base pointer, offset in 16-byte units (the descriptor's address unit) of the k16 step `kk` for
        the 64 (A) or N (B) rows / columns starting at `row0`, swizzle mode, descriptor leading / stride
        bytes) of a wgmma operand in shared memory. Every term is a whole number of units, so each is
        scaled separately: after unrolling, a loop-invariant part plus a constant per instruction."""
        b = r.buffer
        rows, cols = b.static_shape()
        es = esize(b.dtype)
        row_bytes = cols * es
        base = f"&{b.name}[{self.smem_offset(b, ['0', '0'])}]"
        ke = 32 // es  # elements of one k step: 32 bytes (k16 of 16-bit types, k32 of fp8)
        if major == "K":  # a k step is 32 bytes: 2 units
            if row_bytes % 128 == 0:
                atom = 128 // es
                off = (f"(({kk}) * {ke} / {atom}) * {rows * 8} + ({row0}) * 8 + ((({kk}) * {ke}) % {atom}) / {ke} * 2"
                       if row_bytes > 128 else f"({row0}) * 8 + ({kk}) * 2")
                return base, off, 1, 1024
            if row_bytes == 64:
                return base, f"({row0}) * 4 + ({kk}) * 2", 2, 512
            return base, f"({row0}) * 2", 3, 256
        # MN-major: 64-element atoms along the contiguous (M or N) dim, `rows` K-rows each
        off = f"(({row0}) / 64) * {rows * 8} + ({kk}) * 128"
        return base, off, 1, 1024

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
        self.emit(f"// T.gemm {m}x{n}x{kdim} {s.A.buffer.dtype}: wgmma.mma_async m64n{NINST}k{ks}, A {plan.a_major}, "
                  f"B {plan.b_major}-major, warpgroups {wgm}x{wgn}")
        self.open("")
        self.emit("const int _wg = _tx >> 7;")
        self.emit(f"const int _wgr = _wg % {wgm}, _wgc = _wg / {wgm};")
        # the hardware swizzle is a function of the address: operand tiles sit on 1024-byte boundaries
        tb = 1 if plan.b_major == "MN" else 0
        bbase, boff, bswz, bsbo = self._wg_operand(s.B, plan.b_major, f"_wgc * {NW} + _ni * {NINST}", "_kk")
        blbo = s.B.buffer.static_shape()[0] * 128 if plan.b_major == "MN" else 16
        self.emit(f"const tilehal::u64 _db = tilehal::make_smem_desc({bbase}, tilehal::SmemSwizzle({bswz}), {blbo}, "
                  f"{bsbo});")
        if plan.a_major != "reg":
            ta = 1 if plan.a_major == "MN" else 0
            abase, aoff, aswz, asbo = self._wg_operand(s.A, plan.a_major, f"_wgr * {MW} + _mi * 64", "_kk")
            albo = s.A.buffer.static_shape()[0] * 128 if plan.a_major == "MN" else 16
            self.emit(f"const tilehal::u64 _da = tilehal::make_smem_desc({abase}, tilehal::SmemSwizzle({aswz}), "
                      f"{albo}, {asbo});")
        self.emit("tilehal::wgmma_fence();")
        self.emit("#pragma unroll")
        self.open(f"for (int _kk = 0; _kk < {kdim // ks}; ++_kk)")
        scale = "(_kk > 0)" if s.clear_accum else "1"
        self.emit("#pragma unroll")
        self.open(f"for (int _mi = 0; _mi < {MI}; ++_mi)")
        if plan.a_major == "reg":
            fa = self.inf.layouts[s.A.buffer]
            an = s.A.buffer.name
            cstride = fa.reg_stride(1, Axis("r", 2, 1))
            self.emit("tilehal::u32 _a[4];")
            for i, (j, h) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                r = self._wg_reg(fa, "_mi", f"2 * _kk + {j}", str(h), "0")
                self.emit(f"_a[{i}] = tilehal::pack2_bits({an}[{r}], {an}[{r} + {cstride}]);")
        self.emit("#pragma unroll")
        self.open(f"for (int _ni = 0; _ni < {NI}; ++_ni)")
        creg = self._wg_reg(fc, "_mi", f"_ni * {NINST // 8}", "0", "0")
        bdesc = f"tilehal::desc_advance(_db, {boff})"
        if plan.a_major == "reg":
            self.emit(f"tilehal::Wgmma16<{NINST}>::rs<{tb}>({tag}, &{c}[{creg}], _a, {bdesc}, {scale});")
        else:
            adesc = f"tilehal::desc_advance(_da, {aoff})"
            if s.A.buffer.dtype == "float8_e4m3":  # K-major A and B (fp8 wgmma has no transpose)
                self.emit(f"tilehal::WgmmaE4M3<{NINST}>::mma(&{c}[{creg}], {adesc}, {bdesc}, {scale});")
            else:
                self.emit(f"tilehal::Wgmma16<{NINST}>::ss<{ta}, {tb}>({tag}, &{c}[{creg}], {adesc}, {bdesc}, {scale});")
        self.close()
        self.close()
        self.close()
        self.emit("tilehal::wgmma_commit();")
        if self._wg_after_commit is s:  # the pingpong turn of a warp-specialized loop (rules/pipelined.py)
            self.emit(self._wg_after_commit_line)
        if self._wg_async is s:  # T.Pipelined keeps one group in flight (rules/pipelined.py)
            if not self._wg_defer_wait:  # else the pipeline waits after issuing its refill
                self.emit("tilehal::wgmma_wait<1>();")
        else:
            if wg_wait > 0:
                log.debug("%s: T.gemm(wg_wait=%d) outside a pipelined loop's tail: waits for its own wgmma",
                          s.loc, wg_wait)
            self.emit("tilehal::wgmma_wait<0>();")
            self.emit(f"tilehal::wgmma_fence_operands({c});")
        self.close()
        # the accumulator registers are in (block, n8, half, column) order: checked here
        for h, cc, k in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)):
            st = fc.reg_stride(0, Axis("r", 2, 8)) * h + fc.reg_stride(1, Axis("r", 2, 1)) * cc
            if st != k:
                raise CompileError(f"T.gemm accumulator {c}: registers not in wgmma order ({fc})", s.loc)
