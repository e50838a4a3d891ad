"""Global->shared tile copies of T.Pipelined through TMA (sm_90: cp.async.bulk.tensor + mbarrier).

A pipelined `T.copy` whose source is a kernel parameter (row-major, the tile's columns in its last
dim) and whose destination is a whole 2-D shared buffer is issued by one thread as TMA loads (one
per 128-byte swizzle atom column of the destination's layout) that complete on the stage's
mbarrier, instead of every thread issuing 16-byte cp.async copies with their address arithmetic.
The descriptor (a 2-D view: leading dims flattened into rows, which the value ranges must prove
the tile never leaves; the column dim is zero-filled past its end by the hardware) is built on
the host at launch (tilehal.tma.encode_tiled) and passed as a `__grid_constant__` parameter.
`T.copy(..., disable_tma=True)` keeps cp.async.

On by default on sm_90a; pass_configs {"tl.disable_tma_lower": True} (or {"cuda_tma": False}) keeps
cp.async. The stages' mbarriers live in the dynamic shared memory (codegen.plan_smem): as a static
`__shared__` array they made ptxas pad the static part to _tl_smem's 1 KiB alignment, so a kernel with
exactly 48 KiB of dynamic shared memory (no opt-in at launch) asked for 49 KiB and did not launch: the
two gemm variants that "failed with TMA only" on the H200 (2026-12-02) were those two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....ir.nodes import Const, Copy, Expr
from ..common import esize, log
from ..emit import Ref, TmaLoad, VerbatimExpr
from ..lower_thread import B, C, P

_SWIZZLE = {0: "none", 128: "128B", 64: "64B", 32: "32B"}


@dataclass(frozen=True)
class TmaSpec:
    """Host side of one TMA descriptor: which parameter, its dtype, the box (rows, cols) and swizzle."""

    param: int
    dtype: str
    box_rows: int
    box_cols: int
    swizzle: str

    def as_list(self) -> list:
        return [self.param, self.dtype, self.box_rows, self.box_cols, self.swizzle]


class TmaRules:
    def _tma_plan(self, c: Copy) -> dict | None:
        """How `c` is issued through TMA (None: it stays on cp.async, the reason logged at DEBUG)."""
        src, dst = c.src, c.dst
        sb, db = src.buffer, dst.buffer

        def no(why: str) -> None:
            log.debug("%s: T.copy %s -> %s on cp.async, not TMA: %s", c.loc, sb.name, db.name, why)
            return None

        if not self.hopper:
            return no("TMA is emitted for sm_90a with wgmma on (arch or tl.disable_wgmma)")
        if not self.use_tma:
            return no("pass_configs tl.disable_tma_lower (or cuda_tma=False)")
        if c.options.get("disable_tma"):
            return no("disable_tma=True")
        if sb not in self.func.params:
            return no("the source is not a kernel parameter")
        shape = db.static_shape()
        if shape is None or db.ndim != 2 or tuple(dst.extents) != shape or \
                not all(isinstance(x, Const) and int(x.value) == 0 for x in dst.starts):
            return no("the destination is not a whole 2-D shared buffer")
        rows, cols = shape
        rd, cd = src.matrix_dims()
        if cd != sb.ndim - 1 or rd != sb.ndim - 2 or src.extents[cd] != cols or src.extents[rd] != rows:
            return no("the tile is not the source's last two dims")
        if any(src.extents[d] != 1 for d in range(sb.ndim - 2)):
            return no("the tile spans more than two dims of the source")
        es = esize(sb.dtype)
        if sb.dtype != db.dtype or rows > 256:
            return no("types differ or more than 256 rows")
        last = sb.shape[-1]
        if not isinstance(last, Const) or (int(last.value) * es) % 16:
            return no("the source's row stride is not a known multiple of 16 bytes")
        # leading dims flattened into rows: the tile must provably stay inside each of them (a 2-D source
        # is zero-filled past either end by the hardware)
        if sb.ndim > 2:
            for d in range(sb.ndim - 1):
                iv, n = self.interval(src.starts[d]), sb.shape[d]
                if iv is None or not isinstance(n, Const) or iv[0] < 0 or iv[1] + src.extents[d] > int(n.value):
                    return no(f"dim {d} of the source is not provably in bounds (its rows are flattened)")
        swz = self.swizzled.get(db)
        row_bytes = cols * es
        if swz is None:
            if row_bytes % 16 or cols > 256:
                return no(f"{row_bytes}-byte rows")
            sw, box_cols, atoms = 0, cols, 1
        else:
            sh, mask, lv, atom = swz
            if atom:
                sw, box_cols, atoms = 128, atom, cols // atom
            elif row_bytes in (128, 64, 32) and (sh, mask) == {128: (0, 7), 64: (1, 3), 32: (2, 1)}[row_bytes]:
                sw, box_cols, atoms = row_bytes, cols, 1
            else:
                return no("its swizzle is not a TMA swizzle mode")
        if len(self.func.params) + len(self.func.dynamic_vars) + len(self.tma_specs) > 60:
            return no("too many kernel parameters")
        spec = TmaSpec(self.func.params.index(sb), sb.dtype, rows, box_cols, _SWIZZLE[sw])
        self.tma_specs.append(spec)
        self.tma_bufs.add(db)
        log.debug("%s: T.copy %s -> %s through TMA: box %dx%d, swizzle %s, %d load(s) per stage", c.loc, sb.name,
                  db.name, rows, box_cols, spec.swizzle, atoms)
        return {"index": len(self.tma_specs) - 1, "spec": spec, "atoms": atoms, "atom_elems": rows * box_cols,
                "bytes": rows * cols * es, "copy": c}

    def tma_issue(self, plan: dict, stage_off: str | Expr, bar: str | Expr) -> None:
        """The TMA loads of one pipelined copy into the stage at element offset `stage_off` (thread 0),
        completing on mbarrier `bar` (node expressions, or C text from the warp-specialized path)."""
        c: Copy = plan["copy"]
        src, dst = c.src, c.dst
        sb = src.buffer
        col0 = self.lower_expr(src.starts[-1])
        row = self.lower_expr(src.starts[0])
        for d in range(1, sb.ndim - 1):  # flattened leading dims (proven in bounds)
            row = P(B(B(P(row), "*", self.dim_x(sb.shape[d])), "+", P(self.lower_expr(src.starts[d]))))
        so = VerbatimExpr(stage_off) if isinstance(stage_off, str) else stage_off
        bar_x = VerbatimExpr(bar) if isinstance(bar, str) else bar
        mc = plan.get("multicast")  # (CTA mask, rows per CTA, this CTA's rank as C text): its share of the rows
        if mc is not None:
            row = B(P(row), "+", VerbatimExpr(f"{mc[2]} * {mc[1]}"))
            so = B(P(so), "+", VerbatimExpr(f"{mc[2]} * {mc[1] * plan['spec'].box_cols}"))
        for a in range(plan["atoms"]):
            col = B(P(col0), "+", C(a * plan["spec"].box_cols)) if a else col0
            dref = Ref(self.tbuf(dst.buffer), [B(P(so), "+", C(a * plan["atom_elems"]))])
            self.add(TmaLoad(dref, plan["index"], plan["spec"], self.tbuf(sb), int(sb.shape[-1].value), bar_x, col, row,
                             mc[0] if mc is not None else 0, loc=c.loc))


def tma_param_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view a TMA descriptor takes of a row-major tensor: (rows of all leading dims, columns)."""
    return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1, int(shape[-1])


__all__ = ["TmaRules", "TmaSpec", "tma_param_shape"]
