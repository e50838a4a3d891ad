"""CUDA lowering of T.reduce_*: registers, then warp shuffles, then shared memory across warps."""

from __future__ import annotations

import math

import numpy as np

from ....errors import CompileError
from ....ir import dtypes as dt
from ....ir.nodes import REDUCE_OPS, Reduce
from ..common import _LOW, float_literal, value_type


class ReduceRules:
    def reduce(self, s: Reduce) -> None:
        src, dst = s.src, s.dst
        if src.scope != "fragment" or dst.scope not in ("fragment",):
            raise CompileError(f"T.reduce_{s.kind} on cuda reduces a fragment into a fragment, got {src.name} "
                               f"({src.scope}) -> {dst.name} ({dst.scope})", s.loc)
        fs, fd = self.inf.layouts[src], self.inf.layouts[dst]
        acc_t = dt.compute_type(dst.dtype)
        ct = value_type(dst.dtype)
        op, init = REDUCE_OPS[s.kind]
        if dt.is_int(acc_t) and math.isinf(init):
            info = np.iinfo(np.dtype(acc_t))
            init_c = str(int(info.max if init > 0 else info.min))
        elif dt.is_int(acc_t):
            init_c = "0"
        else:
            init_c = float_literal(init, acc_t)

        def comb(a: str, b: str) -> str:
            return f"({a} + {b})" if op == "+" else f"tl_{op}<{ct}>({a}, {b})"

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
        self.emit(f"// T.reduce_{s.kind}({src.name} -> {dst.name}, dim={s.dim})")
        self.open("")
        accs = self.fresh("acc")
        self.emit(f"{ct} {accs}[{nd}];")
        # registers of the kept dims (outer loops), then the reduced registers (inner loops)
        kept_regs = [(d, a) for d, a in fs.reg_order if d != s.dim]
        red_regs = [(d, a) for d, a in fs.reg_order if d == s.dim]
        names = {}
        for d, a in kept_regs:
            nm = self.fresh("r")
            names[(d, a)] = nm
            self.emit("#pragma unroll")
            self.open(f"for (int {nm} = 0; {nm} < {a.extent}; ++{nm})")
        dreg = " + ".join(f"{names[(d, a)]} * {fd.reg_stride(dst_dim[d], a)}" for d, a in kept_regs) or "0"
        acc = self.fresh("a")
        self.emit(f"{ct} {acc} = {init_c};")
        for d, a in red_regs:
            nm = self.fresh("r")
            names[(d, a)] = nm
            self.emit("#pragma unroll")
            self.open(f"for (int {nm} = 0; {nm} < {a.extent}; ++{nm})")
        sreg = " + ".join(f"{names[(d, a)]} * {fs.reg_stride(d, a)}" for d, a in fs.reg_order) or "0"
        val = f"{src.name}[{sreg}]"
        val = f"tilehal::to_float({val})" if src.dtype in _LOW else f"(({ct}){val})"
        if s.kind in ("abssum", "absmax"):
            val = f"fabsf({val})" if not dt.is_int(acc_t) else f"abs({val})"
        # padding of the reduced dim holds no data
        if fs.covered(s.dim) > fs.shape[s.dim]:
            terms = []
            for a in red_axes:
                v = self.thread_val(a) if a.kind == "t" else names[(s.dim, a)]
                terms.append(f"{v} * {a.coeff}")
            self.emit(f"if (({' + '.join(terms)}) < {fs.shape[s.dim]}) {acc} = {comb(acc, val)};")
        else:
            self.emit(f"{acc} = {comb(acc, val)};")
        for _ in red_regs:
            self.close()
        for ts, e in warp_ax:
            off = ts
            while off < ts * e:
                self.emit(f"{acc} = {comb(acc, f'__shfl_xor_sync(0xffffffffu, {acc}, {off})')};")
                off *= 2
        self.emit(f"{accs}[{dreg}] = {acc};")
        for _ in kept_regs:
            self.close()
        if cross_ax:
            base = self.scratch(nd * self.threads * 8)
            sp = f"(({ct}*){base})"
            self.emit("__syncthreads();")
            self.emit(f"for (int _i = 0; _i < {nd}; ++_i) {sp}[_i * {self.threads} + _tx] = {accs}[_i];")
            self.emit("__syncthreads();")
            self.open(f"for (int _i = 0; _i < {nd}; ++_i)")
            self.emit(f"{ct} _a = {init_c};")
            base_t = "_tx"
            for ts, e in cross_ax:
                base_t = f"({base_t} - ((_tx / {ts}) % {e}) * {ts})"
            loops = []
            for k, (ts, e) in enumerate(cross_ax):
                w = f"_w{k}"
                loops.append(f"{w} * {ts}")
                self.open(f"for (int {w} = 0; {w} < {e}; ++{w})")
            self.emit(f"_a = {comb('_a', f'{sp}[_i * {self.threads} + {base_t} + {chr(43).join(loops)}]')};")
            for _ in cross_ax:
                self.close()
            self.emit(f"{accs}[_i] = _a;")
            self.close()
            self.emit("__syncthreads();")
        self.emit("#pragma unroll")
        if s.clear:
            self.emit(f"for (int _i = 0; _i < {nd}; ++_i) {dst.name}[_i] = {self.conv(f'{accs}[_i]', acc_t, dst.dtype)};")
        else:
            old = f"tilehal::to_float({dst.name}[_i])" if dst.dtype in _LOW else f"{dst.name}[_i]"
            self.emit(f"for (int _i = 0; _i < {nd}; ++_i) {dst.name}[_i] = "
                      f"{self.conv(comb(old, f'{accs}[_i]'), acc_t, dst.dtype)};")
        self.close()
