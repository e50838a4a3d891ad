"""Parse a `@T.prim_func` function's source into tile IR: the statements.

Expressions and meta-level Python are evaluated by `meta.MetaEvaluator`, tile-op calls are bound
by `tileops.TileOpBinder`; this module walks the statements (kernels, loops, `if`, assignments,
allocations, macros) and builds the PrimFunc. Every error names the user's file:line and code.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import CompileError
from ..ir import dtypes as dt
from ..ir.nodes import (
    Alloc,
    Buffer,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Let,
    Load,
    PrimFunc,
    Seq,
    Stmt,
    Store,
    Var,
    While,
    binop,
    const,
)
from ..ir.verifier import verify
from .meta import _BINOPS, _PYOPS, Macro, TensorType, _Stale, fmt_shape, is_ir
from .tileops import TileOpBinder

_UNSET = object()
_MAX_META_ITERATIONS = 100_000


class Parser(TileOpBinder):
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
            if isinstance(ann, str):
                self.fail(arg, f"parameter {arg.arg!r}: scalar parameters are not supported; use a T.Tensor((1,), "
                               f"{str(ann)!r}) or a closure value")
            if not isinstance(ann, TensorType):
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
        ws = list(self.shared.workspace)
        views = [v for v, _ in self.shared.views]
        func = PrimFunc(fdef.name, params + ws + views, body, dyn, self.loc(fdef), self.source, ws,
                        list(self.shared.views))
        verify(func)
        return func

    # ------------------------------------------------------------ statements

    def block(self, stmts: list[ast.stmt], bindings: dict[str, Any] | None = None, inline: bool = False) -> Seq:
        """Parse `stmts` in a new scope. `inline`: a meta-level block (unrolled loop body, `if` on a Python
        value) whose statements join the enclosing block, so its assignments stay visible after it, as in
        Python. Otherwise (an IR loop or `if`) a name of an enclosing scope reassigned inside cannot carry
        the new value out (a let is immutable): reading it after the block is a CompileError."""
        initial = dict(bindings or {})
        self.scopes.append(dict(initial))
        out: list[Stmt] = []
        try:
            for s in stmts:
                r = self.stmt(s)
                if isinstance(r, list):
                    out.extend(r)
                elif r is not None:
                    out.append(r)
        finally:
            scope = self.scopes.pop()
        if self.scopes:
            for name, value in scope.items():
                if name in initial and initial[name] is value:
                    continue
                if inline:
                    self.scopes[-1][name] = value
                elif self._local_lookup(name) is not None and stmts:
                    self.scopes[-1][name] = _Stale(name, self.loc(stmts[0]))
        return Seq(out)

    def stmt(self, node: ast.stmt) -> Stmt | list[Stmt] | None:
        method = getattr(self, f"stmt_{type(node).__name__}", None)
        if method is None:
            what = type(node).__name__.lower()
            self.fail(node, f"unsupported Python construct in a prim_func: `{what}` statement")
        try:
            return method(node)
        except RecursionError:  # the innermost statement catches it, with the stack already unwound
            self.fail(node, too_deep())

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
        if isinstance(fn, Macro):
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
        grid = [self.to_expr(a, call) for a in self.eval_args(call.args)]
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
        kept = {k: v for k, v in kw.items() if v is not None and v is not False}  # Kernel.attrs: backends report
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
        kernel = Kernel(grid, bvars, threads_t, Seq([]), dict(kept), loc=self.loc(node))
        self.shared.kernel = kernel
        try:
            kernel.body = self.block(node.body, dict(zip(names, bvars)))
        finally:
            self.shared.kernel = None
        return kernel

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
            if isinstance(seq, (list, tuple, range)) and not any(is_ir(x) for x in seq):
                return self.unrolled_meta_loop(node, seq)
            self.fail(it, "unsupported loop: iterate over T.Parallel/T.Pipelined/T.serial/T.unroll/T.grid/range "
                          "or a Python list")
        self._need_kernel(node, "a loop")
        args = self.eval_args(it.args)
        kw = {k.arg: self.value(k.value) for k in it.keywords}
        if kind in ("Parallel", "grid"):
            extents = [self.to_expr(a, it) for a in args]
            for k in kw:
                if k not in ("coalesced_width", "loop_layout"):
                    self.fail(it, f"T.{kind}: unknown keyword {k!r}")
            keep = {k: v for k, v in kw.items() if v is not None}  # kept in the IR; backends say what they ignore
            return self._nest(node, extents, "parallel" if kind == "Parallel" else "serial", keep)
        if kind == "Persistent":
            return self._persistent(node, args, kw)
        if kind == "Pipelined":
            ann = {}
            if "num_stages" in kw:
                ann["num_stages"] = int(kw.pop("num_stages"))
            for k in ("order", "stage", "group", "sync"):
                if kw.get(k) is not None:
                    ann[k] = kw[k]
                kw.pop(k, None)
            for k in kw:
                self.fail(it, f"T.Pipelined: unknown keyword {k!r}")
            return self._range_loop(node, args, "pipelined", ann)
        if kw:
            self.fail(it, f"T.{kind}/range: unexpected keywords {sorted(kw)}")
        loop_kind = {"range": "serial", "serial": "serial", "unroll": "unroll", "vectorized": "vectorized"}[kind]
        return self._range_loop(node, args, loop_kind, {})

    def _persistent(self, node: ast.For, args: list[Any], kw: dict[str, Any]) -> Stmt:
        """`for bx, by in T.Persistent([m_blocks, n_blocks], wave_size, index, group_size=8)`: a persistent block
        `index` of `wave_size` walks the tiles index, index + wave_size, ... in grouped order (group_size rows of
        tiles at a time, for cache reuse); a serial loop over waves with a bounds test, built here."""
        names = ["domain", "wave_size", "index", "group_size"]
        if len(args) > 4 or any(k not in names for k in kw):
            self.fail(node.iter, f"T.Persistent(domain, wave_size, index, group_size=8): bad arguments {args} {kw}")
        a = dict(zip(names, args)) | kw
        if "domain" not in a or "wave_size" not in a or "index" not in a:
            self.fail(node.iter, "T.Persistent needs domain, wave_size and index")
        domain = a["domain"]
        if not isinstance(domain, (list, tuple)) or not 1 <= len(domain) <= 2:
            self.fail(node.iter, f"T.Persistent: domain must be a list of 1 or 2 extents, got {domain!r}")
        g = a.get("group_size", 8)
        ext = [self.to_expr(d, node.iter) for d in domain]
        wave, index = self.to_expr(a["wave_size"], node.iter), self.to_expr(a["index"], node.iter)
        names_ = self._target_names(node, len(ext))
        total = ext[0] if len(ext) == 1 else binop("*", ext[0], ext[1])
        w = Var(self.shared.fresh("wave"))
        tile = Var(self.shared.fresh("tile"))
        lets: list[Stmt] = [Let(tile, binop("+", binop("*", w, wave), index), loc=self.loc(node))]
        if len(ext) == 1:
            coords = [tile]
        else:
            m_blocks, n_blocks = ext
            per_group = binop("*", self.to_expr(g, node.iter), n_blocks)
            first_m = binop("*", binop("//", tile, per_group), g)
            rows = binop("min", binop("-", m_blocks, first_m), g)
            coords = [binop("+", first_m, binop("%", binop("%", tile, per_group), rows)),
                      binop("//", binop("%", tile, per_group), rows)]
        bind: dict[str, Any] = {}
        for n, c in zip(names_, coords):
            v = Var(self.shared.fresh(n))
            if c is tile:
                bind[n] = tile
                continue
            lets.append(Let(v, c, loc=self.loc(node)))
            bind[n] = v
        inner = self.block(node.body, bind)
        guarded = If(binop("<", tile, total), Seq([*lets[1:], *inner.body]), None, loc=self.loc(node))
        waves = binop("//", binop("-", binop("+", total, wave), 1), wave)
        return For(w, const(0), waves, "serial", Seq([lets[0], guarded]), {}, loc=self.loc(node))

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
            s = self.block(node.body, bindings, inline=True)
            out.extend(s.body)
        return out

    def stmt_Assert(self, node: ast.Assert) -> None:
        """`assert` on meta-level values is checked while parsing (the public examples guard their options so)."""
        cond = self.value(node.test)
        if is_ir(cond):
            self.fail(node, "assert on an IR value is not supported (only meta-level conditions)")
        if not cond:
            msg = self.value(node.msg) if node.msg is not None else ast.unparse(node.test)
            self.fail(node, f"assertion failed: {msg}")
        return None

    def stmt_While(self, node: ast.While) -> Stmt | list[Stmt] | None:
        if node.orelse:
            self.fail(node, "unsupported Python construct: `while ... else`")
        cond = self.value(node.test)
        if not is_ir(cond):  # a meta-level loop: unrolled while its Python condition holds
            out: list[Stmt] = []
            for _ in range(_MAX_META_ITERATIONS):
                if not cond:
                    return out
                for st in node.body:  # in the enclosing scope, as Python runs it (`p *= 2` updates p)
                    r = self.stmt(st)
                    out.extend(r if isinstance(r, list) else [r] if r is not None else [])
                cond = self.value(node.test)
            self.fail(node, f"meta-level while loop ran {_MAX_META_ITERATIONS} times; is its condition ever false?")
        self._need_kernel(node, "a while loop")
        return While(self.to_expr(cond, node.test), self.block(node.body), loc=self.loc(node))

    def stmt_If(self, node: ast.If) -> Stmt | list[Stmt] | None:
        cond = self.value(node.test)
        if not is_ir(cond):
            chosen = node.body if cond else node.orelse
            return self.block(chosen, inline=True).body if chosen else None
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
            if is_ir(value) or not isinstance(value, (tuple, list)):
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
            if not is_ir(cur) and not is_ir(rhs):
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
            self.fail(sub, f"buffer {buf.name} has rank {buf.ndim} (shape {fmt_shape(buf)}) but is indexed "
                           f"with {len(idx)} index(es)")
        return idx

    def alloc_global(self, call: ast.Call, name: str) -> None:
        """`T.alloc_global(shape, dtype)` outside the kernels: a zero-filled global tensor that lives for one call
        (e.g. split results passed from one T.Kernel to the next); the runtime allocates it."""
        if self.shared.kernel is not None:
            self.fail(call, "T.alloc_global creates a global tensor: call it outside `with T.Kernel`")
        args = self.eval_args(call.args)
        kw = {k.arg: self.value(k.value) for k in call.keywords}
        shape = kw.pop("shape", args[0] if args else None)
        dtype = kw.pop("dtype", args[1] if len(args) > 1 else "float32")
        kw.pop("scope", None)
        if kw:
            self.fail(call, f"T.alloc_global: unknown keyword(s) {sorted(kw)}")
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (list, tuple)) or not shape or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            self.fail(call, f"T.alloc_global: shape must be a tuple of positive Python ints, got {shape!r}")
        try:
            dtype = dt.canonical(dtype)
        except TypeError as e:
            self.fail(call, f"T.alloc_global: {e}")
        buf = Buffer(self.shared.fresh(name), tuple(const(int(s)) for s in shape), dtype, "global")
        self.shared.workspace.append(buf)
        self.bind(name, buf)
        return None

    def alloc(self, call: ast.Call, scope: str, name: str) -> Stmt:
        if scope == "global":
            return self.alloc_global(call, name)
        self._need_kernel(call, f"T.alloc_{scope}")
        args = self.eval_args(call.args)
        kw = {k.arg: self.value(k.value) for k in call.keywords}
        init = None
        options: dict = {}
        if scope == "var":
            dtype = kw.pop("dtype", args[0] if args else None)
            init = kw.pop("init", args[1] if len(args) > 1 else None)
            shape: tuple = (1,)
        else:
            shape = kw.pop("shape", args[0] if args else None)
            dtype = kw.pop("dtype", args[1] if len(args) > 1 else "float32")
            scope_kw = kw.pop("scope", None)
            if scope_kw is not None:
                options["scope"] = scope_kw  # e.g. "shared.dyn": kept in the IR; backends say if ignored
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
        return Alloc(buf, init_e, options, loc=self.loc(call))

    def inline_macro(self, macro: Macro, call: ast.Call) -> list[Stmt]:
        sub = Parser(macro.func, self.shared)
        fdef = next(n for n in sub.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        args = self.eval_args(call.args)
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


def too_deep() -> str:
    return (f"expression nested too deeply to compile (over the Python recursion limit of {sys.getrecursionlimit()} "
            f"frames); split it into several assignments, e.g. partial sums in a loop")


def _is_zero(e: Expr) -> bool:
    return isinstance(e, Const) and e.value == 0


def parse_prim_func(func: Callable) -> PrimFunc:
    return Parser(func).parse_function()
