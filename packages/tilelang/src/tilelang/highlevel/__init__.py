"""High level: `@tile_kernel` on plain loop nests and `tensor_contract`, scheduled into tile programs."""

from .contract import tensor_contract
from .loopnest import TileKernel, tile_kernel

__all__ = ["TileKernel", "tensor_contract", "tile_kernel"]
