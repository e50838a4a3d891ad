"""Sequence packing: variable-length samples into fixed-length rows by best-fit-decreasing.

Best-fit-decreasing places samples longest first into the open row whose free space is the
smallest that still fits, opening a row only when none fits; it stays within 11/9 OPT + 6/9 rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tilehal import ArgumentError, ShapeError, check_choice, check_int

from .masks import BlockMask

_INT64_MAX = np.iinfo(np.int64).max


def token_array(x, name: str) -> np.ndarray:
    """`x` (list, numpy array or tensor) as a 1-D int64 array of token ids; float ids (which would be
    truncated, NaN becoming 0 or -2**63), bools, ragged lists and ids past int64 raise, naming `name`."""
    try:
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{name}: expected a 1-D sequence of integer token ids, got {type(x).__name__}: {e}") from None
    if arr.ndim != 1:
        raise ShapeError(f"{name}: expected a 1-D token sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ArgumentError(f"{name}: expected integer token ids, got dtype {arr.dtype}"
                            + (" (float ids would be truncated; NaN has no id)" if arr.dtype.kind == "f" else ""))
    if arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise ArgumentError(f"{name}: expected ids below 2**63, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)

Overlong = Literal["error", "truncate", "split"]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose sums never exceed `capacity`."""
    capacity = check_int(capacity, "capacity", lo=1)
    lens = token_array(lengths, "lengths")
    if lens.size and (lens.min() < 0 or lens.max() > capacity):
        bad = int(np.flatnonzero((lens < 0) | (lens > capacity))[0])
        raise ArgumentError(f"lengths[{bad}]: expected 0..{capacity} (row length), got {int(lens[bad])}")
    order = np.argsort(-lens, kind="stable")
    free: list[int] = []  # free space of open bins, ascending
    owner: list[int] = []  # bin id at the same position as `free`
    bins: list[list[int]] = []
    for i in order.tolist():
        need = int(lens[i])
        j = bisect.bisect_left(free, need)  # tightest bin that fits
        if j == len(free):
            b = len(bins)
            bins.append([i])
            left = capacity - need
        else:
            b = owner.pop(j)
            left = free.pop(j) - need
            bins[b].append(i)
        k = bisect.bisect_left(free, left)
        free.insert(k, left)
        owner.insert(k, b)
    return bins


