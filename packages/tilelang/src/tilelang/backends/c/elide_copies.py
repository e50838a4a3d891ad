"""CPU only: let T.gemm read its A operand straight from global memory when the tile is in bounds.

On a GPU, staging A in shared memory is what makes the gemm fast; on a CPU that copy is pure
overhead (caches do the staging), and it costs 10-15% of a large GEMM. The micro-kernel takes any
strides for A (its elements are broadcast), so a full in-bounds tile is used in place. B keeps its
copy: its rows are read as vectors and, with power-of-two row strides, reading them in place
would thrash L1 sets. The copy still runs for edge tiles (partial tiles read zeros).

Applies when the shared buffer's only writer is one `T.copy` from a global tensor that the kernel
never writes, and its only reader is one later `T.gemm` (as A) in the same block.
"""

from __future__ import annotations

import logging

from ...ir.nodes import Const, Copy, For, Gemm, If, Kernel, PrimFunc, Region, Seq, Stmt, binop
from ...ir.visit import buffers_read, buffers_written, map_stmt, walk_stmts
from ...passes.simplify import simplify_expr

log = logging.getLogger("tilelang.passes.elide_copies")


def _full(r: Region) -> bool:
    shape = r.buffer.static_shape()
    return shape is not None and tuple(r.extents) == shape and all(isinstance(s, Const) and s.value == 0
                                                                    for s in r.starts)


def _in_bounds(r: Region):
    cond = Const(True, "bool")
    for s, n, size in zip(r.starts, r.extents, r.buffer.shape):
        cond = binop("and", cond, binop("and", binop(">=", s, 0), binop("<=", binop("+", s, n), size)))
    return simplify_expr(cond)


def _uses(kernel: Kernel, buf) -> tuple[list[Stmt], list[Stmt]]:
    writers, readers = [], []
    for s in walk_stmts(kernel.body):
        if isinstance(s, (Seq, If)) or isinstance(s, Kernel):
            continue
        if buf in buffers_written(s) and not hasattr(s, "body"):
            writers.append(s)
        if buf in buffers_read(s) and not hasattr(s, "body"):
            readers.append(s)
    return writers, readers


def _elide_in_kernel(kernel: Kernel) -> Kernel:
    written_globals = {b for b in buffers_written(kernel.body) if b.scope == "global"}

    def visit(s: Stmt) -> Stmt:
        if not isinstance(s, Seq):
            return s
        body = list(s.body)
        for i, c in enumerate(body):
            if not (isinstance(c, Copy) and c.src.buffer.scope == "global" and c.dst.buffer.scope == "shared"
                    and _full(c.dst) and c.src.buffer not in written_globals
                    and c.src.squeezed() == list(c.dst.buffer.static_shape())
                    # in place only when the copy converts nothing: float32 in both (16/8-bit floats are raw
                    # bits in global memory but float in shared)
                    and c.src.buffer.dtype == c.dst.buffer.dtype == "float32"):
                continue
            shared = c.dst.buffer
            writers, readers = _uses(kernel, shared)
            gemms = [j for j in range(i + 1, len(body)) if isinstance(body[j], Gemm) and body[j].A.buffer is shared]
            if writers != [c] or len(readers) != 1 or len(gemms) != 1 or readers[0] is not body[gemms[0]]:
                continue
            j = gemms[0]
            g = body[j]
            if not _full(g.A) or g.B.buffer is shared or g.C.buffer is shared:
                continue
            direct = Gemm(Region(c.src.buffer, list(c.src.starts), list(c.src.extents), c.src.loc), g.B, g.C,
                          g.transpose_A, g.transpose_B, g.clear_accum, g.policy, dict(g.options), loc=g.loc)
            staged = Seq([c, g])
            body[j] = If(_in_bounds(c.src), direct, staged, loc=g.loc)
            body[i] = Seq([])
            log.debug("%s: T.gemm reads %s in place (copy into %s kept for edge tiles)", g.loc, c.src.buffer.name,
                      shared.name)
        return Seq([b for b in body if not (isinstance(b, Seq) and not b.body)], loc=s.loc)

    def walk(s: Stmt) -> Stmt:
        # rebuild containers only: leaf statements keep their identity, which _uses compares against
        if isinstance(s, Seq):
            return visit(Seq([walk(c) for c in s.body], loc=s.loc))
        if isinstance(s, For):
            return For(s.var, s.start, s.extent, s.kind, walk(s.body), dict(s.annotations), loc=s.loc)
        if isinstance(s, If):
            return If(s.cond, walk(s.then), walk(s.orelse) if s.orelse is not None else None, loc=s.loc)
        return s

    return Kernel(kernel.grid, kernel.block_vars, kernel.threads, walk(kernel.body), dict(kernel.attrs),
                  loc=kernel.loc)


def elide_gemm_copies(func: PrimFunc) -> PrimFunc:
    def visit(s: Stmt) -> Stmt:
        return _elide_in_kernel(s) if isinstance(s, Kernel) else s

    body = map_stmt(func.body, visit) or Seq([])
    return PrimFunc(func.name, func.params, body, func.dynamic_vars, func.loc, func.source)
