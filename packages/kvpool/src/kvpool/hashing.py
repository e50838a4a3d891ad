"""Chained content hashes of full blocks: hash(parent hash, token ids, extra key).

A block's hash identifies its whole prefix, so two sequences share a block only when every
earlier token (and the extra key: LoRA id, salt, ...) agrees too. blake2b keeps the digests
stable across processes (Python's `hash` is salted per process) and collisions negligible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import numpy as np
from tilehal import ArgumentError

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def extra_key_bytes(extra_key: Hashable | None) -> bytes:
    """Bytes mixed into every block hash; the repr must be stable (str, int, tuples of them)."""
    return b"" if extra_key is None else repr(extra_key).encode()


def hash_block(parent: BlockHash, token_bytes: bytes, extra: bytes) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(token_bytes)
    h.update(extra)
    return h.digest()


def as_token_array(tokens) -> np.ndarray:
    """Token ids as a 1-D int64 numpy array (list, numpy array or CPU/GPU torch tensor)."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().to("cpu").numpy()
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:  # ragged nesting
        raise ArgumentError(f"tokens: expected a 1-D sequence of token ids, got {type(tokens).__name__}: {e}") from None
    if arr.ndim != 1:
        raise ArgumentError(f"tokens: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ArgumentError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ArgumentError(f"tokens: expected ids below 2**63, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)
