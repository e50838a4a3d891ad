"""CUDA lowering of T.fill / T.clear."""

from __future__ import annotations

from ....ir.nodes import Fill


class FillRules:
    def fill(self, s: Fill) -> None:
        r = s.dst
        b = r.buffer
        if b.scope == "fragment" and self._full(r):
            n = self.inf.layouts[b].nregs
            self.emit("#pragma unroll")
            self.emit(f"for (int _i = 0; _i < {n}; ++_i) {b.name}[_i] = {self.store_value(b, s.value)};")
            return
        if b.scope == "fragment":
            f = self.inf.layouts[b]
            names = [self.fresh("i") for _ in f.shape]

            def body(regvars):
                reg = self._reg_by_axes(f, f, regvars)
                conds = []
                for d, nm in enumerate(names):
                    st = self.expr(r.starts[d])
                    conds.append(f"{nm} >= {st} && {nm} < {st} + {r.extents[d]}")
                self.emit(f"if ({' && '.join(conds)}) {b.name}[{reg}] = {self.store_value(b, s.value)};")

            return self.layout_loop(f, names, body)
        ext = [str(x) for x in (r.squeezed() or [1])]
        names = self._tile_names(r)

        def body2():
            idx = self.region_idx(r, names if r.squeezed() else [])
            pred = self.in_bounds(r, idx)
            line = f"{self.mem_ref(b, idx)} = {self.store_value(b, s.value)};"
            self.emit(f"if ({pred}) {line}" if pred else line)

        if b.scope in ("local", "var"):
            self.open("")
            for n, e in zip(names, ext):
                self.open(f"for (int {n} = 0; {n} < {e}; ++{n})")
            body2()
            for _ in names:
                self.close()
            self.close()
        else:
            self.flat_loop(ext, names, body2)
