"""kvpool: an engine-agnostic paged KV-cache manager with paged and sparse decode attention."""

from .__about__ import __version__
from .attention import paged_decode, paged_decode_reference, paged_prefill, paged_prefill_reference
from .errors import InvariantError, PoolExhaustedError
from .pool import KVPool, PoolStats

__all__ = [
    "__version__", "InvariantError", "KVPool", "PoolExhaustedError", "PoolStats", "paged_decode",
    "paged_decode_reference", "paged_prefill", "paged_prefill_reference",
]
