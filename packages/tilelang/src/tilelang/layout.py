"""Layout annotations (`T.annotate_layout`): recorded on buffers for GPU backends, no effect on CPU."""

from __future__ import annotations

from dataclasses import dataclass

from tilehal import ArgumentError

from .ir.nodes import Buffer


@dataclass(frozen=True)
class Layout:
    kind: str  # "swizzled", ...
    buffer_name: str
    params: tuple = ()


def make_swizzled_layout(buffer: Buffer) -> Layout:
    """The bank-conflict-free swizzled shared-memory layout TileLang uses for gemm operands."""
    if not isinstance(buffer, Buffer):
        raise ArgumentError(f"make_swizzled_layout: expected a buffer, got {type(buffer).__name__}")
    return Layout("swizzled", buffer.name, tuple(int(s.value) for s in buffer.shape))


make_swizzled_layout.__tl_meta__ = True  # the front end passes buffers through unchanged
