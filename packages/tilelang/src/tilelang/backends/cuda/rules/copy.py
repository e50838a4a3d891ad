"""CUDA lowering of T.copy: cp.async, 16-byte vectors, element-wise with masks, fragment <-> memory
(thread-level nodes: lower_thread.py)."""

from __future__ import annotations

import numpy as np

from ....errors import CompileError
from ....ir.layout import Axis, Fragment
from ....ir.nodes import Const, Copy, Expr, For, If, Let, Load, Region, Var
from ....ir.thread import AsyncCommit, AsyncCopy, AsyncWait, Barrier, RegBuffer
from ....ir.visit import walk_expr
from ..common import _LOW, _divisible, esize
from ..emit import Conv, CSelect, PackedStore2, Ref, TStore, VecLoad, VecStore, Zero
from ..lower_thread import B, C, conj


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
                    ra = self._reg_by_axes_x(fa, f, regvars)
                    rb = self._reg_by_axes_x(fb, f, regvars)
                    self.add(TStore(self.reg_ref(dst.buffer, rb),
                                    Conv(src.buffer.dtype, dst.buffer.dtype, self.reg_ref(src.buffer, ra))))

                self.layout_loop(f, names, body)
                return
            return self.copy_via_scratch(s)
        if ss == "fragment" or ds == "fragment":
            return self.copy_fragment(s)
        if ss == "local" or ds == "local" or ss == "var" or ds == "var":
            return self.copy_elementwise(s, uniform=True)
        if ss == "global" and ds == "shared" and self._async_copy_ok(s):
            self.copy_async(s)
            self.add(AsyncCommit())
            self.add(AsyncWait(0))
            return
        v = self._vector_width(src, dst)
        if v > 1:
            return self.copy_vector(s, v)
        self.copy_elementwise(s)

    def _vec_coords(self, names: list[str], v: int) -> list[Expr]:
        """Tile coordinates of a vector's first element: the last one steps by `v`."""
        return [self.v(n) for n in names[:-1]] + [B(self.v(names[-1]), "*", C(v))]

    def copy_async(self, s: Copy) -> None:
        src, dst = s.src, s.dst
        v = self._vector_width(src, dst)
        # a start index that loads (a page id from a block table) is read once per copy, not once per chunk:
        # every cp.async is asm volatile, so the compiler could not reuse the loaded value between them
        starts = []
        for e in src.starts:
            if any(isinstance(x, Load) for x in walk_expr(e)):
                var = Var(self.fresh("src"), e.dtype if e.dtype.startswith("int") else "int32")
                self.add(Let(var, self.lower_expr(e), loc=s.loc))
                e = var
            starts.append(e)
        src = Region(src.buffer, starts, src.extents, src.loc)
        ext = [str(x) for x in (src.squeezed() or [1])]
        ext_v = ext[:-1] + [str(int(ext[-1]) // v)]
        names = self._tile_names(src)

        def body():
            coords = self._vec_coords(names, v)
            si = self.region_idx_x(src, coords if src.squeezed() else [])
            di = self.region_idx_x(dst, coords if dst.squeezed() else [])
            pred = self.in_bounds_x(src, si)
            self.add(AsyncCopy(self.tbuf(dst.buffer), [self.smem_offset_x(dst.buffer, di)], self.tbuf(src.buffer),
                               [self.flat_index_x(src.buffer, si)], v, pred, loc=s.loc))

        self.flat_loop(ext_v, names, body)

    def copy_vector(self, s: Copy, v: int) -> None:
        src, dst = s.src, s.dst
        ext = [str(x) for x in (src.squeezed() or [1])]
        ext_v = ext[:-1] + [str(int(ext[-1]) // v)]
        names = self._tile_names(src)

        def body():
            coords = self._vec_coords(names, v)
            si = self.region_idx_x(src, coords)
            di = self.region_idx_x(dst, coords)
            sp, dp = self.in_bounds_x(src, si), self.in_bounds_x(dst, di)
            sref, dref = self.mem_ref_x(src.buffer, si), self.mem_ref_x(dst.buffer, di)
            tmp = self.vec_temp(src.buffer.dtype, v)
            if sp is not None:
                self.add(RegBuffer(tmp, vec=True))
                self.begin()
                self.add(VecLoad(tmp, sref))
                then = self.end()
                k = self.v("_k")
                self.begin()
                self.add(For(k, C(0), C(v), "unroll", TStore(Ref(tmp, [k]), Zero(src.buffer.dtype)),
                             annotations={"c_extent_bound": True, "c_one_line": True}))
                self.add(If(sp, then, self.end()))
            else:
                self.add(VecLoad(tmp, sref, decl=True))
            self.add(VecStore(dref, tmp, dp))

        self.flat_loop(ext_v, names, body)

    def copy_elementwise(self, s: Copy, uniform: bool = False) -> None:
        src, dst = s.src, s.dst
        ext = [str(x) for x in (src.squeezed() or [1])]
        names = self._tile_names(src)

        def body():
            coords = [self.v(n) for n in names]
            si = self.region_idx_x(src, coords if src.squeezed() else [])
            di = self.region_idx_x(dst, coords if dst.squeezed() else [])
            sp, dp = self.in_bounds_x(src, si), self.in_bounds_x(dst, di)
            val: Expr = self.mem_ref_x(src.buffer, si)
            if sp is not None:
                val = CSelect(sp, val, self._zero_of(src.buffer.dtype))
            self.add(TStore(self.mem_ref_x(dst.buffer, di), Conv(src.buffer.dtype, dst.buffer.dtype, val), dp))

        if uniform:
            self.loop_nest(names, ext, body)
        else:
            self.flat_loop(ext, names, body)

    def _zero_of(self, dtype: str) -> Expr:
        """The `0` a masked element read gives (spelled as a conversion for 16/8-bit floats)."""
        return Conv("int32", dtype, C(0)) if dtype in _LOW else C(0)

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
        lead = self.lead_cond_x(f) if fr is src and other.buffer.scope in ("global", "shared") else None
        vec = self._frag_vector(f, fr, other)

        def body(regvars):
            reg = self._reg_by_axes_x(f, f, regvars)
            oi = self.region_idx_x(other, [self.v(n) for n in nonunit] if other.squeezed() else [])
            pred = self.in_bounds_x(other, oi)
            oref = self.mem_ref_x(other.buffer, oi)
            fref = self.reg_ref(fr.buffer, reg)
            fd, od = fr.buffer.dtype, other.buffer.dtype
            conds = conj([c for c in (pred, lead) if c is not None])
            if vec is not None:
                v = vec[1].extent
                tmp = self.vec_temp(od, v)  # named before the packed form too (names stay as they were)
                if fr is src and v == 2 and fd == "float32" and od in ("float16", "bfloat16"):
                    # two fp32 registers -> one packed cvt and one 32-bit store (through tilehal::Vec the
                    # pair became two conversions and a 16-bit pair store, and ptxas serialized every
                    # wgmma of a kernel whose accumulators were staged that way through shared memory)
                    self.add(PackedStore2(oref, fref, self.reg_ref(fr.buffer, B(reg, "+", C(1))), conds))
                    return
                u = self.v("_u")
                self.add(RegBuffer(tmp, vec=True))
                if fr is src:
                    self.add(For(u, C(0), C(v), "unroll",
                                 TStore(Ref(tmp, [u]), Conv(fd, od, self.reg_ref(fr.buffer, B(reg, "+", u)))),
                                 annotations={"c_extent_bound": True, "c_one_line": True}))
                    self.add(VecStore(oref, tmp, conds))
                else:
                    self.add(VecLoad(tmp, oref, pred))
                    self.add(For(u, C(0), C(v), "unroll",
                                 TStore(self.reg_ref(fr.buffer, B(reg, "+", u)), Conv(od, fd, Ref(tmp, [u]))),
                                 annotations={"c_extent_bound": True, "c_one_line": True}))
                return
            if fr is src:
                self.add(TStore(oref, Conv(fd, od, fref), conds))
            else:
                val: Expr = Conv(od, fd, oref)
                if pred is not None:
                    val = CSelect(pred, val, self._zero_of(fd))
                self.add(TStore(fref, val))

        self.layout_loop(f, names, body, vec=vec)

    def copy_via_scratch(self, s: Copy) -> None:
        a, b = s.src.buffer, s.dst.buffer
        if not (self._full(s.src) and self._full(s.dst)):
            raise CompileError("T.copy between parts of fragments with different layouts is not supported", s.loc)
        n = int(np.prod(a.static_shape()))
        base = self.scratch(n * 8)
        self.add(Barrier())
        self.stage_fragment(a, True, base)
        self.add(Barrier())
        self.stage_fragment(b, False, base)
        self.add(Barrier())
