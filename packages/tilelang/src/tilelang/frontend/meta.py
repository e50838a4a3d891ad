"""Meta-level evaluation: the scope a prim_func body runs in, and its expressions.

Meta-level Python (sizes, dtypes, closure values, arithmetic on Python numbers, calls of plain
Python functions) is evaluated here, in the function's own scope; anything that depends on
tensors, block indices or loop variables becomes IR. Also the meta-level objects the front end
recognizes: `TensorType` (parameter annotations) and `Macro` (`@T.macro` helpers).

This module and the rest of the front end import only the IR: the language surface
(`tilelang.language`) is built on top of it, never the other way round.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import itertools
import operator
import textwrap
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ..errors import CompileError, SourceLoc
from ..ir import dtypes as dt
from ..ir.nodes import (
    Buffer,
    Call,
    Cast,
    Const,
    Expr,
    Kernel,
    Load,
    Not,
    Select,
    Var,
    as_expr,
    binop,
    const,
)

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>"}
_PYOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
          ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor,
          ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_PYCMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
          ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not,
          ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def is_ir(v: Any) -> bool:
    return isinstance(v, (Expr, Buffer))


@dataclass(frozen=True)
class BufferData:
    """`buf.data`: the storage of a global tensor, to build a view on (`T.Tensor(shape, dtype, buf.data)`)."""

    buffer: Buffer


@dataclass(frozen=True)
class TensorType:
    """Parameter annotation `T.Tensor(shape, dtype)`; shape entries are ints or `T.dynamic` vars. With `data`
    (inside a body), a view of that storage with this shape."""

    shape: tuple[Any, ...]
    dtype: str
    data: BufferData | None = None

    def __repr__(self) -> str:
        return f"T.Tensor({self.shape}, {self.dtype!r})"


def tensor_type(shape: Sequence[Any] | int, dtype: Any = "float32", data: Any = None) -> TensorType:
    if isinstance(shape, (int, Expr)):
        shape = (shape,)
    if isinstance(data, Buffer):
        data = BufferData(data)
    if data is not None and not isinstance(data, BufferData):
        raise TypeError(f"T.Tensor: data must be a tensor's .data, got {data!r}")
    return TensorType(tuple(shape), dt.canonical(dtype), data)


class Macro:
    """`@T.macro`: a helper whose body is inlined where it is called inside a prim_func."""

    def __init__(self, func: Callable) -> None:
        self.func = func
        self.__name__ = func.__name__

    def __call__(self, *a: Any, **k: Any) -> Any:
        raise CompileError(f"T.macro {self.__name__} can only be called inside a @T.prim_func body")


def _float_type(e: Expr) -> str:
    return e.dtype if dt.is_float(e.dtype) else "float32"


def ir_pow(a: Expr, b: Expr) -> Expr:
    return Call("pow", [a, b], _float_type(binop("+", a, b)))


def ir_select(c: Expr, a: Expr, b: Expr) -> Expr:
    return Select(c, a, b, binop("+", a, b).dtype)  # promotion rules of arithmetic


# Names a generated C / CUDA C++ program cannot use for a variable: user names that collide get a suffix.
_RESERVED = frozenset("""auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef union unsigned void volatile
while bool true false class new delete this template typename namespace operator private public protected virtual
friend explicit mutable using try catch throw asm alignas alignof decltype noexcept nullptr static_assert
thread_local int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t size_t half float2 float4 dim3
threadIdx blockIdx blockDim gridDim warpSize NAN INFINITY main""".split())


_AST_LOCK = threading.Lock()


def parse_python(source: str) -> ast.Module:
    """`ast.parse` under a process-wide lock. CPython 3.11 keeps the AST constructor's recursion depth in
    interpreter-wide state, so parses running at once in the autotuner's compile threads can fail with
    "SystemError: AST constructor recursion depth mismatch" (cpython gh-106905; seen in CI)."""
    with _AST_LOCK:
        return ast.parse(source)


def _astype(e: Expr) -> Callable[[Any], Expr]:
    def astype(dtype: Any) -> Expr:
        return Cast(e, dt.canonical(str(dtype)))

    astype.__tl_meta__ = True
    return astype


class Shared:
    """State shared by a prim_func's parser and the parsers of the macros it inlines."""

    def __init__(self) -> None:
        self.names = itertools.count()
        self.kernel: Kernel | None = None
        self.used_names: set[str] = set(_RESERVED)
        self.workspace: list[Buffer] = []  # T.alloc_global buffers
        self.views: list[tuple[Buffer, Buffer]] = []  # (view, the global tensor whose storage it reshapes)

    def fresh(self, base: str) -> str:
        name = base
        while name in self.used_names:
            name = f"{base}_{next(self.names)}"
        self.used_names.add(name)
        return name


