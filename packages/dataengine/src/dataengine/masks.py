"""Block-sparse attention masks in the kv_num_blocks / kv_indices form.

For each (batch, head, query block), `kv_num_blocks[b, h, qb]` KV blocks are attended and
`kv_indices[b, h, qb, :n]` lists them in ascending order (the rest of the row is -1 padding).
A block is present when any (query, key) pair inside it is allowed, so partial blocks (the
diagonal of a causal mask) are included and the kernel applies the element mask inside them.
This is the layout FlexAttention's BlockMask and block-sparse FlashAttention kernels consume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tilehal import ArgumentError, ShapeError, check_choice, check_int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


MAX_INT = 2**31 - 1  # lengths, block sizes, batch and head counts: beyond int32 they are a mistake
MAX_ENTRIES = 2**32  # entries of one block matrix (or padded element mask) built here


def _int_arg(v: object, name: str, lo: int = 1) -> int:
    return check_int(v, name, lo=lo, hi=MAX_INT)


def _check_entries(what: str, *dims: int) -> None:
    n = 1
    for d in dims:
        n *= int(d)
    if n > MAX_ENTRIES:
        raise ArgumentError(f"{what}: expected at most 2**32 entries, got {' x '.join(str(int(d)) for d in dims)} = {n}")


def _tensor_arg(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    return x


@dataclass(frozen=True)
class BlockMask:
    kv_num_blocks: torch.Tensor  # int32 [B, H, Q_blocks]
    kv_indices: torch.Tensor  # int32 [B, H, Q_blocks, KV_blocks], ascending, -1 padded
    q_block_size: int
    kv_block_size: int
    q_len: int
    kv_len: int

    def __post_init__(self) -> None:
        for name in ("q_block_size", "kv_block_size"):
            _int_arg(getattr(self, name), name)
        for name in ("q_len", "kv_len"):
            _int_arg(getattr(self, name), name, lo=0)
        _tensor_arg(self.kv_num_blocks, "kv_num_blocks")
        _tensor_arg(self.kv_indices, "kv_indices")
        if self.kv_num_blocks.dim() != 3:
            raise ShapeError(f"kv_num_blocks: expected [B, H, Q_blocks], got shape {tuple(self.kv_num_blocks.shape)}")
        want = (*self.kv_num_blocks.shape, _ceil_div(self.kv_len, self.kv_block_size))
        if tuple(self.kv_indices.shape) != want:
            raise ShapeError(f"kv_indices: expected shape {want}, got {tuple(self.kv_indices.shape)}")
        if self.kv_num_blocks.shape[2] != _ceil_div(self.q_len, self.q_block_size):
            raise ShapeError(f"kv_num_blocks: expected {_ceil_div(self.q_len, self.q_block_size)} query blocks, "
                             f"got {self.kv_num_blocks.shape[2]}")

    # -- dense block matrix <-> compact form ---------------------------------------------------

    @classmethod
    def from_dense(cls, blocks: torch.Tensor, q_len: int, kv_len: int, q_block_size: int,
                   kv_block_size: int | None = None) -> BlockMask:
        """From a boolean block matrix [B, H, Q_blocks, KV_blocks] (or [B, Q_blocks, KV_blocks])."""
        kv_block_size = q_block_size if kv_block_size is None else kv_block_size
        _int_arg(q_block_size, "q_block_size")
        _int_arg(kv_block_size, "kv_block_size")
        _tensor_arg(blocks, "blocks")
        if blocks.dim() == 3:
            blocks = blocks.unsqueeze(1)
        if blocks.dim() != 4:
            raise ShapeError(f"blocks: expected [B, H, Q_blocks, KV_blocks], got shape {tuple(blocks.shape)}")
        if blocks.is_floating_point() or blocks.is_complex():
            raise ShapeError(f"blocks: expected a boolean (or integer 0/1) block matrix, got {blocks.dtype}")
        blocks = blocks.bool()
        nkv = blocks.shape[-1]
        num = blocks.sum(-1).to(torch.int32)
        # Present blocks first in ascending order: sort keys put absent blocks after every present one.
        key = torch.where(blocks, torch.arange(nkv, device=blocks.device), nkv + torch.arange(nkv, device=blocks.device))
        order = torch.sort(key, dim=-1).values
        idx = torch.where(order < nkv, order, -1).to(torch.int32)
        return cls(num.contiguous(), idx.contiguous(), q_block_size, kv_block_size, q_len, kv_len)

    def to_dense(self) -> torch.Tensor:
        """Boolean block matrix [B, H, Q_blocks, KV_blocks]."""
        nkv = self.kv_indices.shape[-1]
        valid = self.kv_indices >= 0
        dense = torch.zeros((*self.kv_indices.shape[:-1], nkv + 1), dtype=torch.bool, device=self.kv_indices.device)
        dense.scatter_(-1, torch.where(valid, self.kv_indices.long(), nkv), valid)
        return dense[..., :nkv]

    def to_dense_elements(self) -> torch.Tensor:
        """Element-level boolean mask [B, H, q_len, kv_len] implied by whole blocks (for tests)."""
        d = self.to_dense()
        d = d.repeat_interleave(self.q_block_size, dim=2)[:, :, : self.q_len]
        return d.repeat_interleave(self.kv_block_size, dim=3)[..., : self.kv_len]

    def _combine(self, other: BlockMask, op) -> BlockMask:
        if not isinstance(other, BlockMask):
            return NotImplemented
        same = (self.q_block_size, self.kv_block_size, self.q_len, self.kv_len) == (
            other.q_block_size, other.kv_block_size, other.q_len, other.kv_len)
        if not same:
            raise ShapeError("other: expected a BlockMask with the same block sizes and lengths "
                             f"{(self.q_block_size, self.kv_block_size, self.q_len, self.kv_len)}, got "
                             f"{(other.q_block_size, other.kv_block_size, other.q_len, other.kv_len)}")
        a, b = self.to_dense(), other.to_dense()
        a, b = torch.broadcast_tensors(a, b)  # a per-head mask combines with a head-broadcast one
        return BlockMask.from_dense(op(a, b), self.q_len, self.kv_len, self.q_block_size, self.kv_block_size)

    def __and__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, torch.logical_and)

    def __or__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, torch.logical_or)

    def sparsity(self) -> float:
        """Fraction of (query block, KV block) pairs skipped."""
        total = self.kv_indices.numel()
        return 1.0 - float(self.kv_num_blocks.sum()) / total if total else 0.0

    # -- builders ------------------------------------------------------------------------------

    @classmethod
    def from_element_mask(cls, allowed: torch.Tensor, q_block_size: int, kv_block_size: int | None = None) -> BlockMask:
        """Blocks holding any allowed pair of a boolean [B, H, q_len, kv_len] (or [B, q_len, kv_len]) mask."""
        kv_block_size = q_block_size if kv_block_size is None else kv_block_size
        q_block_size = _int_arg(q_block_size, "q_block_size")
        kv_block_size = _int_arg(kv_block_size, "kv_block_size")
        _tensor_arg(allowed, "allowed")
        if allowed.dim() == 3:
            allowed = allowed.unsqueeze(1)
        if allowed.dim() != 4:
            raise ShapeError(f"allowed: expected [B, H, q_len, kv_len] or [B, q_len, kv_len], got shape "
                             f"{tuple(allowed.shape)}")
        if allowed.is_floating_point() or allowed.is_complex():
            raise ShapeError(f"allowed: expected a boolean mask, got {allowed.dtype}")
        B, H, Lq, Lk = allowed.shape
        qb, kb = _ceil_div(Lq, q_block_size), _ceil_div(Lk, kv_block_size)
        _check_entries("q_block_size/kv_block_size (the padded mask)", B, H, qb * q_block_size, kb * kv_block_size)
        padded = torch.zeros(B, H, qb * q_block_size, kb * kv_block_size, dtype=torch.bool, device=allowed.device)
        padded[:, :, :Lq, :Lk] = allowed
        blocks = padded.reshape(B, H, qb, q_block_size, kb, kv_block_size).any(dim=(3, 5))
        return cls.from_dense(blocks, Lq, Lk, q_block_size, kv_block_size)

    @classmethod
    def causal(cls, q_len: int, kv_len: int | None = None, block_size: int = 128, batch: int = 1,
               heads: int = 1, device: str | torch.device = "cpu") -> BlockMask:
        """Causal mask, queries aligned to the end of the keys (decode/prefill-with-prefix convention)."""
        return cls.sliding_window(q_len, kv_len, None, block_size, batch, heads, device)

    @classmethod
    def sliding_window(cls, q_len: int, kv_len: int | None = None, window: int | None = 4096,
                       block_size: int = 128, batch: int = 1, heads: int = 1,
                       device: str | torch.device = "cpu") -> BlockMask:
        """Causal attention to the last `window` keys (window=None: plain causal).

        Query i (absolute position i + kv_len - q_len) sees key j when 0 <= pos_i - j < window.
        Built per block from interval arithmetic, never materializing the element mask.
        """
        q_len = _int_arg(q_len, "q_len", lo=0)
        kv_len = q_len if kv_len is None else _int_arg(kv_len, "kv_len", lo=0)
        block_size = _int_arg(block_size, "block_size")
        batch, heads = _int_arg(batch, "batch"), _int_arg(heads, "heads")
        if window is not None:
            window = _int_arg(window, "window")
        if kv_len < q_len:
            raise ShapeError(f"kv_len: expected >= q_len ({q_len}), got {kv_len}")
        qb, kb = _ceil_div(q_len, block_size), _ceil_div(kv_len, block_size)
        _check_entries("q_len/kv_len/block_size/batch/heads (the block matrix)", batch, heads, qb, kb)
        off = kv_len - q_len
        q_lo = torch.arange(qb, device=device) * block_size + off
        q_hi = torch.clamp(q_lo + block_size - 1, max=kv_len - 1)
        k_lo = torch.arange(kb, device=device) * block_size
        k_hi = torch.clamp(k_lo + block_size - 1, max=kv_len - 1)
        # Some pair (i in q block, j in k block) has j <= i  <=>  k_lo <= q_hi.
        blocks = k_lo[None, :] <= q_hi[:, None]
        if window is not None:
            # ... and i - j < window for some pair  <=>  q_lo - k_hi < window.
            blocks &= (q_lo[:, None] - k_hi[None, :]) < window
        blocks = blocks.expand(batch, heads, qb, kb)
        return cls.from_dense(blocks, q_len, kv_len, block_size, block_size)

    @classmethod
    def document(cls, cu_seqlens: torch.Tensor | Sequence[torch.Tensor], block_size: int = 128,
                 seq_len: int | None = None, causal: bool = False,
                 device: str | torch.device | None = None) -> BlockMask:
        """Attention within documents of a packed sequence.

        `cu_seqlens`: one int tensor [docs + 1] (batch of one) or a list of them (one per packed
        row). Tokens past the last boundary (row padding) attend nothing. `causal=True` also
        applies the causal mask inside each document.
        """
        block_size = _int_arg(block_size, "block_size")
        check_choice(causal, "causal", (False, True))
        if not isinstance(cu_seqlens, (torch.Tensor, list, tuple)):
            raise ArgumentError(f"cu_seqlens: expected an int tensor or a list of them, got {type(cu_seqlens).__name__}")
        rows = [cu_seqlens] if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if not rows:
            raise ArgumentError("cu_seqlens: expected at least one row, got an empty list")
        for i, r in enumerate(rows):
            if not isinstance(r, torch.Tensor) or r.dim() != 1 or r.numel() < 1 or r.is_floating_point() or \
                    r.dtype == torch.bool:
                raise ShapeError(f"cu_seqlens[{i}]: expected a 1-D integer tensor of boundaries, got "
                                 f"{getattr(r, 'dtype', type(r).__name__)} shape {tuple(getattr(r, 'shape', ()))}")
        if seq_len is not None:
            seq_len = _int_arg(seq_len, "seq_len", lo=0)
        lengths = [int(r[-1]) for r in rows]
        L = max(lengths) if seq_len is None else seq_len
        if max(lengths) > L:
            raise ShapeError(f"seq_len: expected >= the longest row ({max(lengths)}), got {L}")
        _check_entries("seq_len (the per-token document ids)", len(rows), L)
        dev = device if device is not None else rows[0].device
        doc = torch.full((len(rows), L), -1, dtype=torch.long, device=dev)
        for i, cu in enumerate(rows):
            cu = cu.to(dev).long()
            if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()):
                raise ArgumentError(f"cu_seqlens[{i}]: expected non-decreasing boundaries starting at 0, got {cu.tolist()}")
            counts = cu[1:] - cu[:-1]
            doc[i, : int(cu[-1])] = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts)
        return cls.from_doc_ids(doc, block_size, causal)

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor, block_size: int = 128, causal: bool = False) -> BlockMask:
        """Document mask from per-token document ids [B, L] (-1 = padding, attends nothing).

        Block level: query block qb and key block kb overlap when their document-id ranges share a
        document. Ids are non-decreasing along a row (packing order), so each block covers one
        contiguous id range and the test is interval overlap, O(blocks^2) not O(L^2).
        """
        block_size = _int_arg(block_size, "block_size")
        check_choice(causal, "causal", (False, True))
        _tensor_arg(doc_ids, "doc_ids")
        if doc_ids.dim() != 2:
            raise ShapeError(f"doc_ids: expected [batch, seq_len] (one row per packed sequence), got shape "
                             f"{tuple(doc_ids.shape)}")
        if doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool:
            raise ShapeError(f"doc_ids: expected integer document ids (-1 = padding), got {doc_ids.dtype}")
        doc_ids = doc_ids.long()
        if doc_ids.numel():
            if int(doc_ids.min()) < -1:
                raise ArgumentError(f"doc_ids: expected ids >= -1 (-1 = padding), got {int(doc_ids.min())}")
            # The interval test below needs ids non-decreasing along a row (packing order).
            run = torch.cummax(torch.where(doc_ids >= 0, doc_ids, -1), dim=1).values
            bad = (doc_ids >= 0) & (doc_ids < run)
            if bool(bad.any()):
                r, c = (int(x) for x in bad.nonzero()[0])
                raise ArgumentError(f"doc_ids: expected non-decreasing ids along each row (packing order), got "
                                    f"{int(doc_ids[r, c])} after {int(run[r, c])} at [{r}, {c}]")
        B, L = doc_ids.shape
        nb = _ceil_div(L, block_size)
        _check_entries("block_size (the padded rows)", B, nb * block_size)
        _check_entries("doc_ids (the block matrix)", B, nb, nb)
        pad = nb * block_size - L
        d = torch.nn.functional.pad(doc_ids, (0, pad), value=-1).reshape(B, nb, block_size)
        big = torch.iinfo(torch.long).max
        lo = torch.where(d >= 0, d, big).min(-1).values  # smallest real doc id in the block
        hi = d.max(-1).values  # largest (-1 when the block is all padding)
        has = hi >= 0
        overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
        overlap &= has[:, :, None] & has[:, None, :]
        if causal:
            overlap &= torch.tril(torch.ones(nb, nb, dtype=torch.bool, device=d.device))
        return cls.from_dense(overlap.unsqueeze(1), L, L, block_size, block_size)

    @classmethod
    def topk(cls, block_scores: torch.Tensor, k: int, q_len: int, kv_len: int, block_size: int = 128,
             kv_block_size: int | None = None) -> BlockMask:
        """Keep the k highest-scoring KV blocks per query block from scores [B, H, Q_blocks, KV_blocks].

        -inf scores mark blocks that may not be chosen (e.g. future blocks under causality).
        """
        _tensor_arg(block_scores, "block_scores")
        if block_scores.dim() != 4:
            raise ShapeError(f"block_scores: expected [B, H, Q_blocks, KV_blocks], got shape {tuple(block_scores.shape)}")
        k = _int_arg(k, "k")
        if block_scores.is_floating_point() and bool(torch.isnan(block_scores).any()):
            raise ArgumentError("block_scores: expected no NaN (use -inf for a block that may not be chosen), got "
                                f"{int(torch.isnan(block_scores).sum())} NaN scores")
        k = min(k, block_scores.shape[-1])
        top = torch.topk(block_scores.float(), k, dim=-1)
        chosen = torch.zeros(block_scores.shape, dtype=torch.bool, device=block_scores.device)
        chosen.scatter_(-1, top.indices, top.values > float("-inf"))
        return cls.from_dense(chosen, q_len, kv_len, block_size, kv_block_size)
