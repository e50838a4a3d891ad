"""Thread-level IR -> CUDA C++ text: the one printer of the CUDA backend's kernel bodies.

The CUDA lowering (codegen.py's KernelCodegen and its rules/, with the node-building primitives of
lower_thread.py) builds a thread-level program: ir/thread.py's nodes, the core statements (Let,
Store, If, For, Alloc, Seq) on thread-level buffers, and the C-spelling nodes below. This module
prints it; each statement class has a "cuda.emit" rule (emitter, stmt, indent), each expression is
printed by the codegen's expression emitter (`CExprEmitter` and the "cexpr" rules of the nodes
here), so the text is exactly what the codegen wrote before it built nodes (the snapshot gate,
tests/test_cuda_snapshot.py).

C-spelling nodes (their meaning is that of the node they spell; the thread interpreter runs them):
- `Bare(op, a, b)`: `a op b` without the parentheses a BinOp prints (index sums / products the
  codegen writes bare), `Paren(e)`: `(e)`.
- `Verbatim(text)` / `VerbatimBlock(head, body)`: CUDA text of a lowering rule that still writes
  strings (not yet nodes; docs/tilelang.md lists which). The interpreter refuses them, naming the
  text, so a kernel is executable on the thread interpreter exactly when none is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...ir.nodes import BinOp, Expr, Seq, Stmt, register_rules
from ...ir.thread import Scope

# ---------------------------------------------------------------- C-spelling nodes


@dataclass(eq=False)
class Bare(BinOp):
    """`a op b` printed without enclosing parentheses (a BinOp otherwise: same meaning)."""

    def rebuild(self, children: list[Expr]) -> Expr:
        return Bare(self.op, children[0], children[1], self.dtype)


@dataclass(eq=False)
class Paren(Expr):
    """`(e)`: the value of `e`."""

    value: Expr

    @property
    def dtype(self) -> str:
        return self.value.dtype

    def children(self) -> list[Expr]:
        return [self.value]

    def rebuild(self, children: list[Expr]) -> Expr:
        return Paren(children[0])


@dataclass(eq=False)
class Verbatim(Stmt):
    """One line of CUDA written as text by a rule not yet lowered to nodes."""

    text: str

    side_effects = True

    def rebuild(self, tr: Any) -> Stmt:
        return self


@dataclass(eq=False)
class VerbatimBlock(Stmt):
    """`head {` body `}` where the head is CUDA text (a loop or condition not yet lowered to nodes)."""

    head: str
    body: Stmt

    side_effects = True

    def children(self) -> list[Stmt]:
        return [self.body]

    def rebuild(self, tr: Any) -> Stmt:
        return VerbatimBlock(self.head, tr.stmt(self.body) or Seq([]), loc=self.loc)


# ---------------------------------------------------------------- the printer


class Emitter:
    """Prints statements through the "cuda.emit" table; `cx` prints expressions (the codegen, a
    CExprEmitter)."""

    def __init__(self, cx: Any) -> None:
        self.cx = cx
        self.lines: list[str] = []

    def line(self, ind: int, text: str) -> None:
        self.lines.append("  " * ind + text)

    def stmt(self, s: Stmt, ind: int) -> None:
        rule = s.rule("cuda.emit")
        if rule is None:
            raise TypeError(f"cuda emit: no rule for {type(s).__name__}")
        rule(self, s, ind)

    def block(self, head: str, body: Stmt, ind: int) -> None:
        self.line(ind, head + " {")
        self.stmt(body, ind + 1)
        self.line(ind, "}")


def emit_body(cx: Any, body: Stmt, ind: int = 1) -> list[str]:
    """The CUDA lines of a kernel body."""
    e = Emitter(cx)
    e.stmt(body, ind)
    return e.lines


def _seq(em: Emitter, s: Seq, ind: int) -> None:
    for c in s.body:
        em.stmt(c, ind)


register_rules("cuda.emit", {
    Seq: _seq,
    Verbatim: lambda em, s, ind: em.line(ind, s.text),
    VerbatimBlock: lambda em, s, ind: em.block(s.head, s.body, ind),
    Scope: lambda em, s, ind: em.block("", s.body, ind),
})


# the codegen's methods (lower_thread.ThreadBuilder) that print them
register_rules("cexpr", {Bare: "bare", Paren: "paren"})

__all__ = ["Bare", "Emitter", "Paren", "Verbatim", "VerbatimBlock", "emit_body"]
