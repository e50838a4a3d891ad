"""tilelang: a tile-level kernel language and compiler (TileLang-style), part of TileStack.

    import tilelang
    import tilelang.language as T

    @tilelang.jit(out_idx=[-1])
    def matmul(M, N, K, block_M=64, block_N=64, block_K=32, dtype="float32"):
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
            ...
        return main

Targets: "cpu" (C + OpenMP), "interp" (numpy reference); "cuda" is planned.
"""

from . import layout
from .__about__ import __version__
from .errors import CompileError, SourceLoc
from .highlevel import tensor_contract, tile_kernel
from .ir.nodes import PrimFunc
from .runtime.autotune import AutoTuner, autotune
from .runtime.kernel import JITKernel, compile, jit  # noqa: A004
from .runtime.profiler import Profiler, TensorSupplyType

__all__ = ["AutoTuner", "CompileError", "JITKernel", "PrimFunc", "Profiler", "SourceLoc", "TensorSupplyType",
           "__version__", "autotune", "layout", "compile", "jit", "tensor_contract", "tile_kernel"]
