"""CUDA lowering of T.copy: cp.async, 16-byte vectors, element-wise with masks, fragment <-> memory."""

from __future__ import annotations

import numpy as np

from ....errors import CompileError
from ....ir.layout import Axis, Fragment
from ....ir.nodes import Const, Copy, Region
from ..common import _LOW, _divisible, cuda_type, esize


class CopyRules:
    def _vector_width(self, src: Region, dst: Region, limit_bytes: int = 16) -> int:
        """Elements per vector for a copy between two memory regions (1 when alignment is unprovable)."""
        if src.buffer.dtype != dst.buffer.dtype:
            return 1
        es = esize(src.buffer.dtype)
        ext = src.squeezed()
        if not ext:
            return 1
        last = ext[-1]
        for r in (src, dst):
            rd, cd = r.matrix_dims()
            if cd != r.buffer.ndim - 1 or r.extents[cd] != last:
                return 1
        v = max(1, limit_bytes // es)
        while v > 1:
            ok = last % v == 0
            for r in (src, dst):
                size = r.buffer.shape[-1]
                ok = ok and isinstance(size, Const) and int(size.value) % v == 0 and _divisible(r.starts[-1], v)
            if ok:
                return v
            v //= 2
        return 1

    def _async_copy_ok(self, c: Copy) -> bool:
        if c.src.buffer.scope != "global" or c.dst.buffer.scope != "shared":
            return False
        v = self._vector_width(c.src, c.dst)
        return v * esize(c.src.buffer.dtype) in (4, 8, 16)

    def copy(self, s: Copy) -> None:
        src, dst = s.src, s.dst
        ss, ds = src.buffer.scope, dst.buffer.scope
        if src.squeezed() != dst.squeezed():
            raise CompileError(f"T.copy: shape mismatch {tuple(src.extents)} vs {tuple(dst.extents)}", s.loc)
        if ss == "fragment" and ds == "fragment":
            fa, fb = self.inf.layouts[src.buffer], self.inf.layouts[dst.buffer]
            if fa.same_mapping(fb) and self._full(src) and self._full(dst):
                names = [self.fresh("i") for _ in fb.shape]
                f = fb

                def body(regvars):
                    ra = self._reg_by_axes(fa, f, regvars)
                    rb = self._reg_by_axes(fb, f, regvars)
                    self.emit(f"{dst.buffer.name}[{rb}] = {self.conv(f'{src.buffer.name}[{ra}]', src.buffer.dtype, dst.buffer.dtype)};")

                self.layout_loop(f, names, body)
                return
            return self.copy_via_scratch(s)
        if ss == "fragment" or ds == "fragment":
            return self.copy_fragment(s)
        if ss == "local" or ds == "local" or ss == "var" or ds == "var":
            return self.copy_elementwise(s, uniform=True)
        if ss == "global" and ds == "shared" and self._async_copy_ok(s):
            self.copy_async(s)
            self.emit("tilehal::cp_async_commit();")
            self.emit("tilehal::cp_async_wait<0>();")
            return
        v = self._vector_width(src, dst)
        if v > 1:
            return self.copy_vector(s, v)
        self.copy_elementwise(s)

    def copy_async(self, s: Copy) -> None:
        src, dst = s.src, s.dst
        v = self._vector_width(src, dst)
        nbytes = v * esize(src.buffer.dtype)
        ext = [str(x) for x in (src.squeezed() or [1])]
        ext_v = ext[:-1] + [str(int(ext[-1]) // v)]
        names = self._tile_names(src)

        def body():
            coords = names[:-1] + [f"{names[-1]} * {v}"]
            si = self.region_idx(src, coords if src.squeezed() else [])
            di = self.region_idx(dst, coords if dst.squeezed() else [])
            pred = self.in_bounds(src, si)
            sref = f"&{src.buffer.name}[{self.flat_index(src.buffer, si)}]"
            dref = f"&{dst.buffer.name}[{self.smem_offset(dst.buffer, di)}]"
            if pred:
                sref = f"(({pred}) ? (const void*)({sref}) : (const void*){src.buffer.name})"
            fn = "cp_async_16" if nbytes == 16 else f"cp_async_{nbytes}"
            self.emit(f"tilehal::{fn}({dref}, {sref}{', ' + pred if pred else ''});")

        self.flat_loop(ext_v, names, body)

    def copy_vector(self, s: Copy, v: int) -> None:
        src, dst = s.src, s.dst
        ext = [str(x) for x in (src.squeezed() or [1])]
        ext_v = ext[:-1] + [str(int(ext[-1]) // v)]
        names = self._tile_names(src)
        t = cuda_type(src.buffer.dtype)

        def body():
            coords = names[:-1] + [f"{names[-1]} * {v}"]
            si = self.region_idx(src, coords)
            di = self.region_idx(dst, coords)
            sp, dp = self.in_bounds(src, si), self.in_bounds(dst, di)
            sref = f"&{self.mem_ref(src.buffer, si)}"
            dref = f"&{self.mem_ref(dst.buffer, di)}"
            vt = f"tilehal::Vec<{t}, {v}>"
            tmp = self.fresh("v")
            if sp:
                self.emit(f"{vt} {tmp};")
                self.open(f"if ({sp})")
                self.emit(f"{tmp} = tilehal::load_vec<{t}, {v}>({sref});")
                self.close()
                self.open("else")
                self.emit("#pragma unroll")
                self.emit(f"for (int _k = 0; _k < {v}; ++_k) {tmp}[_k] = tilehal::from_float<{t}>(0.0f);"
                          if t in ("__half", "__nv_bfloat16", "__nv_fp8_e4m3", "__nv_fp8_e5m2") else
                          f"for (int _k = 0; _k < {v}; ++_k) {tmp}[_k] = 0;")
                self.close()
            else:
                self.emit(f"{vt} {tmp} = tilehal::load_vec<{t}, {v}>({sref});")
            st = f"tilehal::store_vec<{t}, {v}>({dref}, {tmp});"
            self.emit(f"if ({dp}) {st}" if dp else st)

        self.flat_loop(ext_v, names, body)

    def copy_elementwise(self, s: Copy, uniform: bool = False) -> None:
        src, dst = s.src, s.dst
        ext = [str(x) for x in (src.squeezed() or [1])]
        names = self._tile_names(src)

        def body():
            si = self.region_idx(src, names if src.squeezed() else [])
            di = self.region_idx(dst, names if dst.squeezed() else [])
            sp, dp = self.in_bounds(src, si), self.in_bounds(dst, di)
            val = self.mem_ref(src.buffer, si)
            if sp:
                zero = self.conv("0", "int32", src.buffer.dtype) if src.buffer.dtype in _LOW else "0"
                val = f"(({sp}) ? {val} : {zero})"
            line = f"{self.mem_ref(dst.buffer, di)} = {self.conv(val, src.buffer.dtype, dst.buffer.dtype)};"
            self.emit(f"if ({dp}) {line}" if dp else line)

        if uniform:
            self.open("")
            for n, e in zip(names, ext):
                self.open(f"for (int {n} = 0; {n} < {e}; ++{n})")
            body()
            for _ in names:
                self.close()
            self.close()
        else:
            self.flat_loop(ext, names, body)

    def _frag_vector(self, f: Fragment, fr: Region, other: Region) -> tuple[int, Axis] | None:
        """The fragment's innermost register axis, when its elements are contiguous in `other` and every
        vector is aligned (16, 8 or 4 bytes): a copy then moves them with one vector access."""
        if not f.reg_order or other.buffer.scope not in ("global", "shared"):
            return None
        d, a = f.reg_order[-1]
        nd = len(f.shape)
        if d != nd - 1 or a.coeff != 1 or a.extent < 2 or f.shape[-1] % a.extent:
            return None
        v = a.extent
        es = esize(other.buffer.dtype)
        if v * es not in (4, 8, 16):
            return None
        rd, cd = other.matrix_dims()
        size = other.buffer.shape[-1]
        if cd != other.buffer.ndim - 1 or not isinstance(size, Const) or int(size.value) % v or \
                not _divisible(other.starts[-1], v) or f.shape[-1] != other.extents[-1]:
            return None
        return (d, a)

    def copy_fragment(self, s: Copy) -> None:
        """Each thread moves the fragment elements it holds (masked at the edges of global tensors)."""
        src, dst = s.src, s.dst
        fr, other = (src, dst) if src.buffer.scope == "fragment" else (dst, src)
        f = self.inf.layouts[fr.buffer]
        if not self._full(fr):
            raise CompileError(f"T.copy of part of fragment {fr.buffer.name} is not supported on cuda; copy the whole "
                               f"fragment", s.loc)
        names = [self.fresh("i") for _ in f.shape]
        nonunit = [nm for nm, n in zip(names, f.shape) if n != 1]
        lead = self.lead_cond(f) if fr is src and other.buffer.scope in ("global", "shared") else None
        vec = self._frag_vector(f, fr, other)

        def body(regvars):
            reg = self._reg_by_axes(f, f, regvars)
            oi = self.region_idx(other, nonunit if other.squeezed() else [])
            pred = self.in_bounds(other, oi)
            oref = self.mem_ref(other.buffer, oi)
            fref = f"{fr.buffer.name}[{reg}]"
            if vec is not None:
                v = vec[1].extent
                t = cuda_type(other.buffer.dtype)
                vt = f"tilehal::Vec<{t}, {v}>"
                tmp = self.fresh("v")
                fd, od = fr.buffer.dtype, other.buffer.dtype
                if fr is src and v == 2 and fd == "float32" and od in ("float16", "bfloat16"):
                    # two fp32 registers -> one packed cvt and one 32-bit store (through tilehal::Vec the
                    # pair became two conversions and a 16-bit pair store, and ptxas serialized every
                    # wgmma of a kernel whose accumulators were staged that way through shared memory)
                    conds = [c for c in (pred, lead) if c]
                    line = (f"*reinterpret_cast<unsigned*>(&{oref}) = tilehal::from_float2<{t}>({fref}, "
                            f"{fr.buffer.name}[{reg} + 1]);")
                    self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
                    return
                if fr is src:
                    self.emit(f"{vt} {tmp};")
                    self.emit("#pragma unroll")
                    self.emit(f"for (int _u = 0; _u < {v}; ++_u) {tmp}[_u] = "
                              f"{self.conv(f'{fr.buffer.name}[{reg} + _u]', fd, od)};")
                    conds = [c for c in (pred, lead) if c]
                    line = f"tilehal::store_vec<{t}, {v}>(&{oref}, {tmp});"
                    self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
                else:
                    self.emit(f"{vt} {tmp};")
                    load = f"{tmp} = tilehal::load_vec<{t}, {v}>(&{oref});"
                    if pred:
                        self.emit(f"if ({pred}) {load} else for (int _u = 0; _u < {v}; ++_u) {tmp}[_u] = "
                                  f"{self.zero(od)};")
                    else:
                        self.emit(load)
                    self.emit("#pragma unroll")
                    self.emit(f"for (int _u = 0; _u < {v}; ++_u) {fr.buffer.name}[{reg} + _u] = "
                              f"{self.conv(f'{tmp}[_u]', od, fd)};")
                return
            if fr is src:
                conds = [c for c in (pred, lead) if c]
                line = f"{oref} = {self.conv(fref, fr.buffer.dtype, other.buffer.dtype)};"
                self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
            else:
                val = self.conv(oref, other.buffer.dtype, fr.buffer.dtype)
                if pred:
                    zero = self.conv("0", "int32", fr.buffer.dtype) if fr.buffer.dtype in _LOW else "0"
                    val = f"(({pred}) ? {val} : {zero})"
                self.emit(f"{fref} = {val};")

        self.layout_loop(f, names, body, vec=vec)

    def copy_via_scratch(self, s: Copy) -> None:
        a, b = s.src.buffer, s.dst.buffer
        if not (self._full(s.src) and self._full(s.dst)):
            raise CompileError("T.copy between parts of fragments with different layouts is not supported", s.loc)
        n = int(np.prod(a.static_shape()))
        base = self.scratch(n * 8)
        self.emit("__syncthreads();")
        self.stage_fragment(a, True, base)
        self.emit("__syncthreads();")
        self.stage_fragment(b, False, base)
        self.emit("__syncthreads();")
