"""CUDA lowering of T.atomic_add (one replica adds)."""

from __future__ import annotations

from ....ir.nodes import AtomicAdd, Region


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

            def body(regvars):
                reg = self._reg_by_axes(f, f, regvars)
                di = self.region_idx(dst, nonunit if dst.squeezed() else [])
                pred = self.in_bounds(dst, di)
                conds = [c for c in (pred, lead) if c]
                val = self.conv(f"{src.buffer.name}[{reg}]", src.buffer.dtype, dst.buffer.dtype)
                line = f"atomicAdd(&{self.mem_ref(dst.buffer, di)}, {val});"
                self.emit(f"if ({' && '.join(conds)}) {line}" if conds else line)

            return self.layout_loop(f, names, body)
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
