"""Tile IR -> thread-level IR (issue 14 item 2, step 2 of the plan in docs/tilelang.md).

The CUDA lowering (KernelCodegen in codegen.py and its per-op rules/) walks a T.Kernel once, with
its plans (layouts, swizzles, stages, barriers); `ThreadBuilder` here is what it builds with: a
thread-level program (ir/thread.py's nodes and the core statements on thread-level buffers)
instead of lines of text. backends/cuda/emit.py prints that program as the kernel body, and
backends/thread_interp.py runs it with the block's threads as numpy lanes, so the lowering is
checked against the tile interpreter on the CPU (tests/test_thread_lowering.py).

Rules still writing text go through `emit(line)` / `open(head)` / `close()`, which build
Verbatim / VerbatimBlock nodes (printed as written, refused by the interpreter); a rule lowered to
nodes appends them with `add(node)` / `begin()` ... `end()`. docs/tilelang.md lists which rules
are nodes.
"""

from __future__ import annotations

from ...ir.nodes import Seq, Stmt
from ...ir.thread import Scope
from .emit import Bare, Paren, Verbatim, VerbatimBlock


class ThreadBuilder:
    """Node-building state of the CUDA lowering (a mixin of KernelCodegen)."""

    def _builder_init(self) -> None:
        self._blocks: list[list[Stmt]] = [[]]
        self._heads: list[str | None] = []

    # ------------------------------------------------------------ building nodes

    def add(self, node: Stmt) -> None:
        self._blocks[-1].append(node)

    def begin(self) -> None:
        """Start collecting the body of a node; `end()` returns it."""
        self._blocks.append([])
        self._heads.append(None)

    def end(self) -> Seq:
        if self._heads.pop() is not None:
            raise RuntimeError("cuda lowering: end() closes an open() block")
        return Seq(self._blocks.pop())

    def body_root(self) -> Seq:
        """The kernel body built so far (the outermost block)."""
        if len(self._blocks) != 1:
            raise RuntimeError(f"cuda lowering: {len(self._blocks) - 1} blocks left open")
        return Seq(self._blocks[0])

    # ------------------------------------------------------------ text (rules not lowered to nodes yet)

    def emit(self, line: str) -> None:
        self.add(Verbatim(line))

    def open(self, head: str) -> None:
        self._blocks.append([])
        self._heads.append(head)

    def close(self) -> None:
        head = self._heads.pop()
        if head is None:
            raise RuntimeError("cuda lowering: close() ends a begin() block")
        body = Seq(self._blocks.pop())
        self.add(Scope(body) if head == "" else VerbatimBlock(head, body))

    # ------------------------------------------------------------ the C-spelling expressions ("cexpr" rules)

    def bare(self, e: Bare) -> str:
        code = self.binop(e)
        return code[1:-1] if code.startswith("(") and code.endswith(")") else code

    def paren(self, e: Paren) -> str:
        return f"({self.expr(e.value)})"


__all__ = ["ThreadBuilder"]
