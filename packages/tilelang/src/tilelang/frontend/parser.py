"""Parse a `@T.prim_func` function's source into tile IR.

Meta-level Python (sizes, dtypes, closure values, `if` on Python values, loops over Python
lists) is evaluated here, in the function's own scope; everything that depends on tensors,
block indices or loop variables becomes IR. Every error names the user's file:line and code.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import itertools
import operator
import textwrap
import types
from collections.abc import Callable
from typing import Any, NoReturn

from .. import language as T
from ..errors import CompileError, SourceLoc
from ..ir import dtypes as dt
from ..ir.nodes import (
    Alloc,
    AtomicAdd,
    Buffer,
    Const,
    Copy,
    CumSum,
    Expr,
    Fill,
    For,
    Gemm,
    If,
    Kernel,
    Let,
    Load,
    Not,
    PrimFunc,
    Reduce,
    Region,
    Seq,
    Stmt,
    Store,
    Var,
    as_expr,
    binop,
    const,
)
from ..ir.verifier import verify
from .affine import constant_difference

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%"}
_PYOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
          ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor,
          ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_PYCMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
          ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not,
          ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_UNSET = object()


def _is_ir(v: Any) -> bool:
    return isinstance(v, (Expr, Buffer))


def _is_meta_number(v: Any) -> bool:
    return isinstance(v, (int, float, bool)) and not isinstance(v, Expr)


class _Shared:
    """State shared by a prim_func's parser and the parsers of the macros it inlines."""

    def __init__(self) -> None:
        self.names = itertools.count()
        self.kernel: Kernel | None = None
        self.used_names: set[str] = set()

    def fresh(self, base: str) -> str:
        name = base
        while name in self.used_names:
            name = f"{base}_{next(self.names)}"
        self.used_names.add(name)
        return name


