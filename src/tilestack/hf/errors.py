"""Exceptions of tilestack.hf (part of tilehal's single TileStackError hierarchy)."""

from __future__ import annotations

from kvpool import PoolExhaustedError
from tilehal import TileStackError


class KVPoolCacheError(TileStackError):
    """A generation on kvpool cannot go on; the pool was left consistent."""


class UnsupportedModelError(KVPoolCacheError, TypeError):
    """The model's architecture is not one tilestack.hf can run on kvpool."""


class SequenceTooLongError(KVPoolCacheError, ValueError):
    """A sequence would hold more tokens than the pool (or the model's attention window) can."""


class CacheMismatchError(KVPoolCacheError, ValueError):
    """A forward's inputs do not match the sequences the cache holds (or another cache was passed)."""


__all__ = ["CacheMismatchError", "KVPoolCacheError", "PoolExhaustedError", "SequenceTooLongError",
           "UnsupportedModelError"]