@dataclass(frozen=True)
class PackedBatch:
    """Rows of packed samples.

    tokens, position_ids, doc_ids: [rows, row_len] (position ids restart at 0 in every sample;
    doc_ids number the samples of a row from 0, -1 on padding). cu_seqlens: one int32 tensor per
    row with the sample boundaries. cu_seqlens_flat: boundaries over tokens.reshape(-1), with each
    row's padding tail as its own segment, the varlen layout flash-attention kernels take.
    samples[r]: (sample index, start offset within that sample) for each piece in row r.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    cu_seqlens: list[torch.Tensor]
    cu_seqlens_flat: torch.Tensor
    max_seqlen: int
    samples: list[list[tuple[int, int]]]

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    @property
    def efficiency(self) -> float:
        """Real tokens / slots."""
        return self.num_tokens / self.tokens.numel() if self.tokens.numel() else 1.0

    def block_mask(self, block_size: int = 128, causal: bool = True) -> BlockMask:
        """Document (and by default causal) block mask over the rows."""
        return BlockMask.from_doc_ids(self.doc_ids, block_size, causal)


def _pieces(samples: Sequence, row_len: int, overlong: Overlong) -> list[tuple[int, int, np.ndarray]]:
    out = []
    for i, s in enumerate(samples):
        arr = token_array(s, f"samples[{i}]")
        if len(arr) <= row_len:
            out.append((i, 0, arr))
        elif overlong == "truncate":
            out.append((i, 0, arr[:row_len]))
        elif overlong == "split":
            out.extend((i, off, arr[off:off + row_len]) for off in range(0, len(arr), row_len))
        else:
            raise ArgumentError(f"samples[{i}]: expected at most row_len={row_len} tokens, got {len(arr)} "
                             "(pass overlong='truncate' or 'split')")
    return out


def pack(samples: Sequence, row_len: int, pad_id: int = 0, overlong: Overlong = "error") -> PackedBatch:
    """Pack token sequences into rows of `row_len` by best-fit-decreasing; no token is lost."""
    check_choice(overlong, "overlong", ("error", "truncate", "split"))
    row_len = check_int(row_len, "row_len", lo=1, hi=2**31 - 1)
    pad_id = check_int(pad_id, "pad_id", lo=-(2**63), hi=_INT64_MAX)
    if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
        raise ArgumentError(f"samples: expected a sequence of token sequences, got {type(samples).__name__}")
    pieces = _pieces(samples, row_len, overlong)
    bins = best_fit_decreasing([len(p[2]) for p in pieces], row_len)
    R = len(bins)
    try:
        tokens = np.full((R, row_len), pad_id, dtype=np.int64)
        pos = np.zeros((R, row_len), dtype=np.int64)
        doc = np.full((R, row_len), -1, dtype=np.int64)
    except MemoryError:
        raise ArgumentError(f"row_len: expected rows that fit in memory, got {R} rows of {row_len} tokens "
                            f"({3 * 8 * R * row_len} bytes)") from None
    cu_rows: list[torch.Tensor] = []
    flat = [0]
    placed: list[list[tuple[int, int]]] = []
    for r, members in enumerate(bins):
        members = sorted(members)  # keep the caller's order inside a row
        at = 0
        bounds = [0]
        row_samples = []
        for d, p in enumerate(members):
            idx, off, arr = pieces[p]
            n = len(arr)
            tokens[r, at:at + n] = arr
            pos[r, at:at + n] = np.arange(n)
            doc[r, at:at + n] = d
            at += n
            bounds.append(at)
            row_samples.append((idx, off))
        cu_rows.append(torch.tensor(bounds, dtype=torch.int32))
        base = r * row_len
        flat.extend(base + b for b in bounds[1:] if b > 0)
        if at < row_len:
            flat.append(base + row_len)
        placed.append(row_samples)
    seg = np.diff(np.asarray(flat))
    return PackedBatch(tokens=torch.from_numpy(tokens), position_ids=torch.from_numpy(pos),
                       doc_ids=torch.from_numpy(doc), cu_seqlens=cu_rows,
                       cu_seqlens_flat=torch.tensor(flat, dtype=torch.int32),
                       max_seqlen=int(seg.max()) if seg.size else 0, samples=placed)


def packing_efficiency(lengths: Sequence[int], row_len: int) -> float:
    """Fraction of slots holding real tokens when packing `lengths` (truncated to row_len) by BFD."""
    row_len = check_int(row_len, "row_len", lo=1)
    lens = token_array(lengths, "lengths")
    if lens.size and lens.min() < 0:
        raise ArgumentError(f"lengths: expected lengths >= 0, got {int(lens.min())}")
    lens = np.minimum(lens, row_len)
    bins = best_fit_decreasing(lens, row_len)
    return float(lens.sum()) / (len(bins) * row_len) if bins else 1.0


def padding_efficiency(lengths: Sequence[int], row_len: int | None = None, batch_size: int | None = None) -> float:
    """Baseline: one sample per row, padded to `row_len` or (with batch_size) to each batch's longest."""
    lens = token_array(lengths, "lengths")
    if lens.size and lens.min() < 0:
        raise ArgumentError(f"lengths: expected lengths >= 0, got {int(lens.min())}")
    if row_len is not None:
        row_len = check_int(row_len, "row_len", lo=1)
    if batch_size is not None:
        batch_size = check_int(batch_size, "batch_size", lo=1)
    if lens.size == 0:
        return 1.0
    if batch_size is None:
        if row_len is None:
            raise ArgumentError("row_len: expected a row length when batch_size is None, got None")
        lens = np.minimum(lens, row_len)
        return float(lens.sum()) / (lens.size * row_len)
    slots = sum(int(lens[i:i + batch_size].max()) * len(lens[i:i + batch_size]) for i in range(0, lens.size, batch_size))
    return float(lens.sum()) / slots if slots else 1.0