class _Stale:
    """The binding of a name reassigned inside an IR loop / `if`: reading it after that block is an error."""

    def __init__(self, name: str, where: SourceLoc) -> None:
        self.name = name
        self.where = where


class MetaEvaluator:
    """The function's source, its scopes, and the evaluation of expressions in them."""

    def __init__(self, func: Callable, shared: Shared | None = None) -> None:
        self.func = func
        self.shared = shared or Shared()
        try:
            lines, first = inspect.getsourcelines(func)
        except (OSError, TypeError) as e:
            raise CompileError(f"cannot read the source of {getattr(func, '__name__', func)!r}: {e}") from e
        self.source = textwrap.dedent("".join(lines))
        self.lines = self.source.splitlines()
        self.first_line = first
        self.filename = inspect.getsourcefile(func) or func.__code__.co_filename
        self.tree = parse_python(self.source)
        self.globals = func.__globals__
        self.closure: dict[str, Any] = {}
        for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
            try:
                self.closure[name] = cell.cell_contents
            except ValueError:  # cell not yet filled
                pass
        self.scopes: list[dict[str, Any]] = [{}]

    # ------------------------------------------------------------ helpers

    def loc(self, node: ast.AST) -> SourceLoc:
        ln = getattr(node, "lineno", 1)
        code = self.lines[ln - 1] if 0 < ln <= len(self.lines) else ""
        return SourceLoc(self.filename, self.first_line + ln - 1, code)

    def fail(self, node: ast.AST, msg: str) -> NoReturn:
        raise CompileError(msg, self.loc(node))

    def lookup(self, name: str, node: ast.AST) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                v = scope[name]
                if isinstance(v, _Stale):
                    self.fail(node, f"{name!r} was reassigned inside the IR loop or `if` block at {v.where}; `=` on a "
                                    f"scalar binds an immutable value, so the new value does not reach past that "
                                    f"block. Carry it in a variable: `{name} = T.alloc_var(dtype)` before the block, "
                                    f"then `{name} = ...` inside")
                return v
        if name in self.closure:
            return self.closure[name]
        if name in self.globals:
            return self.globals[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        self.fail(node, f"name {name!r} is not defined")

    def bind(self, name: str, value: Any) -> None:
        self.scopes[-1][name] = value

    def to_expr(self, v: Any, node: ast.AST) -> Expr:
        if isinstance(v, Buffer):
            if v.scope == "var":
                return Load(v, [const(0)])
            self.fail(node, f"buffer {v.name} used as a scalar; index it, e.g. {v.name}[i]")
        try:
            return as_expr(v)
        except TypeError:
            self.fail(node, f"expected a scalar expression, got {type(v).__name__} {v!r}")

    def _local_lookup(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None


    def _need_kernel(self, node: ast.AST, what: str) -> Kernel:
        if self.shared.kernel is None:
            self.fail(node, f"{what} must be inside `with T.Kernel(...)`")
        return self.shared.kernel


    # ------------------------------------------------------------ expressions

    def eval_args(self, nodes: list[ast.expr]) -> list[Any]:
        """Positional call arguments, with `*seq` unpacked at meta level."""
        out: list[Any] = []
        for a in nodes:
            if isinstance(a, ast.Starred):
                seq = self.value(a.value)
                if is_ir(seq) or not isinstance(seq, (list, tuple, range)):
                    self.fail(a, f"*{ast.unparse(a.value)}: expected a Python tuple or list, got {seq!r}")
                out.extend(seq)
            else:
                out.append(self.value(a))
        return out

    def value(self, node: ast.AST) -> Any:
        method = getattr(self, f"expr_{type(node).__name__}", None)
        if method is None:
            return self.meta_eval(node)
        return method(node)

    def meta_eval(self, node: ast.AST) -> Any:
        """Fallback for Python-only expressions (comprehensions, lambdas, ...): plain eval, if no IR is involved."""
        env: dict[str, Any] = dict(self.closure)
        for scope in self.scopes:
            env.update(scope)
        if any(is_ir(v) for n in ast.walk(node) if isinstance(n, ast.Name) for v in [env.get(n.id)]):
            self.fail(node, f"unsupported Python construct in a prim_func: {type(node).__name__} over IR values")
        try:
            code = compile(ast.Expression(body=node), self.filename, "eval")
            return eval(code, self.globals, env)  # noqa: S307 - the user's own meta-level code
        except Exception as e:  # noqa: BLE001 - reported with file:line
            self.fail(node, f"error evaluating {ast.unparse(node)}: {type(e).__name__}: {e}")

    def expr_Constant(self, node: ast.Constant) -> Any:
        return node.value

    def expr_Name(self, node: ast.Name) -> Any:
        return self.lookup(node.id, node)

    def expr_Tuple(self, node: ast.Tuple) -> tuple:
        return tuple(self.value(e) for e in node.elts)

    def expr_List(self, node: ast.List) -> list:
        return [self.value(e) for e in node.elts]

    def expr_Dict(self, node: ast.Dict) -> dict:
        return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}

    def expr_Attribute(self, node: ast.Attribute) -> Any:
        base = self.value(node.value)
        attr = node.attr
        if getattr(base, "__tl_language__", False):  # the tilelang.language module
            if not hasattr(base, attr) or attr.startswith("_"):
                self.fail(node, f"unknown name T.{attr} (not part of tilelang.language)")
            return getattr(base, attr)
        if isinstance(base, Buffer):
            if attr == "shape":
                return tuple(int(s.value) if isinstance(s, Const) else s for s in base.shape)
            if attr == "dtype":
                return base.dtype
            if attr == "ndim":
                return base.ndim
            if attr == "name":
                return base.name
            if attr == "data":
                return BufferData(base)
            self.fail(node, f"buffer {base.name} has no attribute {attr!r} (supported: shape, dtype, ndim)")
        if isinstance(base, Expr):
            if attr == "dtype":
                return base.dtype
            if attr == "astype":  # TIR's `x.astype(dtype)`, as the dequantize helpers write casts
                return _astype(base)
            self.fail(node, f"expression has no attribute {attr!r}")
        try:
            return getattr(base, attr)
        except AttributeError:
            self.fail(node, f"{ast.unparse(node.value)} has no attribute {attr!r}")

    def expr_Subscript(self, node: ast.Subscript) -> Any:
        base = self.value(node.value)
        if isinstance(base, Buffer):
            return Load(base, self.indices(node, base))
        if isinstance(node.slice, ast.Slice):
            sl = node.slice
            idx = slice(*(self.value(x) if x is not None else None for x in (sl.lower, sl.upper, sl.step)))
        else:
            idx = self.value(node.slice)
        if is_ir(idx):
            self.fail(node, f"cannot index the Python value {ast.unparse(node.value)} with an IR expression")
        try:
            return base[idx]
        except Exception as e:  # noqa: BLE001
            self.fail(node, f"error evaluating {ast.unparse(node)}: {e}")

    def expr_BinOp(self, node: ast.BinOp) -> Any:
        a, b = self.value(node.left), self.value(node.right)
        if not is_ir(a) and not is_ir(b):
            try:
                return _PYOPS[type(node.op)](a, b)
            except Exception as e:  # noqa: BLE001
                self.fail(node, f"error evaluating {ast.unparse(node)}: {e}")
        if isinstance(node.op, ast.Pow):
            return ir_pow(self.to_expr(a, node), self.to_expr(b, node))
        op = _BINOPS.get(type(node.op))
        if op is None:
            self.fail(node, f"unsupported operator {type(node.op).__name__} on IR values")
        try:
            return binop(op, self.to_expr(a, node.left), self.to_expr(b, node.right))
        except TypeError as e:
            self.fail(node, str(e))

    def expr_UnaryOp(self, node: ast.UnaryOp) -> Any:
        v = self.value(node.operand)
        if not is_ir(v):
            return {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_,
                    ast.Invert: operator.invert}[type(node.op)](v)
        e = self.to_expr(v, node)
        if isinstance(node.op, ast.USub):
            if isinstance(e, Const):
                return Const(-e.value, e.dtype, e.weak)
            return binop("-", Const(0, e.dtype), e)
        if isinstance(node.op, ast.UAdd):
            return e
        if isinstance(node.op, ast.Not):
            return Not(e)
        if isinstance(node.op, ast.Invert):
            if e.dtype == "bool":
                return Not(e)
            if dt.is_float(e.dtype):
                self.fail(node, f"~ needs an integer operand, got {e.dtype}")
            return binop("^", e, Const(-1, e.dtype))
        self.fail(node, "unsupported operator on IR values")

    def expr_BoolOp(self, node: ast.BoolOp) -> Any:
        op = "and" if isinstance(node.op, ast.And) else "or"
        vals = [self.value(v) for v in node.values]
        if not any(is_ir(v) for v in vals):
            res = vals[0]
            for v in vals[1:]:
                res = (res and v) if op == "and" else (res or v)
            return res
        exprs = [self.to_expr(v, node) for v in vals]
        out = exprs[0]
        for e in exprs[1:]:
            out = binop(op, out, e)
        return out

    def expr_Compare(self, node: ast.Compare) -> Any:
        left = self.value(node.left)
        result: Any = None
        for opn, comp in zip(node.ops, node.comparators):
            right = self.value(comp)
            if not is_ir(left) and not is_ir(right):
                r = _PYCMP[type(opn)](left, right)
            else:
                op = _CMPOPS.get(type(opn))
                if op is None:
                    self.fail(node, f"unsupported comparison {type(opn).__name__} on IR values")
                r = binop(op, self.to_expr(left, node), self.to_expr(right, node))
            if result is None:
                result = r
            elif is_ir(result) or is_ir(r):
                result = binop("and", as_expr(result), as_expr(r))
            else:
                result = result and r
            left = right
        return result

    def expr_IfExp(self, node: ast.IfExp) -> Any:
        c = self.value(node.test)
        if not is_ir(c):
            return self.value(node.body) if c else self.value(node.orelse)
        return ir_select(self.to_expr(c, node), self.to_expr(self.value(node.body), node),
                              self.to_expr(self.value(node.orelse), node))

    def expr_Call(self, node: ast.Call) -> Any:
        v = self.call_value(node)
        if isinstance(v, TensorType) and v.data is not None:
            return self.make_view(v, node)
        return v

    def make_view(self, tt: TensorType, node: ast.AST) -> Buffer:
        """A global buffer of another shape on a global tensor's storage (the runtime passes the reshaped
        tensor); views of views resolve to the underlying tensor."""
        base = tt.data.buffer
        root = next((b for v, b in self.shared.views if v is base), base)
        if root.scope != "global":
            self.fail(node, f"views are supported on global tensors only; {root.name} is a {root.scope} buffer")
        if tt.dtype != root.dtype:
            self.fail(node, f"a view of {root.name} must keep its dtype {root.dtype}, got {tt.dtype}")
        dims: list[Expr] = []
        for s in tt.shape:
            if isinstance(s, bool) or not isinstance(s, (int, Var)):
                self.fail(node, f"view shape entries must be ints or T.dynamic sizes, got {s!r}")
            dims.append(const(s) if isinstance(s, int) else s)
        view = Buffer(self.shared.fresh(f"{root.name}_view"), tuple(dims), tt.dtype, "global")
        a, b = view.static_shape(), root.static_shape()
        if a is not None and b is not None and int(np.prod(a)) != int(np.prod(b)):
            self.fail(node, f"view of {root.name}{b} with shape {a}: the element counts differ")
        self.shared.views.append((view, root))
        view.aliased = root.aliased = True  # backends must not assume these two parameters are disjoint
        return view

    def call_value(self, node: ast.Call) -> Any:
        fn = self.value(node.func)
        if getattr(fn, "__tl_stmt__", None):
            self.fail(node, f"T.{fn.__tl_stmt__} is a statement, not an expression")
        if isinstance(fn, Macro):
            self.fail(node, f"T.macro {fn.__name__} must be called as a statement")
        args = self.eval_args(node.args)
        kwargs = {k.arg: self.value(k.value) for k in node.keywords}
        if getattr(fn, "__tl_expr__", False):
            args = [self.to_expr(a, node) if isinstance(a, Buffer) else a for a in args]
            try:
                return fn(*args, **kwargs)
            except CompileError:
                raise
            except Exception as e:  # noqa: BLE001
                self.fail(node, f"{ast.unparse(node.func)}: {e}")
        if getattr(fn, "__tl_meta__", False):  # helpers that take buffers as they are (layouts)
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                self.fail(node, f"{ast.unparse(node.func)}: {e}")
        has_ir = any(is_ir(a) for a in [*args, *kwargs.values()])
        if fn in (builtins.max, builtins.min) and has_ir and len(args) >= 2 and not kwargs:
            out = self.to_expr(args[0], node)
            for a in args[1:]:
                out = binop(fn.__name__, out, self.to_expr(a, node))
            return out
        if fn in (builtins.float, builtins.int) and has_ir and len(args) == 1:
            return Cast(self.to_expr(args[0], node), "float32" if fn is builtins.float else "int32")
        if fn is builtins.abs and has_ir:
            e = self.to_expr(args[0], node)
            return Call("abs", [e], e.dtype)
        if has_ir:
            self.fail(node, f"unsupported call: {ast.unparse(node.func)} is not a tile-language function and cannot "
                            f"take IR values")
        if not callable(fn):
            self.fail(node, f"{ast.unparse(node.func)} is not callable")
        if isinstance(fn, types.ModuleType):
            self.fail(node, f"{ast.unparse(node.func)} is a module")
        try:
            return fn(*args, **kwargs)
        except CompileError:
            raise
        except Exception as e:  # noqa: BLE001
            self.fail(node, f"error evaluating {ast.unparse(node)}: {type(e).__name__}: {e}")



def fmt_shape(buf: Buffer) -> str:
    return "(" + ", ".join(str(s.value) if isinstance(s, Const) else getattr(s, "name", "?") for s in buf.shape) + ")"

