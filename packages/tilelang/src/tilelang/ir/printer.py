"""Readable, TVMScript-like text for the tile IR (stable enough to diff in tests)."""

from __future__ import annotations

from .nodes import (
    Alloc,
    BinOp,
    Buffer,
    Call,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Let,
    Load,
    Not,
    PrimFunc,
    Region,
    Select,
    Seq,
    Stmt,
    Store,
    TileOp,
    Var,
    While,
    register_rules,
)
from .thread import (
    AsyncCommit,
    AsyncCopy,
    AsyncWait,
    Barrier,
    BreakIf,
    Intrinsic,
    RegBuffer,
    Scope,
    Shuffle,
    StridedFor,
    ThreadFor,
    ThreadIdx,
    Uniform,
)

_PREC = {"or": 1, "and": 2, "<": 4, "<=": 4, ">": 4, ">=": 4, "==": 4, "!=": 4, "+": 5, "-": 5, "*": 6, "/": 6,
         "//": 6, "%": 6, "|": 3, "^": 3, "&": 3, "<<": 4, ">>": 4}


def print_expr(e: Expr, prec: int = 0) -> str:
    rule = e.rule("print")
    return rule(e, prec) if rule is not None else f"<{type(e).__name__}>"


def _const(e: Const, prec: int) -> str:
    v = e.value
    if isinstance(v, float):
        if v == float("inf"):
            return f"T.infinity({e.dtype!r})"
        if v == float("-inf"):
            return f"-T.infinity({e.dtype!r})"
        return repr(v) if e.dtype == "float32" or e.weak else f"T.{e.dtype}({v!r})"
    if isinstance(v, bool):
        return repr(v)
    return str(v) if e.weak or e.dtype == "int32" else f"T.{e.dtype}({v})"


def _binop(e: BinOp, prec: int) -> str:
    if e.op in ("max", "min"):
        return f"T.{e.op}({print_expr(e.a)}, {print_expr(e.b)})"
    p = _PREC[e.op]
    text = f"{print_expr(e.a, p)} {e.op} {print_expr(e.b, p + 1)}"
    return f"({text})" if p < prec else text


register_rules("print", {
    Const: _const,
    Var: lambda e, prec: e.name,
    BinOp: _binop,
    Not: lambda e, prec: f"not {print_expr(e.a, 3)}",
    Call: lambda e, prec: f"T.{e.fn}({', '.join(print_expr(a) for a in e.args)})",
    Cast: lambda e, prec: f"T.cast({print_expr(e.value)}, {e.dtype!r})",
    Select: lambda e, prec: f"T.if_then_else({print_expr(e.cond)}, {print_expr(e.a)}, {print_expr(e.b)})",
    Load: lambda e, prec: f"{e.buffer.name}[{', '.join(print_expr(i) for i in e.indices)}]",
})


def print_region(r: Region) -> str:
    full = all(isinstance(s, Const) and s.value == 0 for s in r.starts) and r.buffer.static_shape() == tuple(r.extents)
    if full:
        return r.buffer.name
    parts = []
    for s, n in zip(r.starts, r.extents):
        st = print_expr(s)
        parts.append(st if n == 1 else f"{st}:{st} + {n}" if not (isinstance(s, Const) and s.value == 0) else f"0:{n}")
    return f"{r.buffer.name}[{', '.join(parts)}]"


