"""CUDA lowering of T.atomic_add (one replica adds). A fragment added into a global tile uses vector
atomics where the fragment's innermost register pairs / quads are contiguous and aligned in the
destination: float2 / float4 (sm_90) for float32, __half2 / __nv_bfloat162 for 16-bit floats (thread-level
nodes: lower_thread.py)."""

from __future__ import annotations

from ....ir.nodes import AtomicAdd, Region
from ..common import log
from ..emit import AtomicAdd as AtomicAddT
from ..emit import Conv, VecAtomicAdd
from ..lower_thread import TX, B, C, conj

# destination dtype -> (elements per vector atomic, C vector type, constructor from floats)
_VEC_ATOMIC = {
    "float32": {4: ("float4", "make_float4"), 2: ("float2", "make_float2")},
    "float16": {2: ("__half2", "__floats2half2_rn")},
    "bfloat16": {2: ("__nv_bfloat162", "__floats2bfloat162_rn")},
}


class AtomicRules:
    def atomic(self, s: AtomicAdd, uniform: bool) -> None:
        dst = s.dst
        if not isinstance(s.src, Region):
            idx = [self.lower_expr(x) for x in dst.starts]
            pred = self.in_bounds_x(Region(dst.buffer, dst.starts, [1] * dst.buffer.ndim), idx)
            val = self.store_value_x(dst.buffer, s.src)
            one = B(TX, "==", C(0), "bool") if uniform else (self.v(self.par.lead, "bool") if self.par and self.par.lead
                                                            else None)
            conds = conj([c for c in (pred, one) if c is not None])
            self.add(AtomicAddT(self.mem_ref_x(dst.buffer, idx), val, conds, loc=s.loc))
            return
        src = s.src
        if src.buffer.scope == "fragment":
            f = self.inf.layouts[src.buffer]
            names = [self.fresh("i") for _ in f.shape]
            nonunit = [nm for nm, n in zip(names, f.shape) if n != 1]
            lead = self.lead_cond_x(f)
            vec = self._frag_vector(f, src, dst) if dst.buffer.scope == "global" else None
            table = _VEC_ATOMIC.get(dst.buffer.dtype, {})
            width = next((w for w in sorted(table, reverse=True) if vec and vec[1].extent % w == 0), 0)
            if vec is not None and width:
                vt, make = table[width]
                log.debug("%s: T.atomic_add %s -> %s: %d-wide vector atomics (%s)", s.loc, src.buffer.name,
                          dst.buffer.name, width, vt)
            elif src.buffer.dtype != dst.buffer.dtype or dst.buffer.dtype in _VEC_ATOMIC:
                log.debug("%s: T.atomic_add %s -> %s element by element (no contiguous aligned register run)",
                          s.loc, src.buffer.name, dst.buffer.name)

            def body(regvars):
                reg = self._reg_by_axes_x(f, f, regvars)
                di = self.region_idx_x(dst, [self.v(n) for n in nonunit] if dst.squeezed() else [])
                pred = self.in_bounds_x(dst, di)
                conds = conj([c for c in (pred, lead) if c is not None])
                ref = self.mem_ref_x(dst.buffer, di)
                if vec is not None and width:
                    for c in range(vec[1].extent // width):
                        vals = [Conv(src.buffer.dtype, "float32", self.reg_ref(src.buffer, B(reg, "+", C(c * width + u))))
                                for u in range(width)]
                        self.add(VecAtomicAdd(ref, c, vals, vt, make, conds, loc=s.loc))
                    return
                val = Conv(src.buffer.dtype, dst.buffer.dtype, self.reg_ref(src.buffer, reg))
                self.add(AtomicAddT(ref, val, conds, loc=s.loc))

            return self.layout_loop(f, names, body, vec=vec if width else None)
        ext = [str(x) for x in (src.squeezed() or [1])]
        names = self._tile_names(src)

        def body2():
            coords = [self.v(n) for n in names]
            si = self.region_idx_x(src, coords if src.squeezed() else [])
            di = self.region_idx_x(dst, coords if dst.squeezed() else [])
            sp, dp = self.in_bounds_x(src, si), self.in_bounds_x(dst, di)
            conds = conj([c for c in (sp, dp) if c is not None])
            val = Conv(src.buffer.dtype, dst.buffer.dtype, self.mem_ref_x(src.buffer, si))
            self.add(AtomicAddT(self.mem_ref_x(dst.buffer, di), val, conds, loc=s.loc))

        self.flat_loop(ext, names, body2)
