"""kvpool's exceptions (part of tilehal's single hierarchy)."""

from __future__ import annotations

from tilehal import TileStackError


class PoolExhaustedError(TileStackError):
    """Not enough free device blocks for the request; the pool was left exactly as it was."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(message)


class InvariantError(TileStackError):
    """A debug-mode consistency check of the block manager failed (a kvpool bug)."""