def _shape(b: Buffer) -> str:
    dims = [print_expr(s) for s in b.shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"


def _block(lines: list[str], s: Stmt, ind: int) -> None:
    before = len(lines)
    _stmt(lines, s, ind)
    if len(lines) == before:
        lines.append("    " * ind + "pass")


def _seq(lines: list[str], s: Seq, ind: int) -> None:
    for c in s.body:
        _stmt(lines, c, ind)


def _kernel(lines: list[str], s: Kernel, ind: int) -> None:
    pad = "    " * ind
    grid = ", ".join(print_expr(g) for g in s.grid)
    names = ", ".join(v.name for v in s.block_vars)
    target = f"({names})" if len(s.block_vars) > 1 else names
    lines.append(f"{pad}with T.Kernel({grid}, threads={s.threads[0] if len(s.threads) == 1 else s.threads}) "
                 f"as {target}:")
    for k, v in s.attrs.items():
        lines.append(f"{pad}    # attr {k} = {v!r}")
    _block(lines, s.body, ind + 1)


def _alloc(lines: list[str], s: Alloc, ind: int) -> None:
    pad = "    " * ind
    b = s.buffer
    if b.scope == "var":
        init = f", init={print_expr(s.init)}" if s.init is not None else ""
        lines.append(f"{pad}{b.name} = T.alloc_var({b.dtype!r}{init})")
    else:
        extra = "".join(f", {k}={v!r}" for k, v in s.options.items())
        lines.append(f"{pad}{b.name} = T.alloc_{b.scope}({_shape(b)}, {b.dtype!r}{extra})")


_LOOP_NAMES = {"serial": "serial", "parallel": "Parallel", "pipelined": "Pipelined", "unroll": "unroll",
               "vectorized": "vectorized"}


def _for(lines: list[str], s: For, ind: int) -> None:
    pad = "    " * ind
    rng = print_expr(s.extent) if isinstance(s.start, Const) and s.start.value == 0 else \
        f"{print_expr(s.start)}, {print_expr(s.start)} + {print_expr(s.extent)}"
    extra = "".join(f", {k}={v!r}" for k, v in s.annotations.items())
    lines.append(f"{pad}for {s.var.name} in T.{_LOOP_NAMES[s.kind]}({rng}{extra}):")
    _block(lines, s.body, ind + 1)


def _let(lines: list[str], s: Let, ind: int) -> None:
    lines.append(f"{'    ' * ind}{s.var.name} = {print_expr(s.value)}")


def _store(lines: list[str], s: Store, ind: int) -> None:
    idx = ", ".join(print_expr(i) for i in s.indices)
    lines.append(f"{'    ' * ind}{s.buffer.name}[{idx}] = {print_expr(s.value)}")


def _if(lines: list[str], s: If, ind: int) -> None:
    pad = "    " * ind
    lines.append(f"{pad}if {print_expr(s.cond)}:")
    _block(lines, s.then, ind + 1)
    if s.orelse is not None:
        lines.append(f"{pad}else:")
        _block(lines, s.orelse, ind + 1)


def _while(lines: list[str], s: While, ind: int) -> None:
    lines.append(f"{'    ' * ind}while {print_expr(s.cond)}:")
    _block(lines, s.body, ind + 1)


def _tile_op(lines: list[str], s: TileOp, ind: int) -> None:
    lines.append("    " * ind + s.text(print_expr, print_region))


register_rules("print", {Seq: _seq, Kernel: _kernel, Alloc: _alloc, For: _for, Let: _let, Store: _store, If: _if,
                         While: _while, TileOp: _tile_op})


# ---------------------------------------------------------------- thread-level IR (ir/thread.py)


def _shuffle(e: Shuffle, prec: int) -> str:
    width = f", width={e.width}" if e.width != 32 else ""
    return f"T.shfl_{e.kind}({print_expr(e.value)}, {print_expr(e.lane)}{width})"


register_rules("print", {ThreadIdx: lambda e, prec: "T.get_thread_binding()", Shuffle: _shuffle})


def _element(b: Buffer, idx: list[Expr]) -> str:
    return f"{b.name}[{', '.join(print_expr(i) for i in idx)}]"


def _reg_buffer(lines: list[str], s: RegBuffer, ind: int) -> None:
    layout = f", layout={s.fragment!r}" if s.fragment is not None else ""
    lines.append(f"{'    ' * ind}{s.buffer.name} = T.alloc_reg({s.nregs}, {s.buffer.dtype!r}{layout})")


def _async_copy(lines: list[str], s: AsyncCopy, ind: int) -> None:
    pred = f", pred={print_expr(s.pred)}" if s.pred is not None else ""
    lines.append(f"{'    ' * ind}T.cp_async({_element(s.dst, s.dst_idx)}, {_element(s.src, s.src_idx)}, {s.n}{pred})")


def _intrinsic(lines: list[str], s: Intrinsic, ind: int) -> None:
    outs = ", ".join(_element(o.buffer, o.indices) for o in s.outs)
    args = "".join([f", {print_expr(i)}" for i in s.ins] + [f", {k}={v!r}" for k, v in s.attrs.items()])
    lines.append(f"{'    ' * ind}{outs + ' = ' if outs else ''}T.intrinsic({s.name!r}{args})")


def _thread_for(lines: list[str], s: ThreadFor, ind: int) -> None:
    lines.append(f"{'    ' * ind}for {s.var.name} in T.thread_for({s.trips}):")
    _block(lines, s.body, ind + 1)


def _uniform(lines: list[str], s: Uniform, ind: int) -> None:
    lines.append(f"{'    ' * ind}with T.uniform():")
    _block(lines, s.body, ind + 1)


def _scope(lines: list[str], s: Scope, ind: int) -> None:
    lines.append(f"{'    ' * ind}with T.scope():")
    _block(lines, s.body, ind + 1)


def _strided_for(lines: list[str], s: StridedFor, ind: int) -> None:
    lines.append(f"{'    ' * ind}for {s.var.name} in T.strided({print_expr(s.start)}, {print_expr(s.stop)}, {s.step}):")
    _block(lines, s.body, ind + 1)


register_rules("print", {
    Scope: _scope,
    StridedFor: _strided_for,
    BreakIf: lambda lines, s, ind: lines.append(f"{'    ' * ind}T.break_if({print_expr(s.cond)})"),
    RegBuffer: _reg_buffer,
    Barrier: lambda lines, s, ind: lines.append(f"{'    ' * ind}T.sync_threads()"),
    AsyncCopy: _async_copy,
    AsyncCommit: lambda lines, s, ind: lines.append(f"{'    ' * ind}T.cp_async_commit()"),
    AsyncWait: lambda lines, s, ind: lines.append(f"{'    ' * ind}T.cp_async_wait({s.n})"),
    Intrinsic: _intrinsic,
    ThreadFor: _thread_for,
    Uniform: _uniform,
})


def _stmt(lines: list[str], s: Stmt, ind: int) -> None:
    rule = s.rule("print")
    if rule is None:
        lines.append(f"{'    ' * ind}<{type(s).__name__}>")
    else:
        rule(lines, s, ind)


def print_stmt(s: Stmt, indent: int = 0) -> str:
    lines: list[str] = []
    _stmt(lines, s, indent)
    return "\n".join(lines)


def print_func(f: PrimFunc) -> str:
    params = ", ".join(f"{p.name}: T.Tensor({_shape(p)}, {p.dtype!r})" for p in f.params)
    lines = []
    for v in f.dynamic_vars:
        lines.append(f"{v.name} = T.dynamic({v.name!r})")
    lines += ["@T.prim_func", f"def {f.name}({params}):"]
    _block(lines, f.body, 1)
    return "\n".join(lines) + "\n"


PrimFunc.printer = print_func  # PrimFunc.script() (nodes does not import the printer)
