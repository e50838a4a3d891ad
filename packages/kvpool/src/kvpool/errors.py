"""kvpool's exceptions (part of tilehal's single hierarchy)."""

from __future__ import annotations

from tilehal import ArgumentError, TileStackError


class PoolExhaustedError(TileStackError):
    """Not enough free device blocks for the request; the pool was left exactly as it was."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(message)


class InvariantError(TileStackError):
    """A debug-mode consistency check of the block manager failed (a kvpool bug)."""


class OutOfRangeError(ArgumentError, IndexError):
    """An index argument (layer, slot, block id) lies outside the pool."""


class UnknownSequenceError(TileStackError, KeyError):
    """A seq_id that is not registered with the pool."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SlotOwnershipError(ArgumentError):
    """A write aimed at slots that are not the writer's to change: a free or only-cached block, a block
    shared with other sequences, a sealed prefix-cache block, or another sequence's block."""
