"""The CUDA lowering rules, one module per tile op (and one for T.Pipelined loops).

Each module holds a mixin of `KernelCodegen` methods (they share its emission state: lines,
layouts, pending barriers); `UNIFORM` / `IN_PARALLEL` map a tile-op class to the rule that lowers
it at the uniform level of a kernel / inside a T.Parallel loop. codegen.py registers them in the
op classes' "cuda" and "cuda.parallel" rule tables, so `KernelCodegen.stmt` looks rules up.
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
from .wgmma import WgmmaRules


def _uniform(name: str):
    """The rule of a tile op at the uniform level: a barrier first if it touches what earlier
    statements did, then `KernelCodegen.<name>` (looked up by name, so overrides apply)."""

    def rule(cg, s) -> None:
        cg.hazard(s)
        getattr(cg, name)(s)

    rule.__name__ = rule.__qualname__ = f"uniform_{name}"
    return rule


def _atomic_uniform(cg, s: AtomicAdd) -> None:
    cg.hazard(s)
    cg.atomic(s, uniform=True)


def _atomic_in_parallel(cg, s: AtomicAdd) -> None:
    cg.atomic(s, uniform=False)


# tile op -> rule(codegen, op), for the "cuda" table (uniform level) and "cuda.parallel" (inside T.Parallel)
UNIFORM = {
    Copy: _uniform("copy"),
    Fill: _uniform("fill"),
    Gemm: _uniform("gemm"),
    Reduce: _uniform("reduce"),
    CumSum: _uniform("cumsum"),
    AtomicAdd: _atomic_uniform,
}
IN_PARALLEL = {AtomicAdd: _atomic_in_parallel}

__all__ = ["IN_PARALLEL", "UNIFORM", "AtomicRules", "CopyRules", "CumSumRules", "FillRules", "GemmRules", "PipelineRules",
           "ReduceRules", "WgmmaRules"]
