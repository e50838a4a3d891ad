"""CUDA lowering of T.atomic_add (one replica adds). A fragment added into a global tile uses vector
atomics where the fragment's innermost register pairs / quads are contiguous and aligned in the
destination: float2 / float4 (sm_90) for float32, __half2 / __nv_bfloat162 for 16-bit floats."""

from __future__ import annotations

from ....ir.nodes import AtomicAdd, Region
from ..common import log

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
            idx = [self.expr(x) for x in dst.starts]
            pred = self.in_bounds(Region(dst.buffer, dst.starts, [1] * dst.buffer.ndim), idx)
            val = self.store_value(dst.buffer, s.src)
            conds = [c for c in (pred, "_tx == 0" if uniform else (self.par.lead if self.par else None)) if c]
            line = f"atomicAdd(&{self.mem_ref(dst.buffer, idx)}, {val});"
            self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
            return
        src = s.src
        if src.buffer.scope == "fragment":
            f = self.inf.layouts[src.buffer]
            names = [self.fresh("i") for _ in f.shape]
            nonunit = [nm for nm, n in zip(names, f.shape) if n != 1]
            lead = self.lead_cond(f)
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
                reg = self._reg_by_axes(f, f, regvars)
                di = self.region_idx(dst, nonunit if dst.squeezed() else [])
                pred = self.in_bounds(dst, di)
                conds = [c for c in (pred, lead) if c]
                if vec is not None and width:
                    ref = f"&{self.mem_ref(dst.buffer, di)}"
                    for c in range(vec[1].extent // width):
                        vals = ", ".join(f"(float)({self.conv(f'{src.buffer.name}[{reg} + {c * width + u}]', src.buffer.dtype, 'float32')})"
                                         for u in range(width))
                        line = f"atomicAdd(reinterpret_cast<{vt}*>({ref}) + {c}, {make}({vals}));"
                        self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)
                    return
                val = self.conv(f"{src.buffer.name}[{reg}]", src.buffer.dtype, dst.buffer.dtype)
                line = f"atomicAdd(&{self.mem_ref(dst.buffer, di)}, {val});"
                self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)

            return self.layout_loop(f, names, body, vec=vec if width else None)
        ext = [str(x) for x in (src.squeezed() or [1])]
        names = self._tile_names(src)

        def body2():
            si = self.region_idx(src, names if src.squeezed() else [])
            di = self.region_idx(dst, names if dst.squeezed() else [])
            sp, dp = self.in_bounds(src, si), self.in_bounds(dst, di)
            conds = [c for c in (sp, dp) if c]
            val = self.conv(self.mem_ref(src.buffer, si), src.buffer.dtype, dst.buffer.dtype)
            line = f"atomicAdd(&{self.mem_ref(dst.buffer, di)}, {val});"
            self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)

        self.flat_loop(ext, names, body2)
