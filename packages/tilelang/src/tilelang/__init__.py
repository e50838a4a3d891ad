"""tilelang: a tile-level kernel language and compiler (TileLang-style), part of TileStack.

    import tilelang
    import tilelang.language as T

    @tilelang.jit(out_idx=[-1])
    def matmul(M, N, K, block_M=64, block_N=64, block_K=32, dtype="float32"):
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
            ...
        return main

Or in the eager style of the public TileLang's current examples: the function body is the kernel
(`M, N = T.const("M, N")`, `A: T.Tensor((M, N), dtype)` in the body, `C = T.empty(...)`, `return C`).

Targets: "cpu" (C + OpenMP), "interp" (numpy reference), "cuda" (NVRTC).
"""

from . import autotuner, layout, profiler, testing, utils  # noqa: E402 - public submodules
from .__about__ import __version__
from .errors import CompileError, SourceLoc
from .highlevel import tensor_contract, tile_kernel
from .ir.nodes import PrimFunc
from .pass_config import PassConfigKey
from .profiler import Profiler, TensorSupplyType
from .runtime.autotune import AutoTuner, autotune
from .runtime.jit import jit
from .runtime.kernel import JITKernel, compile  # noqa: A004
from .utils.math import cdiv, next_power_of_2

__all__ = ["AutoTuner", "CompileError", "JITKernel", "PassConfigKey", "PrimFunc", "Profiler", "SourceLoc",
           "TensorSupplyType", "__version__", "autotune", "autotuner", "cdiv", "compile", "jit", "layout",
           "next_power_of_2", "profiler", "tensor_contract", "testing", "tile_kernel", "utils"]
