"""The CUDA lowering rules, one module per tile op (and one for T.Pipelined loops).

Each module holds a mixin of `KernelCodegen` methods (they share its emission state: lines,
layouts, pending barriers); `RULES` maps a tile-op class to the method that lowers it at the
uniform level of a kernel, so `KernelCodegen.stmt` looks the rule up instead of testing classes.
"""

from __future__ import annotations

from ....ir.nodes import AtomicAdd, Copy, CumSum, Fill, Gemm, Reduce
from .atomic import AtomicRules
from .copy import CopyRules
from .cumsum import CumSumRules
from .fill import FillRules
from .gemm import GemmRules
from .pipelined import PipelineRules
from .reduce import ReduceRules


def _atomic_uniform(cg, s: AtomicAdd) -> None:
    cg.atomic(s, uniform=True)


RULES = {
    Copy: CopyRules.copy,
    Fill: FillRules.fill,
    Gemm: GemmRules.gemm,
    Reduce: ReduceRules.reduce,
    CumSum: CumSumRules.cumsum,
    AtomicAdd: _atomic_uniform,
}

__all__ = ["RULES", "AtomicRules", "CopyRules", "CumSumRules", "FillRules", "GemmRules", "PipelineRules",
           "ReduceRules"]
