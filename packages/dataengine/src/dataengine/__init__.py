"""dataengine: TileStack's sparse data engine.

N:M weight sparsity (`sparsity`), sparse formats (`formats`), block-sparse attention masks
(`masks`), sparse-attention block selection for kvpool (`select`), sequence packing
(`packing`) and the data toolkit (`data`: sharded datasets, scoring, mixing, dedup, streaming).
"""

from .__about__ import __version__
from .formats import BSRMatrix, COOMatrix, CSRMatrix
from .masks import BlockMask
from .packing import PackedBatch, best_fit_decreasing, pack, packing_efficiency, padding_efficiency
from .select import quest_scores, select_blocks, topk_blocks
from .sparsity import CompressedNM, SparseLinear, compress, decompress, is_nm_sparse, nm_mask, prune

__all__ = [
    "__version__", "BSRMatrix", "BlockMask", "COOMatrix", "CSRMatrix", "CompressedNM", "PackedBatch", "SparseLinear",
    "best_fit_decreasing", "compress", "decompress", "is_nm_sparse", "nm_mask", "pack", "packing_efficiency",
    "padding_efficiency", "prune", "quest_scores", "select_blocks", "topk_blocks",
]
