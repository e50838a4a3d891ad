"""The cpu target's ordered pass list, with why each pass runs where it does."""

from __future__ import annotations

from ...ir.verifier import verify
from ...passes.checks import check_shapes
from ...passes.dce import dce
from ...passes.simplify import simplify
from .elide_copies import elide_gemm_copies
from .fuse_parallel import fuse_parallel
from .guard_memory import check_local_accesses, guard_global_accesses
from .lower_tile_ops import lower_tile_ops
from .vectorize import vectorize_hints


def verify_lowered(func):
    """verify, allowing what lowering introduces (gemm operands read in place from global memory)."""
    return verify(func, allow_global_gemm=True)


PASSES = [
    (check_shapes, "reject malformed tile ops before anything is rewritten"),
    (simplify, "fold constants so bounds tests below are static where they can be"),
    (dce, "drop dead buffers and their writes"),
    (guard_global_accesses, "element loads/stores of global tensors stay in bounds (interpreter semantics, the "
                            "public TileLang default); before lowering, whose copies guard their own edge tiles"),
    (elide_gemm_copies, "before lowering: gemm may read in-bounds A tiles in place (caches do the staging)"),
    (lower_tile_ops, "tile ops except float gemm become loop nests (gemm stays a micro-kernel call)"),
    (simplify, "clean up the index arithmetic lowering introduced"),
    (fuse_parallel, "fuse adjacent T.Parallel nests: one pass over the tile instead of several"),
    (dce, "drop what fusion made dead"),
    (vectorize_hints, "last: mark innermost element loops for the C compiler's vectorizer"),
    (check_local_accesses, "after lowering and fusion: on-chip accesses not proved in bounds read zero / raise"),
    (verify_lowered, "the lowered IR is still well formed"),
]


def passes(options: dict) -> list:
    return [p for p, _ in PASSES]
