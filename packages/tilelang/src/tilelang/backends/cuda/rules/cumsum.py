"""CUDA lowering of T.cumsum through shared memory."""

from __future__ import annotations

import numpy as np

from ....errors import CompileError
from ....ir import dtypes as dt
from ....ir.nodes import Buffer, CumSum
from ..common import _LOW, value_type


class CumSumRules:
    def cumsum(self, s: CumSum) -> None:
        src, dst = s.src, s.dst
        shape = src.static_shape()
        n = int(np.prod(shape))
        ct = value_type(dst.dtype)
        base = self.scratch(n * 8)
        sp = f"(({ct}*){base})"
        self.emit(f"// T.cumsum({src.name} -> {dst.name}, dim={s.dim}, reverse={s.reverse})")
        self.emit("__syncthreads();")
        self._to_from_scratch(src, sp, True)
        self.emit("__syncthreads();")
        rows = n // shape[s.dim]
        inner = int(np.prod(shape[s.dim + 1:]))
        L = shape[s.dim]
        self.open(f"for (int _row = _tx; _row < {rows}; _row += {self.threads})")
        self.emit(f"const int _base = (_row / {inner}) * {L * inner} + (_row % {inner});")
        self.emit(f"{ct} _acc = 0;")
        self.open(f"for (int _k = 0; _k < {L}; ++_k)")
        kk = f"({L - 1} - _k)" if s.reverse else "_k"
        self.emit(f"const int _o = _base + {kk} * {inner};")
        self.emit(f"_acc += {sp}[_o];")
        self.emit(f"{sp}[_o] = _acc;")
        self.close()
        self.close()
        self.emit("__syncthreads();")
        self._to_from_scratch(dst, sp, False)
        self.emit("__syncthreads();")

    def _to_from_scratch(self, buf: Buffer, sp: str, to: bool) -> None:
        if buf.scope == "fragment":
            f = self.inf.layouts[buf]
            names = [self.fresh("i") for _ in f.shape]
            shape = list(f.shape)

            def body(regvars):
                reg = self._reg_by_axes(f, f, regvars)
                flat = names[0]
                for d in range(1, len(names)):
                    flat = f"({flat}) * {shape[d]} + {names[d]}"
                fref = f"{buf.name}[{reg}]"
                if to:
                    self.emit(f"{sp}[{flat}] = {'tilehal::to_float(' + fref + ')' if buf.dtype in _LOW else fref};")
                else:
                    self.emit(f"{fref} = {self.conv(f'{sp}[{flat}]', dt.compute_type(buf.dtype), buf.dtype)};")

            self.layout_loop(f, names, body)
            return
        shape = buf.static_shape()
        names = [self.fresh("c") for _ in shape]

        def body2():
            flat = names[0]
            for d in range(1, len(names)):
                flat = f"({flat}) * {shape[d]} + {names[d]}"
            ref = self.mem_ref(buf, names)
            if to:
                self.emit(f"{sp}[{flat}] = {'tilehal::to_float(' + ref + ')' if buf.dtype in _LOW else ref};")
            else:
                self.emit(f"{ref} = {self.conv(f'{sp}[{flat}]', dt.compute_type(buf.dtype), buf.dtype)};")

        if buf.scope in ("local", "var"):
            raise CompileError(f"T.cumsum on a {buf.scope} buffer is not supported on cuda")
        self.flat_loop([str(x) for x in shape], names, body2)
