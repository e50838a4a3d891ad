"""`@tile_kernel`: plain Python loop nests over tensors, scheduled into tile programs.

    @tile_kernel
    def matmul(A, B, C):
        for i in range(A.shape[0]):
            for j in range(B.shape[1]):
                for k in range(A.shape[1]):
                    C[i, j] += A[i, k] * B[k, j]

    matmul(a, b, c)       # writes c in place (numpy or CPU torch)

The body is a perfect loop nest ending in one assignment `Out[...] = expr`, `Out[...] += expr`
or `Out[...] = max/min(Out[...], expr)`. Loop variables that index `Out` are output dims, the
others reduction dims. Patterns:
  - contraction (`C[i, j] += X[.., k] * Y[k, ..]`, one reduction var, plain indices): the tiled
    T.gemm schedule (tile sizes from the autotuner with `autotune=True`, else a heuristic);
  - everything else (elementwise maps, reductions): output tiles over thread blocks, a T.Parallel
    loop over the tile, reduction loops serial around it, accumulating in a fragment.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import tilehal

from .. import language as T
from ..errors import CompileError, SourceLoc
from ..frontend.meta import parse_python
from ..ir import dtypes as dt
from ..ir.nodes import (
    Alloc,
    Buffer,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    PrimFunc,
    Seq,
    Store,
    Var,
    as_expr,
    binop,
    const,
)
from ..ir.verifier import verify
from ..runtime.kernel import JITKernel, compile
from .schedules import default_gemm_config, gemm_configs, gemm_program

_FUNCS = {"exp": T.exp, "exp2": T.exp2, "log": T.log, "log2": T.log2, "sqrt": T.sqrt, "tanh": T.tanh, "abs": T.abs,
          "fabs": T.abs, "sigmoid": T.sigmoid, "max": T.max, "min": T.min, "maximum": T.max, "minimum": T.min}
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class _Nest:
    """The parsed loop nest: loop names with extent ASTs, the target, the combine op and the value AST."""

    def __init__(self, func: Callable) -> None:
        lines, self.first = inspect.getsourcelines(func)
        self.src_lines = textwrap.dedent("".join(lines)).splitlines()
        self.filename = inspect.getsourcefile(func) or "<unknown>"
        tree = parse_python(textwrap.dedent("".join(lines)))
        fdef = tree.body[0]
        assert isinstance(fdef, ast.FunctionDef)
        self.params = [a.arg for a in fdef.args.args]
        self.loops: list[tuple[str, ast.expr]] = []
        body = [s for s in fdef.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        while len(body) == 1 and isinstance(body[0], ast.For):
            f = body[0]
            it = f.iter
            if not (isinstance(f.target, ast.Name) and isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                    and it.func.id == "range" and len(it.args) == 1 and not f.orelse):
                self.fail(f, "tile_kernel loops must be `for name in range(extent)`")
            self.loops.append((f.target.id, it.args[0]))
            body = f.body
        if len(body) != 1 or not isinstance(body[0], (ast.Assign, ast.AugAssign)):
            self.fail(body[0] if body else fdef, "tile_kernel body must be a perfect loop nest ending in one "
                                                 "assignment")
        st = body[0]
        self.stmt = st
        target = st.targets[0] if isinstance(st, ast.Assign) else st.target
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)):
            self.fail(st, "tile_kernel must assign into a tensor element, e.g. C[i, j] = ...")
        self.out = target.value.id
        self.out_idx = self._names(target.slice, st)
        self.combine: str | None = None
        value = st.value
        if isinstance(st, ast.AugAssign):
            if type(st.op) not in (ast.Add, ast.Mult):
                self.fail(st, "only += and *= accumulate in tile_kernel")
            self.combine = "+" if isinstance(st.op, ast.Add) else "*"
        elif isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute)) and \
                _fname(value.func) in ("max", "min", "maximum", "minimum") and len(value.args) == 2 and \
                ast.unparse(value.args[0]) == ast.unparse(target):
            self.combine = "max" if _fname(value.func) in ("max", "maximum") else "min"
            value = value.args[1]
        self.value = value
        loop_names = [n for n, _ in self.loops]
        for n in self.out_idx:
            if n not in loop_names:
                self.fail(st, f"output index {n!r} is not a loop variable")
        self.reduce_vars = [n for n in loop_names if n not in self.out_idx]
        if self.reduce_vars and self.combine is None:
            self.fail(st, f"loops {self.reduce_vars} do not index {self.out}: accumulate with += or max/min")

    def fail(self, node: ast.AST, msg: str) -> None:
        ln = getattr(node, "lineno", 1)
        code = self.src_lines[ln - 1] if 0 < ln <= len(self.src_lines) else ""
        raise CompileError(msg, SourceLoc(self.filename, self.first + ln - 1, code))

    def _names(self, sl: ast.expr, node: ast.AST) -> list[str]:
        elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if not all(isinstance(e, ast.Name) for e in elts):
            self.fail(node, "output indices must be loop variables")
        return [e.id for e in elts]

    def contraction(self) -> tuple[str, str, bool, bool] | None:
        """(A, B, transpose_A, transpose_B) when the statement is C[i, j] += A[..] * B[..] with one k."""
        v = self.value
        if self.combine != "+" or len(self.out_idx) != 2 or len(self.reduce_vars) != 1:
            return None
        if not (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Mult)):
            return None
        ops = []
        for side in (v.left, v.right):
            if not (isinstance(side, ast.Subscript) and isinstance(side.value, ast.Name)):
                return None
            elts = side.slice.elts if isinstance(side.slice, ast.Tuple) else [side.slice]
            if len(elts) != 2 or not all(isinstance(e, ast.Name) for e in elts):
                return None
            ops.append((side.value.id, [e.id for e in elts]))
        i, j = self.out_idx
        (k,) = self.reduce_vars
        (na, ia), (nb, ib) = ops
        if set(ia) == {j, k} and set(ib) == {i, k}:
            (na, ia), (nb, ib) = (nb, ib), (na, ia)
        if set(ia) != {i, k} or set(ib) != {k, j}:
            return None
        return na, nb, ia == [k, i], ib == [j, k]


def _fname(f: ast.expr) -> str:
    return f.id if isinstance(f, ast.Name) else f.attr


class TileKernel:
    def __init__(self, func: Callable, target: str, autotune: bool, block: tuple[int, int]) -> None:
        self.func = func
        self.nest = _Nest(func)
        self.target = target
        self.autotune = autotune
        self.block = block
        self._kernels: dict[tuple, Callable[[list[Any]], None]] = {}
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def _env(self, tensors: dict[str, Any]) -> dict[str, Any]:
        env = dict(self.func.__globals__)
        env.update(tensors)
        return env

    def _extents(self, tensors: dict[str, Any]) -> dict[str, int]:
        env = self._env(tensors)
        out = {}
        for name, node in self.nest.loops:
            try:
                out[name] = int(eval(compile_expr(node), env))  # noqa: S307 - the user's own size expression
            except Exception as e:  # noqa: BLE001
                self.nest.fail(node, f"cannot evaluate loop extent {ast.unparse(node)}: {e}")
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        sig = inspect.signature(self.func).bind(*args, **kwargs)
        tensors = dict(sig.arguments)
        for n, t in tensors.items():
            if not tilehal.tensors.is_array(t):
                raise tilehal.ArgumentError(f"{n}: expected a tensor or array, got {type(t).__name__}")
        key = tuple((n, tuple(t.shape), tilehal.dtype_of(t).name) for n, t in tensors.items())
        if key not in self._kernels:
            self._kernels[key] = self._build(tensors)
        self._kernels[key](list(tensors.values()))

    # ------------------------------------------------------------ scheduling

    def _index_range(self, node: ast.expr, ext: dict[str, int]) -> tuple[int, int]:
        """Inclusive range of an affine index expression over the loop ranges."""
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value, node.value
        if isinstance(node, ast.Name) and node.id in ext:
            return 0, ext[node.id] - 1
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = self._index_range(node.left, ext), self._index_range(node.right, ext)
            if isinstance(node.op, ast.Add):
                return a[0] + b[0], a[1] + b[1]
            if isinstance(node.op, ast.Sub):
                return a[0] - b[1], a[1] - b[0]
            prods = [x * y for x in a for y in b]
            return min(prods), max(prods)
        self.nest.fail(node, f"unsupported index expression in tile_kernel: {ast.unparse(node)} (use loop variables, "
                             f"ints, + - *)")

    def _check_bounds(self, tensors: dict[str, Any], ext: dict[str, int]) -> None:
        """Every tensor access stays inside the tensor for the whole loop nest: checked before compiling."""
        st = self.nest.stmt
        for node in ast.walk(st):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in tensors:
                t = tensors[node.value.id]
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                if len(elts) != t.ndim:
                    self.nest.fail(node, f"{node.value.id} has rank {t.ndim}, indexed with {len(elts)} indices")
                for d, e in enumerate(elts):
                    lo, hi = self._index_range(e, ext)
                    if lo < 0 or hi >= int(t.shape[d]):
                        raise tilehal.ShapeError(
                            f"{node.value.id}: dim {d} is indexed by {ast.unparse(e)} over [{lo}, {hi}] but has size "
                            f"{int(t.shape[d])} (line {self.nest.first + node.lineno - 1})")

    def _build(self, tensors: dict[str, Any]) -> Callable[[list[Any]], None]:
        ext = self._extents(tensors)
        self._check_bounds(tensors, ext)
        c = self.nest.contraction()
        if c is not None:
            return self._build_gemm(tensors, ext, c)
        return self._build_generic(tensors, ext)

    def _build_gemm(self, tensors: dict[str, Any], ext: dict[str, int], c: tuple) -> Callable:
        na, nb, ta, tb = c
        i, j = self.nest.out_idx
        (k,) = self.nest.reduce_vars
        M, N, K = ext[i], ext[j], ext[k]
        dts = [tilehal.dtype_of(tensors[n]).name for n in (na, nb, self.nest.out)]
        if self.autotune:
            from ..runtime.autotune import AutoTuner
            from ..runtime.kernel import JITFactory

            def factory(block_M: int = 64, block_N: int = 64, block_K: int = 32) -> PrimFunc:
                return gemm_program(M, N, K, ta, tb, True, *dts, block_M=block_M, block_N=block_N, block_K=block_K)

            factory.__qualname__ = f"tile_kernel.{self.__name__}.gemm_{M}x{N}x{K}_{ta}{tb}_{'_'.join(dts)}"
            tuner = AutoTuner(JITFactory(factory, None, self.target, None), gemm_configs(M, N, K), 1, 3, None,
                              None, 0, 0, True, True)
            kernel = tuner()
        else:
            cfg = default_gemm_config(M, N, K)
            kernel = compile(gemm_program(M, N, K, ta, tb, True, *dts, **cfg), target=self.target)
        self.kernel = kernel
        order = [na, nb, self.nest.out]
        names = list(tensors)
        return lambda arrays: kernel(*[arrays[names.index(n)] for n in order])

    def _build_generic(self, tensors: dict[str, Any], ext: dict[str, int]) -> Callable:
        nest = self.nest
        bufs = {n: Buffer(n, tuple(const(int(s)) for s in t.shape), tilehal.dtype_of(t).name)
                for n, t in tensors.items()}
        out = bufs[nest.out]
        out_dims = [ext[n] for n in nest.out_idx]
        if not out_dims:
            nest.fail(nest.stmt, "tile_kernel needs at least one output index")
        tiled = out_dims[:2]
        blocks = [self.block[0], self.block[1]][:len(tiled)]
        blocks = [min(b, d) for b, d in zip(blocks, tiled)]
        bvars = [Var(f"b{d}") for d in range(len(tiled))]
        lane = [Var(f"t_{n}") for n in nest.out_idx]
        full = {}
        for d, n in enumerate(nest.out_idx):
            full[n] = binop("+", binop("*", bvars[d], blocks[d]), lane[d]) if d < len(tiled) else lane[d]
        red = {n: Var(n) for n in nest.reduce_vars}
        env: dict[str, Expr] = {**full, **red}
        tile_shape = blocks + out_dims[2:]
        inb: Expr = Const(True, "bool")
        for d in range(len(tiled)):
            inb = binop("and", inb, binop("<", full[nest.out_idx[d]], tiled[d]))
        out_idx = [full[n] for n in nest.out_idx]
        val = self._expr(nest.value, bufs, env)

        def parallel(body) -> For:
            for v, n in reversed(list(zip(lane, tile_shape))):
                body = For(v, const(0), const(n), "parallel", body)
            return body

        stmts: list = []
        if nest.combine is None:
            stmts.append(parallel(If(inb, Store(out, out_idx, val))))
        else:
            acc_t = dt.compute_type(out.dtype)
            acc = Buffer("acc", tuple(const(n) for n in tile_shape), acc_t, "fragment")
            stmts.append(Alloc(acc))
            stmts.append(parallel(Store(acc, lane, _select(inb, Load(out, out_idx), acc_t))))
            update = Store(acc, lane, binop(nest.combine, Load(acc, lane), val))
            body: Any = parallel(If(inb, update))
            for n in reversed(nest.reduce_vars):
                body = For(red[n], const(0), const(ext[n]), "serial", body)
            stmts.append(body)
            stmts.append(parallel(If(inb, Store(out, out_idx, Load(acc, lane)))))
        grid = [const(-(-d // b)) for d, b in zip(tiled, blocks)]
        kernel_stmt = Kernel(grid, bvars, (128,), Seq(stmts))
        dyn: list[Var] = []
        func = PrimFunc(self.__name__, list(bufs.values()), Seq([kernel_stmt]), dyn,
                        SourceLoc(nest.filename, nest.first, ""))
        verify(func)
        kernel = JITKernel(func, out_idx=None, target=self.target)
        self.kernel = kernel
        return lambda arrays: kernel(*arrays)

    def _expr(self, node: ast.expr, bufs: dict[str, Buffer], env: dict[str, Expr]) -> Expr:
        nest = self.nest
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return const(node.value)
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            v = self.func.__globals__.get(node.id, getattr(builtins, node.id, None))
            if isinstance(v, (int, float)):
                return const(v)
            nest.fail(node, f"name {node.id!r} is not a loop variable or number")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in bufs:
            b = bufs[node.value.id]
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if len(elts) != b.ndim:
                nest.fail(node, f"{b.name} has rank {b.ndim}, indexed with {len(elts)}")
            return Load(b, [self._expr(e, bufs, env) for e in elts])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return binop(_OPS[type(node.op)], self._expr(node.left, bufs, env), self._expr(node.right, bufs, env))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            e = self._expr(node.operand, bufs, env)
            return binop("-", Const(0, e.dtype), e)
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and \
                _fname(node.func) in _FUNCS:
            args = [self._expr(a, bufs, env) for a in node.args]
            return as_expr(_FUNCS[_fname(node.func)](*args))
        nest.fail(node, f"unsupported expression in tile_kernel: {ast.unparse(node)}")


def _select(cond: Expr, value: Expr, dtype: str) -> Expr:
    return T.if_then_else(cond, value, Const(0, dtype))


def compile_expr(node: ast.expr) -> Any:
    return builtins.compile(ast.Expression(body=node), "<tile_kernel extent>", "eval")


def tile_kernel(func: Callable | None = None, *, target: str = "auto", autotune: bool = False,
                block: tuple[int, int] = (8, 64)) -> Any:
    """Decorator: schedule a plain loop nest into a tile program; call it with the tensors (outputs in place)."""

    def wrap(f: Callable) -> TileKernel:
        return TileKernel(f, target, autotune, block)

    return wrap(func) if func is not None else wrap


__all__ = ["TileKernel", "tile_kernel"]
