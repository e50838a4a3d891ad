"""CUDA lowering of T.cumsum through shared memory (thread-level nodes: lower_thread.py)."""

from __future__ import annotations

import numpy as np

from ....errors import CompileError
from ....ir import dtypes as dt
from ....ir.nodes import Buffer, Const, CumSum, Expr, For, Let, Seq
from ....ir.thread import Barrier, RegBuffer, StridedFor
from ..common import _LOW
from ..emit import Comment, Conv, Ref, ToFloat, TStore
from ..lower_thread import TX, B, C, P


class CumSumRules:
    def cumsum(self, s: CumSum) -> None:
        src, dst = s.src, s.dst
        shape = src.static_shape()
        n = int(np.prod(shape))
        acc_t = dt.compute_type(dst.dtype)
        sb = self.scratch_buf(acc_t, self.scratch(n * 8))
        self.add(Comment(f"T.cumsum({src.name} -> {dst.name}, dim={s.dim}, reverse={s.reverse})", loc=s.loc))
        self.add(Barrier())
        self._to_from_scratch(src, sb, True)
        self.add(Barrier())
        rows = n // shape[s.dim]
        inner = int(np.prod(shape[s.dim + 1:]))
        L = shape[s.dim]
        row, base, k, o = self.v("_row"), self.v("_base"), self.v("_k"), self.v("_o")
        acc_b = Buffer("_acc", (C(1),), acc_t, "local")
        acc = Ref(acc_b, [C(0)], True)
        self.begin()
        self.add(Let(base, B(B(P(B(row, "/", C(inner))), "*", C(L * inner)), "+", P(B(row, "%", C(inner))))))
        self.add(RegBuffer(acc_b, None, Const(0, dt.INDEX), scalar=True))
        kk: Expr = P(B(C(L - 1), "-", k)) if s.reverse else k
        step = [Let(o, B(base, "+", B(kk, "*", C(inner)))), TStore(acc, Ref(sb, [o]), op="+"),
                TStore(Ref(sb, [o]), acc)]
        self.add(For(k, C(0), C(L), "serial", Seq(step), annotations={"c_extent_bound": True}))
        self.add(StridedFor(row, TX, C(rows), self.threads, self.end()))
        self.add(Barrier())
        self._to_from_scratch(dst, sb, False)
        self.add(Barrier())

    def _to_from_scratch(self, buf: Buffer, sb: Buffer, to: bool) -> None:
        ct = dt.compute_type(sb.dtype)

        def flat_of(names: list[str], shape: list[int]) -> Expr:
            flat: Expr = self.v(names[0])
            for d in range(1, len(names)):
                flat = B(B(P(flat), "*", C(shape[d])), "+", self.v(names[d]))
            return flat

        def move(ref: Ref, flat: Expr) -> None:
            if to:
                self.add(TStore(Ref(sb, [flat]), ToFloat(ref) if buf.dtype in _LOW else ref))
            else:
                self.add(TStore(ref, Conv(ct, buf.dtype, Ref(sb, [flat]))))

        if buf.scope == "fragment":
            f = self.inf.layouts[buf]
            names = [self.fresh("i") for _ in f.shape]
            shape = list(f.shape)

            def body(regvars):
                move(self.reg_ref(buf, self._reg_by_axes_x(f, f, regvars)), flat_of(names, shape))

            self.layout_loop(f, names, body)
            return
        shape = buf.static_shape()
        names = [self.fresh("c") for _ in shape]

        def body2():
            move(self.mem_ref_x(buf, [self.v(n) for n in names]), flat_of(names, list(shape)))

        if buf.scope in ("local", "var"):
            raise CompileError(f"T.cumsum on a {buf.scope} buffer is not supported on cuda")
        self.flat_loop([str(x) for x in shape], names, body2)
