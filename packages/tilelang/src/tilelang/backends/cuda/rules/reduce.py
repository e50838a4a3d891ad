"""CUDA lowering of T.reduce_*: registers, then warp shuffles, then shared memory across warps (thread-level
nodes: lower_thread.py)."""

from __future__ import annotations

import math

import numpy as np

from ....errors import CompileError
from ....ir import dtypes as dt
from ....ir.nodes import REDUCE_OPS, Buffer, Const, Expr, For, Reduce
from ....ir.thread import Barrier, RegBuffer, Scope, Shuffle
from ..common import _LOW, float_literal
from ..emit import Abs, CastC, Comment, Conv, IntLit, MinMax, Ref, ToFloat, TStore
from ..lower_thread import TX, B, C, P, total


class ReduceRules:
    def reduce(self, s: Reduce) -> None:
        src, dst = s.src, s.dst
        if src.scope != "fragment" or dst.scope not in ("fragment",):
            raise CompileError(f"T.reduce_{s.kind} on cuda reduces a fragment into a fragment, got {src.name} "
                               f"({src.scope}) -> {dst.name} ({dst.scope})", s.loc)
        fs, fd = self.inf.layouts[src], self.inf.layouts[dst]
        acc_t = dt.compute_type(dst.dtype)
        op, init = REDUCE_OPS[s.kind]
        if dt.is_int(acc_t) and math.isinf(init):
            info = np.iinfo(np.dtype(acc_t))
            init_c = str(int(info.max if init > 0 else info.min))
        elif dt.is_int(acc_t):
            init_c = "0"
        else:
            init_c = float_literal(init, acc_t)

        init_x = IntLit(int(init_c), acc_t) if dt.is_int(acc_t) else Const(init, acc_t)

        def comb(a: Expr, b: Expr) -> Expr:
            return P(B(a, "+", b, acc_t)) if op == "+" else MinMax(op, a, b, acc_t)

        red_axes = list(fs.dims[s.dim])
        kept = [d for d in range(src.ndim) if d != s.dim]
        dst_dim = {d: (i if dst.ndim != src.ndim else d) for i, d in enumerate(kept)}
        warp_ax, cross_ax = [], []
        for a in red_axes:
            if a.kind != "t":
                continue
            if a.tstride * a.extent <= 32:
                warp_ax.append((a.tstride, a.extent))
            elif a.tstride >= 32:
                cross_ax.append((a.tstride, a.extent))
            else:
                inner = 32 // a.tstride
                warp_ax.append((a.tstride, inner))
                cross_ax.append((32, a.extent // inner))
        nd = fd.nregs
        unroll = {"c_extent_bound": True}
        one_line = {"c_extent_bound": True, "c_one_line": True}
        self.add(Comment(f"T.reduce_{s.kind}({src.name} -> {dst.name}, dim={s.dim})", loc=s.loc))
        self.begin()  # the scope
        accs = Buffer(self.fresh("acc"), (C(nd),), acc_t, "local")
        self.add(RegBuffer(accs))
        # registers of the kept dims (outer loops), then the reduced registers (inner loops)
        kept_regs = [(d, a) for d, a in fs.reg_order if d != s.dim]
        red_regs = [(d, a) for d, a in fs.reg_order if d == s.dim]
        names = {}
        for d, a in kept_regs:
            names[(d, a)] = self.fresh("r")
            self.begin()
        dreg = total([B(self.v(names[(d, a)]), "*", C(fd.reg_stride(dst_dim[d], a))) for d, a in kept_regs]) or C(0)
        # pass_configs cuda_tree_reduce: the thread's registers go into `parts` independent partials (register j
        # into partial j % parts), combined pairwise after the loop, so the chain of dependent combines is
        # n / parts + log2(parts) long instead of n (flash attention's row max / sum: 32 -> 10). Max and min give
        # the same result in any order; a sum is rounded in another order (as numpy's pairwise sum is).
        n_red = int(np.prod([a.extent for _d, a in red_regs])) if red_regs else 1
        parts = 1
        if "tree_reduce" in self.math:
            parts = next((p for p in (4, 2) if n_red % p == 0 and n_red >= 2 * p), 1)
        acc_b = Buffer(self.fresh("a"), (C(parts),), acc_t, "local")
        acc = Ref(acc_b, [C(0)], parts == 1)
        self.add(RegBuffer(acc_b, None, init_x, scalar=parts == 1))
        for d, a in red_regs:
            names[(d, a)] = self.fresh("r")
            self.begin()
        part = acc
        if parts > 1:
            flat, stride = [], 1
            for d, a in reversed(red_regs):
                flat.append(B(self.v(names[(d, a)]), "*", C(stride)))
                stride *= a.extent
            part = Ref(acc_b, [B(P(total(flat)), "%", C(parts))])
        sreg = total([B(self.v(names[(d, a)]), "*", C(fs.reg_stride(d, a))) for d, a in fs.reg_order]) or C(0)
        val: Expr = self.reg_ref(src, sreg)
        val = ToFloat(val) if src.dtype in _LOW else CastC(acc_t, val)
        if s.kind in ("abssum", "absmax"):
            val = Abs(val)
        # padding of the reduced dim holds no data
        cond = None
        if fs.covered(s.dim) > fs.shape[s.dim]:
            terms = []
            for a in red_axes:
                v = self.thread_val_x(a) if a.kind == "t" else self.v(names[(s.dim, a)])
                terms.append(B(v, "*", C(a.coeff)))
            cond = B(P(total(terms)), "<", C(fs.shape[s.dim]), "bool")
        self.add(TStore(part, comb(part, val), cond))
        for d, a in reversed(red_regs):
            self.add(For(self.v(names[(d, a)]), C(0), C(a.extent), "unroll", self.end(), annotations=unroll))
        step = parts // 2
        while step:
            for j in range(step):
                self.add(TStore(Ref(acc_b, [C(j)]), comb(Ref(acc_b, [C(j)]), Ref(acc_b, [C(j + step)]))))
            step //= 2
        for ts, e in warp_ax:
            off = ts
            while off < ts * e:
                self.add(TStore(acc, comb(acc, Shuffle("xor", acc, C(off)))))
                off *= 2
        self.add(TStore(self.reg_ref_b(accs, dreg), acc))
        for d, a in reversed(kept_regs):
            self.add(For(self.v(names[(d, a)]), C(0), C(a.extent), "unroll", self.end(), annotations=unroll))
        i = self.v("_i")
        if cross_ax:
            sb = self.scratch_buf(acc_t, self.scratch(nd * self.threads * 8))
            self.add(Barrier())
            self.add(For(i, C(0), C(nd), "serial", TStore(Ref(sb, [B(B(i, "*", C(self.threads)), "+", TX)]),
                                                          Ref(accs, [i])), annotations=one_line))
            self.add(Barrier())
            self.begin()
            a_b = Buffer("_a", (C(1),), acc_t, "local")
            a_ref = Ref(a_b, [C(0)], True)
            self.add(RegBuffer(a_b, None, init_x, scalar=True))
            base_t: Expr = TX
            for ts, e in cross_ax:
                base_t = P(B(base_t, "-", B(P(B(P(B(TX, "/", C(ts))), "%", C(e))), "*", C(ts))))
            ws = [self.v(f"_w{k}") for k in range(len(cross_ax))]
            for _ in cross_ax:
                self.begin()
            lanes = None
            for w, (ts, _e) in zip(ws, cross_ax):
                t = B(w, "*", C(ts))
                lanes = t if lanes is None else B(lanes, "+", t, tight=True)
            self.add(TStore(a_ref, comb(a_ref, Ref(sb, [B(B(B(i, "*", C(self.threads)), "+", base_t), "+", lanes)]))))
            for w, (_ts, e) in reversed(list(zip(ws, cross_ax))):
                self.add(For(w, C(0), C(e), "serial", self.end(), annotations={"c_extent_bound": True}))
            self.add(TStore(Ref(accs, [i]), a_ref))
            self.add(For(i, C(0), C(nd), "serial", self.end(), annotations={"c_extent_bound": True}))
            self.add(Barrier())
        if s.clear:
            value: Expr = Conv(acc_t, dst.dtype, Ref(accs, [i]))
        else:
            old: Expr = self.reg_ref(dst, i)
            old = ToFloat(old) if dst.dtype in _LOW else old
            value = Conv(acc_t, dst.dtype, comb(old, Ref(accs, [i])))
        self.add(For(i, C(0), C(nd), "unroll", TStore(self.reg_ref(dst, i), value), annotations=one_line))
        self.add(Scope(self.end()))
