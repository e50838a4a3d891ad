"""CUDA lowering of T.fill / T.clear (thread-level nodes: lower_thread.py)."""

from __future__ import annotations

from ....ir.nodes import Fill, For
from ..emit import TStore
from ..lower_thread import B, C, conj


class FillRules:
    def fill(self, s: Fill) -> None:
        r = s.dst
        b = r.buffer
        value = self.store_value_x(b, s.value)
        if b.scope == "fragment" and self._full(r):
            i = self.v("_i")
            self.add(For(i, C(0), C(self.inf.layouts[b].nregs), "unroll", TStore(self.reg_ref(b, i), value),
                         annotations={"c_extent_bound": True, "c_one_line": True}, loc=s.loc))
            return
        if b.scope == "fragment":
            f = self.inf.layouts[b]
            names = [self.fresh("i") for _ in f.shape]

            def body(regvars):
                reg = self._reg_by_axes_x(f, f, regvars)
                conds = []
                for d, nm in enumerate(names):
                    st = self.lower_expr(r.starts[d])
                    conds.append(B(B(self.v(nm), ">=", st, "bool"), "&&",
                                   B(self.v(nm), "<", B(st, "+", C(r.extents[d])), "bool"), "bool"))
                self.add(TStore(self.reg_ref(b, reg), value, conj(conds)))

            return self.layout_loop(f, names, body)
        ext = [str(x) for x in (r.squeezed() or [1])]
        names = self._tile_names(r)

        def body2():
            idx = self.region_idx_x(r, [self.v(n) for n in names] if r.squeezed() else [])
            self.add(TStore(self.mem_ref_x(b, idx), value, self.in_bounds_x(r, idx)))

        if b.scope in ("local", "var"):
            self.loop_nest(names, ext, body2)
        else:
            self.flat_loop(ext, names, body2)