class Parser:
    def __init__(self, func: Callable, shared: _Shared | None = None) -> None:
        self.func = func
        self.shared = shared or _Shared()
        try:
            lines, first = inspect.getsourcelines(func)
        except (OSError, TypeError) as e:
            raise CompileError(f"cannot read the source of {getattr(func, '__name__', func)!r}: {e}") from e
        self.source = textwrap.dedent("".join(lines))
        self.lines = self.source.splitlines()
        self.first_line = first
        self.filename = inspect.getsourcefile(func) or func.__code__.co_filename
        self.tree = ast.parse(self.source)
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
                return scope[name]
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

    # ------------------------------------------------------------ entry

    def parse_function(self) -> PrimFunc:
        fdef = next((n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
        if fdef is None:
            raise CompileError(f"{self.filename}: no function definition found in the source of {self.func!r}")
        params: list[Buffer] = []
        dyn: list[Var] = []
        for arg in fdef.args.args:
            if arg.annotation is None:
                self.fail(arg, f"parameter {arg.arg!r} needs a T.Tensor(shape, dtype) annotation")
            # annotations are evaluated when the def runs (their names need not be closure variables)
            ann = getattr(self.func, "__annotations__", {}).get(arg.arg, None)
            if ann is None or isinstance(ann, str):
                ann = self.value(arg.annotation)
            if isinstance(ann, (str, T.DTypeConst)):
                self.fail(arg, f"parameter {arg.arg!r}: scalar parameters are not supported; use a T.Tensor((1,), "
                               f"{str(ann)!r}) or a closure value")
            if not isinstance(ann, T.TensorType):
                self.fail(arg, f"parameter {arg.arg!r}: expected a T.Tensor(shape, dtype) annotation, got {ann!r}")
            shape = []
            for s in ann.shape:
                if isinstance(s, Var):
                    if s not in dyn:
                        dyn.append(s)
                    shape.append(s)
                elif isinstance(s, int):
                    shape.append(const(int(s)))
                elif isinstance(s, Expr):
                    self.fail(arg, f"parameter {arg.arg!r}: shape entries must be ints or T.dynamic vars, got {s}")
                else:
                    self.fail(arg, f"parameter {arg.arg!r}: bad shape entry {s!r}")
            self.shared.used_names.add(arg.arg)
            buf = Buffer(arg.arg, tuple(shape), ann.dtype, "global")
            params.append(buf)
            self.bind(arg.arg, buf)
        for v in dyn:
            self.shared.used_names.add(v.name)
        body = self.block(fdef.body)
        if not any(isinstance(s, Kernel) for s in (body.body if isinstance(body, Seq) else [body])):
            self.fail(fdef, "a prim_func body needs a `with T.Kernel(...)` block")
        func = PrimFunc(fdef.name, params, body, dyn, self.loc(fdef), self.source)
        verify(func)
        return func

    # ------------------------------------------------------------ statements

    def block(self, stmts: list[ast.stmt], bindings: dict[str, Any] | None = None) -> Seq:
        self.scopes.append(dict(bindings or {}))
        out: list[Stmt] = []
        try:
            for s in stmts:
                r = self.stmt(s)
                if isinstance(r, list):
                    out.extend(r)
                elif r is not None:
                    out.append(r)
        finally:
            self.scopes.pop()
        return Seq(out)

    def stmt(self, node: ast.stmt) -> Stmt | list[Stmt] | None:
        method = getattr(self, f"stmt_{type(node).__name__}", None)
        if method is None:
            what = type(node).__name__.lower()
            self.fail(node, f"unsupported Python construct in a prim_func: `{what}` statement")
        return method(node)

    def stmt_Pass(self, node: ast.Pass) -> None:
        return None

    def stmt_Return(self, node: ast.Return) -> NoReturn:
        self.fail(node, "unsupported Python construct: `return` (a prim_func writes its outputs into tensors)")

    def stmt_Expr(self, node: ast.Expr) -> Stmt | list[Stmt] | None:
        v = node.value
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return None  # docstring
        if not isinstance(v, ast.Call):
            self.fail(node, "expression statement has no effect; expected a call such as T.copy(...)")
        fn = self.value(v.func)
        name = getattr(fn, "__tl_stmt__", None)
        if isinstance(fn, T.Macro):
            return self.inline_macro(fn, v)
        if name is None or getattr(fn, "__tl_loop__", None) or getattr(fn, "__tl_alloc__", None) \
                or getattr(fn, "__tl_kernel__", False):
            self.fail(node, f"unsupported statement: call to {ast.unparse(v.func)} used as a statement")
        handler = getattr(self, f"op_{name}")
        return handler(v)

    def stmt_With(self, node: ast.With) -> Stmt:
        if len(node.items) != 1:
            self.fail(node, "`with` takes exactly one T.Kernel(...)")
        item = node.items[0]
        call = item.context_expr
        fn = self.value(call.func) if isinstance(call, ast.Call) else None
        if not getattr(fn, "__tl_kernel__", False):
            self.fail(node, "unsupported `with`: only `with T.Kernel(...) as ...` is supported")
        if self.shared.kernel is not None:
            self.fail(node, "nested T.Kernel blocks are not supported")
        grid = [self.to_expr(self.value(a), a) for a in call.args]
        if not 1 <= len(grid) <= 3:
            self.fail(node, f"T.Kernel takes 1 to 3 grid extents, got {len(grid)}")
        kw = {k.arg: self.value(k.value) for k in call.keywords}
        threads = kw.pop("threads", 128)
        threads_t = tuple(threads) if isinstance(threads, (list, tuple)) else (threads,)
        if not all(isinstance(t, int) for t in threads_t):
            self.fail(node, f"T.Kernel threads must be Python ints, got {threads!r}")
        for k in kw:
            if k not in ("prelude", "is_cpu"):
                self.fail(node, f"T.Kernel: unknown keyword {k!r}")
        tgt = item.optional_vars
        if tgt is None:
            names: list[str] = []
        elif isinstance(tgt, ast.Name):
            names = [tgt.id]
        elif isinstance(tgt, ast.Tuple) and all(isinstance(e, ast.Name) for e in tgt.elts):
            names = [e.id for e in tgt.elts]
        else:
            self.fail(node, "T.Kernel targets must be names: `as bx` or `as (bx, by)`")
        if names and len(names) != len(grid):
            self.fail(node, f"T.Kernel has {len(grid)} grid dimension(s) but binds {len(names)} name(s)")
        bvars = [Var(self.shared.fresh(n)) for n in names] or [Var(self.shared.fresh(f"b{i}")) for i in range(len(grid))]
        kernel = Kernel(grid, bvars, threads_t, Seq([]), loc=self.loc(node))
        self.shared.kernel = kernel
        try:
            kernel.body = self.block(node.body, dict(zip(names, bvars)))
        finally:
            self.shared.kernel = None
        return kernel

    def _need_kernel(self, node: ast.AST, what: str) -> Kernel:
        if self.shared.kernel is None:
            self.fail(node, f"{what} must be inside `with T.Kernel(...)`")
        return self.shared.kernel

    def stmt_For(self, node: ast.For) -> Stmt | list[Stmt]:
        if node.orelse:
            self.fail(node, "unsupported Python construct: `for ... else`")
        it = node.iter
        fn = self.value(it.func) if isinstance(it, ast.Call) else _UNSET
        kind = getattr(fn, "__tl_loop__", None) if fn is not _UNSET else None
        if fn is builtins.range:
            kind = "range"
        if kind is None:
            seq = self.value(it)
            if isinstance(seq, (list, tuple, range)) and not any(_is_ir(x) for x in seq):
                return self.unrolled_meta_loop(node, seq)
            self.fail(it, "unsupported loop: iterate over T.Parallel/T.Pipelined/T.serial/T.unroll/T.grid/range "
                          "or a Python list")
        self._need_kernel(node, "a loop")
        args = [self.value(a) for a in it.args]
        kw = {k.arg: self.value(k.value) for k in it.keywords}
        if kind in ("Parallel", "grid"):
            extents = [self.to_expr(a, it) for a in args]
            for k in kw:
                if k not in ("coalesced_width", "loop_layout"):
                    self.fail(it, f"T.{kind}: unknown keyword {k!r}")
            return self._nest(node, extents, "parallel" if kind == "Parallel" else "serial", {})
        if kind == "Pipelined":
            ann = {}
            if "num_stages" in kw:
                ann["num_stages"] = int(kw.pop("num_stages"))
            for k in ("order", "stage", "group", "sync"):
                kw.pop(k, None)
            for k in kw:
                self.fail(it, f"T.Pipelined: unknown keyword {k!r}")
            return self._range_loop(node, args, "pipelined", ann)
        if kw:
            self.fail(it, f"T.{kind}/range: unexpected keywords {sorted(kw)}")
        loop_kind = {"range": "serial", "serial": "serial", "unroll": "unroll", "vectorized": "vectorized"}[kind]
        return self._range_loop(node, args, loop_kind, {})

    def _target_names(self, node: ast.For, count: int) -> list[str]:
        t = node.target
        if isinstance(t, ast.Name):
            names = [t.id]
        elif isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts):
            names = [e.id for e in t.elts]
        else:
            self.fail(node, "loop targets must be names")
        if len(names) != count:
            self.fail(node, f"loop has {count} extent(s) but binds {len(names)} name(s)")
        return names

    def _nest(self, node: ast.For, extents: list[Expr], kind: str, ann: dict) -> Stmt:
        names = self._target_names(node, len(extents))
        vars_ = [Var(self.shared.fresh(n)) for n in names]
        body: Stmt = self.block(node.body, dict(zip(names, vars_)))
        for v, ext in reversed(list(zip(vars_, extents))):
            body = For(v, const(0), ext, kind, body, dict(ann), loc=self.loc(node))
        return body

    def _range_loop(self, node: ast.For, args: list[Any], kind: str, ann: dict) -> Stmt:
        if not 1 <= len(args) <= 3:
            self.fail(node.iter, f"loop range takes 1 to 3 arguments, got {len(args)}")
        names = self._target_names(node, 1)
        exprs = [self.to_expr(a, node.iter) for a in args]
        start, stop = (const(0), exprs[0]) if len(exprs) == 1 else (exprs[0], exprs[1])
        step = exprs[2] if len(exprs) == 3 else None
        if step is not None and not (isinstance(step, Const) and isinstance(step.value, int) and step.value > 0):
            self.fail(node.iter, f"loop step must be a positive Python int, got {args[2]!r}")
        var = Var(self.shared.fresh(names[0]))
        if step is None or step.value == 1:
            extent = stop if _is_zero(start) else binop("-", stop, start)
            body = self.block(node.body, {names[0]: binop("+", start, var) if not _is_zero(start) else var})
        else:
            extent = binop("//", binop("+", binop("-", stop, start), step.value - 1), step.value)
            body = self.block(node.body, {names[0]: binop("+", start, binop("*", var, step.value))})
        return For(var, const(0), extent, kind, body, ann, loc=self.loc(node))

    def unrolled_meta_loop(self, node: ast.For, seq: Any) -> list[Stmt]:
        out: list[Stmt] = []
        for item in seq:
            bindings = self.assign_target(node.target, item, bind_only=True)
            s = self.block(node.body, bindings)
            out.extend(s.body)
        return out

    def stmt_If(self, node: ast.If) -> Stmt | list[Stmt] | None:
        cond = self.value(node.test)
        if not _is_ir(cond):
            chosen = node.body if cond else node.orelse
            return self.block(chosen).body if chosen else None
        c = self.to_expr(cond, node.test)
        then = self.block(node.body)
        orelse = self.block(node.orelse) if node.orelse else None
        return If(c, then, orelse, loc=self.loc(node))

    def stmt_Assign(self, node: ast.Assign) -> Stmt | list[Stmt] | None:
        if len(node.targets) != 1:
            self.fail(node, "chained assignment (a = b = ...) is not supported")
        target = node.targets[0]
        if isinstance(node.value, ast.Call):
            fn = self.value(node.value.func)
            scope = getattr(fn, "__tl_alloc__", None)
            if scope is not None:
                if not isinstance(target, ast.Name):
                    self.fail(node, "assign an allocation to a single name")
                return self.alloc(node.value, scope, target.id)
        value = self.value(node.value)
        if isinstance(target, ast.Subscript):
            return self.store(target, value, node)
        out: list[Stmt] = []
        self.assign_target(target, value, out=out, node=node)
        return out

    def assign_target(self, target: ast.expr, value: Any, out: list[Stmt] | None = None, node: ast.AST | None = None,
                      bind_only: bool = False) -> dict[str, Any]:
        node = node or target
        if isinstance(target, (ast.Tuple, ast.List)):
            if _is_ir(value) or not isinstance(value, (tuple, list)):
                self.fail(node, "tuple assignment needs a Python tuple on the right")
            if len(value) != len(target.elts):
                self.fail(node, f"cannot unpack {len(value)} values into {len(target.elts)} names")
            res: dict[str, Any] = {}
            for t, v in zip(target.elts, value):
                res.update(self.assign_target(t, v, out, node, bind_only))
            return res
        if not isinstance(target, ast.Name):
            self.fail(node, f"unsupported assignment target {ast.unparse(target)}")
        name = target.id
        if bind_only:
            return {name: value}
        existing = self._local_lookup(name)
        if isinstance(existing, Buffer) and existing.scope == "var":
            out.append(Store(existing, [const(0)], self.to_expr(value, node), loc=self.loc(node)))
            return {}
        if isinstance(value, Expr) and not isinstance(value, (Const, Var)):
            var = Var(self.shared.fresh(name), value.dtype)
            out.append(Let(var, value, loc=self.loc(node)))
            value = var
        self.bind(name, value)
        return {name: value}

    def _local_lookup(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def stmt_AugAssign(self, node: ast.AugAssign) -> Stmt | list[Stmt]:
        op = _BINOPS.get(type(node.op))
        if isinstance(node.target, ast.Subscript):
            cur = self.value(node.target)
            if op is None:
                self.fail(node, f"unsupported augmented operator {type(node.op).__name__}")
            new = binop(op, self.to_expr(cur, node), self.to_expr(self.value(node.value), node))
            return self.store(node.target, new, node)
        if isinstance(node.target, ast.Name):
            cur = self.lookup(node.target.id, node)
            rhs = self.value(node.value)
            if isinstance(cur, Buffer) and cur.scope == "var":
                return Store(cur, [const(0)], binop(op, Load(cur, [const(0)]), self.to_expr(rhs, node)),
                             loc=self.loc(node))
            if not _is_ir(cur) and not _is_ir(rhs):
                self.bind(node.target.id, _PYOPS[type(node.op)](cur, rhs))
                return []
            out: list[Stmt] = []
            self.assign_target(node.target, binop(op, self.to_expr(cur, node), self.to_expr(rhs, node)), out, node)
            return out
        self.fail(node, f"unsupported assignment target {ast.unparse(node.target)}")

    def stmt_AnnAssign(self, node: ast.AnnAssign) -> Stmt | list[Stmt] | None:
        if node.value is None:
            return None
        return self.stmt_Assign(ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno,
                                           col_offset=node.col_offset))

    def store(self, target: ast.Subscript, value: Any, node: ast.AST) -> Stmt:
        buf = self.value(target.value)
        if not isinstance(buf, Buffer):
            self.fail(node, f"cannot assign into {ast.unparse(target.value)}: not a buffer")
        idx = self.indices(target, buf)
        return Store(buf, idx, self.to_expr(value, node), loc=self.loc(node))

    def indices(self, sub: ast.Subscript, buf: Buffer) -> list[Expr]:
        sl = sub.slice
        elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if any(isinstance(e, ast.Slice) for e in elts):
            self.fail(sub, f"slice of {buf.name} used as a scalar; slices are for tile ops such as T.copy")
        idx = [self.to_expr(self.value(e), e) for e in elts]
        if len(idx) != buf.ndim:
            self.fail(sub, f"buffer {buf.name} has rank {buf.ndim} (shape {_fmt_shape(buf)}) but is indexed "
                           f"with {len(idx)} index(es)")
        return idx

    def alloc(self, call: ast.Call, scope: str, name: str) -> Stmt:
        self._need_kernel(call, f"T.alloc_{scope}")
        args = [self.value(a) for a in call.args]
        kw = {k.arg: self.value(k.value) for k in call.keywords}
        init = None
        if scope == "var":
            dtype = kw.pop("dtype", args[0] if args else None)
            init = kw.pop("init", args[1] if len(args) > 1 else None)
            shape: tuple = (1,)
        else:
            shape = kw.pop("shape", args[0] if args else None)
            dtype = kw.pop("dtype", args[1] if len(args) > 1 else "float32")
            kw.pop("scope", None)
            if isinstance(shape, int):
                shape = (shape,)
            if not isinstance(shape, (list, tuple)) or not shape:
                self.fail(call, f"T.alloc_{scope}: expected a shape tuple, got {shape!r}")
            if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
                self.fail(call, f"T.alloc_{scope}: shape must be positive Python ints, got {tuple(shape)}")
        if kw:
            self.fail(call, f"T.alloc_{scope}: unknown keyword(s) {sorted(kw)}")
        try:
            dtype = dt.canonical(dtype)
        except TypeError as e:
            self.fail(call, f"T.alloc_{scope}: {e}")
        buf = Buffer(self.shared.fresh(name), tuple(const(int(s)) for s in shape), dtype, scope)
        self.bind(name, buf)
        init_e = self.to_expr(init, call) if init is not None else None
        return Alloc(buf, init_e, loc=self.loc(call))

    def inline_macro(self, macro: T.Macro, call: ast.Call) -> list[Stmt]:
        sub = Parser(macro.func, self.shared)
        fdef = next(n for n in sub.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        args = [self.value(a) for a in call.args]
        kwargs = {k.arg: self.value(k.value) for k in call.keywords}
        try:
            bound = inspect.signature(macro.func).bind(*args, **kwargs)
            bound.apply_defaults()
        except TypeError as e:
            self.fail(call, f"T.macro {macro.__name__}: {e}")
        try:
            return sub.block(fdef.body, dict(bound.arguments)).body
        except CompileError as e:
            raise CompileError(f"{e.message} (in T.macro {macro.__name__} called at {self.loc(call)})", e.loc) from None

    # ------------------------------------------------------------ tile ops

    def _args(self, call: ast.Call, names: list[str], defaults: dict[str, Any], what: str) -> dict[str, ast.AST | Any]:
        """Map positional/keyword AST args onto `names`; values for defaults stay Python values."""
        if len(call.args) > len(names):
            self.fail(call, f"T.{what} takes at most {len(names)} positional arguments, got {len(call.args)}")
        out: dict[str, Any] = dict(zip(names, call.args))
        for k in call.keywords:
            if k.arg not in names:
                self.fail(call, f"T.{what}: unknown keyword {k.arg!r}")
            out[k.arg] = k.value
        for n in names:
            if n not in out:
                if n not in defaults:
                    self.fail(call, f"T.{what}: missing argument {n!r}")
                out[n] = defaults[n]
        return out

    def _meta_arg(self, v: Any) -> Any:
        return self.value(v) if isinstance(v, ast.AST) else v

    def region_spec(self, node: ast.AST) -> tuple[Buffer, list[Expr], list[int | None]]:
        """(buffer, starts, extents) with None extents where only a start index was given."""
        if isinstance(node, ast.Subscript):
            buf = self.value(node.value)
            if not isinstance(buf, Buffer):
                self.fail(node, f"{ast.unparse(node.value)} is not a buffer")
            sl = node.slice
            elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
            if len(elts) != buf.ndim:
                self.fail(node, f"buffer {buf.name} has rank {buf.ndim} (shape {_fmt_shape(buf)}) but the tile "
                                f"{ast.unparse(node)} gives {len(elts)} index(es)")
            starts: list[Expr] = []
            extents: list[int | None] = []
            any_slice = any(isinstance(e, ast.Slice) for e in elts)
            for d, e in enumerate(elts):
                if isinstance(e, ast.Slice):
                    if e.step is not None:
                        self.fail(node, "strided slices are not supported in tile ops")
                    lo = self.to_expr(self.value(e.lower), e) if e.lower is not None else const(0)
                    hi = self.to_expr(self.value(e.upper), e) if e.upper is not None else buf.shape[d]
                    n = constant_difference(hi, lo)
                    if n is None:
                        self.fail(node, f"slice {ast.unparse(e)} of {buf.name}: extent must be a compile-time "
                                        f"constant")
                    if n <= 0:
                        self.fail(node, f"slice {ast.unparse(e)} of {buf.name} is empty (extent {n})")
                    starts.append(lo)
                    extents.append(n)
                else:
                    starts.append(self.to_expr(self.value(e), e))
                    extents.append(1 if any_slice else None)
            return buf, starts, extents
        v = self.value(node)
        if isinstance(v, Load):
            return v.buffer, list(v.indices), [None] * len(v.indices)
        if not isinstance(v, Buffer):
            self.fail(node, f"expected a buffer or a tile of one, got {ast.unparse(node)}")
        if v.static_shape() is None:
            self.fail(node, f"buffer {v.name} has a symbolic shape; pass a tile of it, e.g. {v.name}[i, j]")
        return v, [const(0)] * v.ndim, list(v.static_shape())

    def full_region(self, node: ast.AST, what: str) -> Region:
        buf, starts, ext = self.region_spec(node)
        if any(e is None for e in ext):
            # a start-only tile for gemm/fill: the rest of the buffer from that start
            shape = buf.static_shape()
            if shape is None:
                self.fail(node, f"T.{what}: give explicit slices for the symbolic-shaped buffer {buf.name}")
            ext = [1 if e is None and i < len(ext) - 2 else (e if e is not None else shape[i]) for i, e in
                   enumerate(ext)]
        return Region(buf, starts, [int(e) for e in ext], self.loc(node))

    def op_copy(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.copy")
        a = self._args(call, ["src", "dst", "coalesced_width", "disable_tma", "eviction_policy"],
                       {"coalesced_width": None, "disable_tma": False, "eviction_policy": None}, "copy")
        sb, ss, se = self.region_spec(a["src"])
        db, ds, de = self.region_spec(a["dst"])
        if any(e is None for e in se) and any(e is None for e in de):
            self.fail(call, "T.copy: at least one side must be a whole buffer or a sliced tile, so the tile shape is "
                            "known")
        if any(e is None for e in se):
            se = self._infer_extents(call, sb, se, de, "source")
        if any(e is None for e in de):
            de = self._infer_extents(call, db, de, se, "destination")
        src, dst = Region(sb, ss, se, self.loc(call)), Region(db, ds, de, self.loc(call))
        if src.squeezed() != dst.squeezed():
            self.fail(call, f"T.copy: shape mismatch: source {sb.name} tile {tuple(se)} vs destination {db.name} "
                            f"tile {tuple(de)}")
        return Copy(src, dst, loc=self.loc(call))

    def _infer_extents(self, call: ast.Call, buf: Buffer, ext: list[int | None], other: list[int], side: str) -> list[int]:
        r = len(ext)
        if r >= len(other):
            return [1] * (r - len(other)) + list(other)
        sq = [e for e in other if e != 1]
        if r >= len(sq):
            return [1] * (r - len(sq)) + sq
        self.fail(call, f"T.copy: wrong rank: {side} {buf.name} has rank {r} but the other side's tile has shape "
                        f"{tuple(other)}")

    def op_gemm(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.gemm")
        a = self._args(call, ["A", "B", "C", "transpose_A", "transpose_B", "policy", "clear_accum", "k_pack",
                              "wg_wait", "use_wgmma"],
                       {"transpose_A": False, "transpose_B": False, "policy": "Square", "clear_accum": False,
                        "k_pack": 1, "wg_wait": 0, "use_wgmma": None}, "gemm")
        A, B, C = (self.full_region(a[n], "gemm") for n in "ABC")
        ta, tb = bool(self._meta_arg(a["transpose_A"])), bool(self._meta_arg(a["transpose_B"]))
        clear = bool(self._meta_arg(a["clear_accum"]))
        policy = str(self._meta_arg(a["policy"]))
        sa, sb, sc = A.squeezed(), B.squeezed(), C.squeezed()
        for r, nm in ((sa, "A"), (sb, "B"), (sc, "C")):
            if len(r) > 2:
                self.fail(call, f"T.gemm: {nm} tile must be 2-D, got extents {tuple(r)}")
        sa, sb, sc = A.as_2d(), B.as_2d(), C.as_2d()
        M, K = (sa[1], sa[0]) if ta else (sa[0], sa[1])
        K2, N = (sb[1], sb[0]) if tb else (sb[0], sb[1])
        if K != K2 or tuple(sc) != (M, N):
            self.fail(call, f"T.gemm: shape mismatch: A {A.buffer.name}{tuple(sa)}{' (transposed)' if ta else ''} is "
                            f"{M}x{K}, B {B.buffer.name}{tuple(sb)}{' (transposed)' if tb else ''} is {K2}x{N}, "
                            f"C {C.buffer.name} is {tuple(sc)}; expected C to be {M}x{N} and both K equal")
        return Gemm(A, B, C, ta, tb, clear, policy, loc=self.loc(call))

    def op_clear(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.clear")
        a = self._args(call, ["buffer"], {}, "clear")
        r = self.full_region(a["buffer"], "clear")
        return Fill(r, const(0), loc=self.loc(call))

    def op_fill(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.fill")
        a = self._args(call, ["buffer", "value"], {}, "fill")
        r = self.full_region(a["buffer"], "fill")
        return Fill(r, self.to_expr(self.value(a["value"]), call), loc=self.loc(call))

    def _reduce(self, call: ast.Call, kind: str) -> Stmt:
        self._need_kernel(call, f"T.reduce_{kind}")
        a = self._args(call, ["buffer", "out", "dim", "clear"], {"dim": -1, "clear": True}, f"reduce_{kind}")
        src, dst = self.value(a["buffer"]), self.value(a["out"])
        for b, nm in ((src, "source"), (dst, "destination")):
            if not isinstance(b, Buffer) or b.scope == "global":
                self.fail(call, f"T.reduce_{kind}: {nm} must be a shared/fragment/local buffer")
        dim = int(self._meta_arg(a["dim"]))
        if dim < 0:
            dim += src.ndim
        if not 0 <= dim < src.ndim:
            self.fail(call, f"T.reduce_{kind}: dim {a['dim']!r} out of range for {src.name} of rank {src.ndim}")
        ss, ds = src.static_shape(), dst.static_shape()
        expect = ss[:dim] + ss[dim + 1:]
        if ds != expect and ds != ss[:dim] + (1,) + ss[dim + 1:] and not (expect == () and ds == (1,)):
            self.fail(call, f"T.reduce_{kind}: destination {dst.name} has shape {ds}, expected {expect} (source "
                            f"{src.name}{ss} reduced over dim {dim})")
        return Reduce(kind, src, dst, dim, bool(self._meta_arg(a["clear"])), loc=self.loc(call))

    def op_reduce_max(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "max")

    def op_reduce_min(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "min")

    def op_reduce_sum(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "sum")

    def op_reduce_abssum(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "abssum")

    def op_reduce_absmax(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "absmax")

    def op_cumsum(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.cumsum")
        a = self._args(call, ["src", "dst", "dim", "reverse"], {"dst": None, "dim": 0, "reverse": False}, "cumsum")
        src = self.value(a["src"])
        dst = self._meta_arg(a["dst"]) if a["dst"] is not None else src
        if not isinstance(src, Buffer) or not isinstance(dst, Buffer) or src.scope == "global" or dst.scope == "global":
            self.fail(call, "T.cumsum: src and dst must be shared/fragment/local buffers")
        if src.static_shape() != dst.static_shape():
            self.fail(call, f"T.cumsum: shape mismatch: {src.name}{src.static_shape()} vs {dst.name}"
                            f"{dst.static_shape()}")
        dim = int(self._meta_arg(a["dim"]))
        dim = dim + src.ndim if dim < 0 else dim
        if not 0 <= dim < src.ndim:
            self.fail(call, f"T.cumsum: dim {dim} out of range for rank {src.ndim}")
        return CumSum(src, dst, dim, bool(self._meta_arg(a["reverse"])), loc=self.loc(call))

    def op_atomic_add(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.atomic_add")
        a = self._args(call, ["dst", "value", "memory_order"], {"memory_order": None}, "atomic_add")
        vnode = a["value"]
        v = self.value(vnode)
        db, ds, de = self.region_spec(a["dst"])
        if isinstance(v, Buffer) and v.scope != "var" or isinstance(vnode, ast.Subscript) and any(
                isinstance(e, ast.Slice) for e in (vnode.slice.elts if isinstance(vnode.slice, ast.Tuple)
                                                   else [vnode.slice])):
            sb, ss, se = self.region_spec(vnode)
            if any(e is None for e in de):
                de = self._infer_extents(call, db, de, se, "destination")
            src = Region(sb, ss, [int(e) for e in se], self.loc(call))
            dst = Region(db, ds, [int(e) for e in de], self.loc(call))
            if src.squeezed() != dst.squeezed():
                self.fail(call, f"T.atomic_add: shape mismatch: {tuple(de)} vs {tuple(se)}")
            return AtomicAdd(dst, src, loc=self.loc(call))
        de = [1 if e is None else e for e in de]
        if any(e != 1 for e in de):
            self.fail(call, "T.atomic_add with a scalar value needs a single element destination, e.g. C[i, j]")
        return AtomicAdd(Region(db, ds, de, self.loc(call)), self.to_expr(v, call), loc=self.loc(call))

    def op_use_swizzle(self, call: ast.Call) -> None:
        k = self._need_kernel(call, "T.use_swizzle")
        a = self._args(call, ["panel_size", "order", "enable"], {"order": "row", "enable": True}, "use_swizzle")
        k.attrs["swizzle"] = (int(self._meta_arg(a["panel_size"])), str(self._meta_arg(a["order"])),
                              bool(self._meta_arg(a["enable"])))
        return None

    def op_annotate_layout(self, call: ast.Call) -> None:
        self._need_kernel(call, "T.annotate_layout")
        a = self._args(call, ["layout_map"], {}, "annotate_layout")
        m = self.value(a["layout_map"])
        if not isinstance(m, dict) or not all(isinstance(b, Buffer) for b in m):
            self.fail(call, "T.annotate_layout expects a dict {buffer: layout}")
        for b, layout in m.items():
            b.layout = layout
        return None

    # ------------------------------------------------------------ expressions

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
        if any(_is_ir(v) for n in ast.walk(node) if isinstance(n, ast.Name) for v in [env.get(n.id)]):
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
        if base is T:
            if not hasattr(T, attr) or attr.startswith("_"):
                self.fail(node, f"unknown name T.{attr} (not part of tilelang.language)")
            return getattr(T, attr)
        if isinstance(base, Buffer):
            if attr == "shape":
                return tuple(int(s.value) if isinstance(s, Const) else s for s in base.shape)
            if attr == "dtype":
                return base.dtype
            if attr == "ndim":
                return base.ndim
            if attr == "name":
                return base.name
            self.fail(node, f"buffer {base.name} has no attribute {attr!r} (supported: shape, dtype, ndim)")
        if isinstance(base, Expr):
            if attr == "dtype":
                return base.dtype
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
        if _is_ir(idx):
            self.fail(node, f"cannot index the Python value {ast.unparse(node.value)} with an IR expression")
        try:
            return base[idx]
        except Exception as e:  # noqa: BLE001
            self.fail(node, f"error evaluating {ast.unparse(node)}: {e}")

    def expr_BinOp(self, node: ast.BinOp) -> Any:
        a, b = self.value(node.left), self.value(node.right)
        if not _is_ir(a) and not _is_ir(b):
            try:
                return _PYOPS[type(node.op)](a, b)
            except Exception as e:  # noqa: BLE001
                self.fail(node, f"error evaluating {ast.unparse(node)}: {e}")
        if isinstance(node.op, ast.Pow):
            return T.pow(self.to_expr(a, node), self.to_expr(b, node))
        op = _BINOPS.get(type(node.op))
        if op is None:
            self.fail(node, f"unsupported operator {type(node.op).__name__} on IR values")
        return binop(op, self.to_expr(a, node.left), self.to_expr(b, node.right))

    def expr_UnaryOp(self, node: ast.UnaryOp) -> Any:
        v = self.value(node.operand)
        if not _is_ir(v):
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
        self.fail(node, "unsupported operator ~ on IR values")

    def expr_BoolOp(self, node: ast.BoolOp) -> Any:
        op = "and" if isinstance(node.op, ast.And) else "or"
        vals = [self.value(v) for v in node.values]
        if not any(_is_ir(v) for v in vals):
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
            if not _is_ir(left) and not _is_ir(right):
                r = _PYCMP[type(opn)](left, right)
            else:
                op = _CMPOPS.get(type(opn))
                if op is None:
                    self.fail(node, f"unsupported comparison {type(opn).__name__} on IR values")
                r = binop(op, self.to_expr(left, node), self.to_expr(right, node))
            if result is None:
                result = r
            elif _is_ir(result) or _is_ir(r):
                result = binop("and", as_expr(result), as_expr(r))
            else:
                result = result and r
            left = right
        return result

    def expr_IfExp(self, node: ast.IfExp) -> Any:
        c = self.value(node.test)
        if not _is_ir(c):
            return self.value(node.body) if c else self.value(node.orelse)
        return T.if_then_else(self.to_expr(c, node), self.to_expr(self.value(node.body), node),
                              self.to_expr(self.value(node.orelse), node))

    def expr_Call(self, node: ast.Call) -> Any:
        fn = self.value(node.func)
        if getattr(fn, "__tl_stmt__", None):
            self.fail(node, f"T.{fn.__tl_stmt__} is a statement, not an expression")
        if isinstance(fn, T.Macro):
            self.fail(node, f"T.macro {fn.__name__} must be called as a statement")
        args = [self.value(a) for a in node.args]
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
        has_ir = any(_is_ir(a) for a in [*args, *kwargs.values()])
        if fn in (builtins.max, builtins.min) and has_ir and len(args) >= 2 and not kwargs:
            out = self.to_expr(args[0], node)
            for a in args[1:]:
                out = binop(fn.__name__, out, self.to_expr(a, node))
            return out
        if fn in (builtins.float, builtins.int) and has_ir and len(args) == 1:
            return T.cast(self.to_expr(args[0], node), "float32" if fn is builtins.float else "int32")
        if fn is builtins.abs and has_ir:
            return T.abs(self.to_expr(args[0], node))
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


def _is_zero(e: Expr) -> bool:
    return isinstance(e, Const) and e.value == 0


def _fmt_shape(buf: Buffer) -> str:
    return "(" + ", ".join(str(s.value) if isinstance(s, Const) else getattr(s, "name", "?") for s in buf.shape) + ")"


def parse_prim_func(func: Callable) -> PrimFunc:
    return Parser(func).parse_function()
