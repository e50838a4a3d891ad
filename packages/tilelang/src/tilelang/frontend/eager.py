"""The eager JIT style: a `@tilelang.jit` function whose body *is* the kernel.

    @tilelang.jit
    def matmul(A, B, block_M, block_N, block_K, dtype=T.float16):
        M, N, K = T.const("M, N, K")          # sizes specialized per call (or given to .compile)
        A: T.Tensor((M, K), dtype)             # parameters annotated in the body are tensors
        B: T.Tensor((K, N), dtype)
        C = T.empty((M, N), dtype)             # outputs are created ...
        with T.Kernel(...) as (bx, by):
            ...
        return C                               # ... and returned

Parameters not annotated as tensors are meta-level values (block sizes, dtypes, flags). Each
`T.const` name is bound either from a keyword given to `.compile(M=...)` or from the shape of
the first tensor annotation it appears in directly; `T.dynamic` sizes stay symbolic.
`EagerParser` parses one specialization into a PrimFunc; `tensor_params` finds which parameters
are tensors without running anything.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import tilehal

from ..errors import CompileError
from ..ir import dtypes as dt
from ..ir.nodes import Buffer, Expr, Kernel, PrimFunc, Seq, Stmt, Var, const
from ..ir.verifier import verify
from .meta import TensorType, parse_python
from .parser import Parser


def _function_def(tree: ast.Module) -> ast.FunctionDef:
    fdef = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fdef is None:
        raise CompileError("no function definition found")
    return fdef


def _is_kernel_with(node: ast.stmt) -> bool:
    if not isinstance(node, ast.With):
        return False
    for item in node.items:
        c = item.context_expr
        if isinstance(c, ast.Call):
            f = c.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "Kernel":
                return True
    return False


def _calls(node: ast.AST, names: tuple[str, ...], scope: dict) -> bool:
    """Whether `node` calls T.<name> for one of `names`, T being the language module (so `torch.empty` or a
    user's own `const` do not count)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in names and isinstance(f.value, ast.Name):
                if getattr(scope.get(f.value.id), "__tl_language__", False):
                    return True
            elif isinstance(f, ast.Name) and f.id in names and getattr(scope.get(f.id), "__tl_eager__", None):
                return True
    return False


def is_eager_style(fn: Callable) -> bool:
    """True when `fn`'s own body holds the kernel (a top-level `with T.Kernel`, `T.const` or `T.empty`)
    rather than defining and returning a `@T.prim_func`."""
    try:
        tree = parse_python(_dedented_source(fn))
    except (OSError, TypeError, SyntaxError):
        return False
    fdef = _function_def(tree)
    own = [s for s in fdef.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    if any(_is_kernel_with(s) for s in own):
        return True
    scope = dict(getattr(fn, "__globals__", {}))
    for name, cell in zip(getattr(fn, "__code__", None).co_freevars if hasattr(fn, "__code__") else (),
                          getattr(fn, "__closure__", None) or ()):
        try:
            scope[name] = cell.cell_contents
        except ValueError:
            pass
    return any(_calls(s, ("const", "empty"), scope) for s in own)


def _dedented_source(fn: Callable) -> str:
    import textwrap

    return textwrap.dedent(inspect.getsource(fn))


def tensor_params(fn: Callable) -> list[str]:
    """Names of `fn`'s parameters annotated as tensors (in the body, `A: T.Tensor(...)`, or in the
    signature), in signature order."""
    fdef = _function_def(parse_python(_dedented_source(fn)))
    names = [a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs]
    annotated = {a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs
                 if a.annotation is not None and _looks_like_tensor(a.annotation)}
    for s in ast.walk(fdef):
        if isinstance(s, ast.AnnAssign) and s.value is None and isinstance(s.target, ast.Name):
            if s.target.id in names:
                annotated.add(s.target.id)
    return [n for n in names if n in annotated]


def _looks_like_tensor(ann: ast.expr) -> bool:
    node = ann.func if isinstance(ann, ast.Call) else ann.value if isinstance(ann, ast.Subscript) else ann
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("Tensor", "Buffer", "StridedTensor")


class ConstSize(Var):
    """A `T.const` size not yet known: bound by the first tensor annotation it appears in."""


@dataclass
class EagerResult:
    func: PrimFunc
    out_idx: list[int]
    consts: dict[str, int]  # every T.const name -> its value in this specialization
    matcher: dict[str, tuple[str, int]] = field(default_factory=dict)  # const -> (tensor param, dim)


_CONST_SPLIT = re.compile(r"[\s,]+")


class EagerParser(Parser):
    """Parse one specialization of an eager `@tilelang.jit` function."""

    def __init__(self, func: Callable, meta: dict[str, Any], tensors: dict[str, Any], consts: dict[str, int],
                 tensor_names: list[str]) -> None:
        super().__init__(func)
        self.meta = meta
        self.tensors = tensors
        self.given_consts = dict(consts)
        self.tensor_names = tensor_names
        self.const_values: dict[str, int] = {}
        self.pending: dict[str, ConstSize] = {}
        self.matcher: dict[str, tuple[str, int]] = {}
        self.params: dict[str, Buffer] = {}
        self.outputs: list[Buffer] = []
        self.returned: list[Buffer] | None = None
        self.dyn: list[Var] = []
        self.eager = True

    # ------------------------------------------------------------ the eager-only names

    def eager_const(self, node: ast.AST, names: Any, dtype: Any = "int32") -> Any:
        if not isinstance(names, str):
            self.fail(node, f"T.const expects a string of size names such as \"M, N, K\", got {names!r}")
        parts = [p for p in _CONST_SPLIT.split(names.strip()) if p]
        if not parts:
            self.fail(node, "T.const: no names given")
        out = []
        for p in parts:
            if p in self.given_consts:
                v = self.given_consts[p]
                if not isinstance(v, int) or isinstance(v, bool):
                    self.fail(node, f"T.const {p}: expected an int, got {v!r}")
                self.const_values[p] = v
                out.append(v)
            else:
                var = ConstSize(p, dt.canonical(dtype))
                self.pending[p] = var
                self.shared.used_names.add(p)
                out.append(var)
        return out[0] if len(out) == 1 else tuple(out)

    def eager_empty(self, node: ast.AST, name: str | None, shape: Any, dtype: Any = "float32") -> Buffer:
        if self.shared.kernel is not None:
            self.fail(node, "T.empty creates a kernel output: call it outside `with T.Kernel`")
        if isinstance(shape, (int, Expr)):
            shape = (shape,)
        if not isinstance(shape, (list, tuple)) or not shape:
            self.fail(node, f"T.empty: expected a shape tuple, got {shape!r}")
        dims = []
        for s in shape:
            s = self._resolved(s)
            if isinstance(s, ConstSize):
                self.fail(node, f"T.empty: size {s.name} (T.const) is not known yet; annotate an input tensor "
                                f"that has it first, or pass {s.name}= to .compile()")
            if isinstance(s, bool) or not isinstance(s, (int, Var)):
                self.fail(node, f"T.empty: shape entries must be ints, T.const or T.dynamic sizes, got {s!r}")
            if isinstance(s, Var) and s not in self.dyn:
                self.dyn.append(s)
                self.shared.used_names.add(s.name)  # loop variables must not shadow a size
            dims.append(const(int(s)) if isinstance(s, int) else s)
        try:
            dtype = dt.canonical(dtype)
        except TypeError as e:
            self.fail(node, f"T.empty: {e}")
        bname = self.shared.fresh(name or f"out{len(self.outputs)}")
        buf = Buffer(bname, tuple(dims), dtype, "global")
        self.outputs.append(buf)
        return buf

    def _resolved(self, v: Any) -> Any:
        if isinstance(v, ConstSize) and v.name in self.const_values:
            return self.const_values[v.name]
        return v

    def _rebind(self, var: ConstSize, value: int) -> None:
        def sub(x: Any) -> Any:
            if x is var:
                return value
            if isinstance(x, tuple):
                return tuple(sub(e) for e in x)
            if isinstance(x, list):
                return [sub(e) for e in x]
            return x

        for scope in self.scopes:
            for k, v in list(scope.items()):
                scope[k] = sub(v)

    # ------------------------------------------------------------ hooks into the parser

    def expr_Call(self, node: ast.Call) -> Any:
        fn = self.value(node.func)
        kind = getattr(fn, "__tl_eager__", None)
        if kind is None:
            return super().expr_Call(node)
        args = self.eval_args(node.args)
        kwargs = {k.arg: self.value(k.value) for k in node.keywords}
        try:
            if kind == "const":
                return self.eager_const(node, *args, **kwargs)
            if kind == "empty":
                return self.eager_empty(node, getattr(self, "_assign_name", None), *args, **kwargs)
        except TypeError as e:
            self.fail(node, f"T.{kind}: {e}")
        self.fail(node, f"unknown eager construct T.{kind}")

    def stmt_Assign(self, node: ast.Assign) -> Any:
        t = node.targets[0] if len(node.targets) == 1 else None
        self._assign_name = t.id if isinstance(t, ast.Name) else None
        try:
            return super().stmt_Assign(node)
        finally:
            self._assign_name = None

    def stmt_AnnAssign(self, node: ast.AnnAssign) -> Any:
        t = node.target
        if node.value is None and isinstance(t, ast.Name) and t.id in self.tensor_names:
            self.annotate(t.id, self.value(node.annotation), node)
            return None
        return super().stmt_AnnAssign(node)

    def stmt_Return(self, node: ast.Return) -> NoReturn | None:
        if self.shared.kernel is not None or len(self.scopes) > 2:
            self.fail(node, "`return` is only allowed at the end of an eager @tilelang.jit function")
        v = self.value(node.value) if node.value is not None else ()
        vals = list(v) if isinstance(v, (tuple, list)) else [v]
        for x in vals:
            if not isinstance(x, Buffer) or x not in self.outputs:
                self.fail(node, f"an eager @tilelang.jit function returns the tensors it made with T.empty, got "
                                f"{getattr(x, 'name', x)!r}")
        self.returned = vals
        return None

    # ------------------------------------------------------------ tensors

    def annotate(self, name: str, ann: Any, node: ast.AST) -> None:
        if name in self.params:
            self.fail(node, f"tensor parameter {name!r} is annotated twice")
        if not isinstance(ann, TensorType):
            self.fail(node, f"parameter {name!r}: expected a T.Tensor(shape, dtype) annotation, got {ann!r}")
        actual = self.tensors.get(name)
        if actual is not None and not (hasattr(actual, "shape") and hasattr(actual, "dtype")):
            raise tilehal.ShapeError(f"{name}: expected a tensor (torch or numpy), got {type(actual).__name__}")
        ashape = tuple(int(s) for s in actual.shape) if actual is not None else None
        if ashape is not None and len(ashape) != len(ann.shape):
            raise tilehal.ShapeError(f"{name}: expected a tensor of rank {len(ann.shape)} (shape {ann.shape}), got "
                                     f"shape {ashape}")
        dims: list[Expr] = []
        for d, s in enumerate(ann.shape):
            s = self._resolved(s)
            if isinstance(s, ConstSize):
                if ashape is None:
                    self.fail(node, f"T.const size {s.name} of {name}: pass {s.name}= to .compile(), or call the "
                                    f"function with tensors")
                self.const_values[s.name] = ashape[d]
                self.matcher[s.name] = (name, d)
                self._rebind(s, ashape[d])
                s = ashape[d]
            if isinstance(s, bool):
                self.fail(node, f"parameter {name!r}: bad shape entry {s!r}")
            if isinstance(s, int):
                if ashape is not None and ashape[d] != s:
                    raise tilehal.ShapeError(f"{name}: expected shape {tuple(self._show(x) for x in ann.shape)}, got "
                                             f"{ashape} (dim {d} should be {s})")
                dims.append(const(s))
            elif isinstance(s, Var):
                if s not in self.dyn:
                    self.dyn.append(s)
                    self.shared.used_names.add(s.name)  # loop variables must not shadow a size
                dims.append(s)
            else:
                self.fail(node, f"parameter {name!r}: shape entries must be ints, T.const or T.dynamic sizes, got "
                                f"{s!r}")
        self.shared.used_names.add(name)
        buf = Buffer(name, tuple(dims), ann.dtype, "global")
        self.params[name] = buf
        self.bind(name, buf)

    def _show(self, s: Any) -> Any:
        s = self._resolved(s)
        return s.name if isinstance(s, Var) else s

    # ------------------------------------------------------------ entry

    def parse_eager(self) -> EagerResult:
        fdef = _function_def(self.tree)
        for n in self.tensor_names:
            self.bind(n, _Unannotated(n))
        for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs:
            if a.arg in self.tensor_names:
                if a.annotation is not None and _looks_like_tensor(a.annotation):
                    self.annotate(a.arg, self.value(a.annotation), a)
            else:
                self.bind(a.arg, self.meta[a.arg])
                self.shared.used_names.add(a.arg)
        body = self.block(fdef.body, None)
        missing = [n for n in self.tensor_names if n not in self.params]
        if missing:
            self.fail(fdef, f"tensor parameter(s) {missing} are never annotated with T.Tensor")
        unbound = [n for n in self.pending if n not in self.const_values]
        if unbound:
            self.fail(fdef, f"T.const size(s) {unbound} are not used directly in any tensor annotation; pass them to "
                            f".compile() or use T.dynamic")
        stmts = body.body if isinstance(body, Seq) else [body]
        if not any(isinstance(s, Kernel) for s in stmts):
            self.fail(fdef, "an eager @tilelang.jit function needs a `with T.Kernel(...)` block")
        returned = self.returned if self.returned is not None else []
        extra = [b for b in self.outputs if b not in returned]
        if extra:
            self.fail(fdef, f"T.empty tensor(s) {[b.name for b in extra]} are not returned")
        params = [self.params[n] for n in self.tensor_names] + self.outputs
        out_idx = [params.index(b) for b in returned]
        ws = list(self.shared.workspace)
        views = [v for v, _ in self.shared.views]
        func = PrimFunc(fdef.name, params + ws + views, _seq(stmts), self.dyn, self.loc(fdef), self.source, ws,
                        list(self.shared.views))
        verify(func)
        return EagerResult(func, out_idx, dict(self.const_values), dict(self.matcher))


class _Unannotated:
    """What a tensor parameter's name means before its `T.Tensor` annotation."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<tensor parameter {self.name} used before its T.Tensor annotation>"


def _seq(stmts: list[Stmt]) -> Stmt:
    return Seq(stmts)

