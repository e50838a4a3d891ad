"""Sparse matrix formats (CSR, COO, BSR) and their conversions to torch.sparse and scipy.sparse.

The containers hold numpy arrays (int64 indices) so they can be built and checked without a
GPU; `to_torch()` / `from_torch()` cross into torch's layouts, `to_scipy()` / `from_scipy()`
into scipy's (scipy is an optional dependency, imported only when used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tilehal import ArgumentError, ShapeError


def _scipy_sparse():
    try:
        import scipy.sparse as ss
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("scipy is needed for scipy.sparse interop: pip install 'tilestack-dataengine[scipy]'") from exc
    return ss


def _dense_2d(x: Any, name: str) -> np.ndarray:
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.ndim != 2:
        raise ShapeError(f"{name}: expected a 2-D matrix, got shape {arr.shape}")
    return arr


@dataclass(frozen=True)
class COOMatrix:
    row: np.ndarray
    col: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, x: Any) -> COOMatrix:
        arr = _dense_2d(x, "x")
        r, c = np.nonzero(arr)
        return cls(r.astype(np.int64), c.astype(np.int64), arr[r, c], tuple(arr.shape))

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.shape, dtype=self.data.dtype)
        np.add.at(out, (self.row, self.col), self.data)  # duplicates sum, as in torch/scipy
        return out

    def to_csr(self) -> CSRMatrix:
        order = np.lexsort((self.col, self.row))
        counts = np.bincount(self.row, minlength=self.shape[0])
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return CSRMatrix(indptr, self.col[order].astype(np.int64), self.data[order], self.shape)

    def to_torch(self) -> torch.Tensor:
        idx = torch.from_numpy(np.stack([self.row, self.col]).astype(np.int64))
        return torch.sparse_coo_tensor(idx, torch.from_numpy(np.ascontiguousarray(self.data)), self.shape,
                                       check_invariants=True).coalesce()

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> COOMatrix:
        if t.layout != torch.sparse_coo:
            t = t.to_sparse_coo()
        t = t.coalesce().cpu()
        idx = t.indices().numpy()
        return cls(idx[0].copy(), idx[1].copy(), t.values().numpy().copy(), tuple(t.shape))

    def to_scipy(self):
        return _scipy_sparse().coo_matrix((self.data, (self.row, self.col)), shape=self.shape)

    @classmethod
    def from_scipy(cls, m) -> COOMatrix:
        m = m.tocoo()
        return cls(m.row.astype(np.int64), m.col.astype(np.int64), m.data.copy(), tuple(m.shape))


@dataclass(frozen=True)
class CSRMatrix:
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if len(self.indptr) != self.shape[0] + 1:
            raise ShapeError(f"indptr: expected length {self.shape[0] + 1} (rows + 1), got {len(self.indptr)}")
        if len(self.indices) != len(self.data) or int(self.indptr[-1]) != len(self.data):
            raise ShapeError(f"indices/data: expected {int(self.indptr[-1])} entries (indptr[-1]), "
                             f"got {len(self.indices)} and {len(self.data)}")

    @classmethod
    def from_dense(cls, x: Any) -> CSRMatrix:
        return COOMatrix.from_dense(x).to_csr()

    def to_coo(self) -> COOMatrix:
        row = np.repeat(np.arange(self.shape[0], dtype=np.int64), np.diff(self.indptr))
        return COOMatrix(row, self.indices.astype(np.int64), self.data, self.shape)

    def to_dense(self) -> np.ndarray:
        return self.to_coo().to_dense()

    def to_torch(self) -> torch.Tensor:
        return torch.sparse_csr_tensor(torch.from_numpy(self.indptr.astype(np.int64)),
                                       torch.from_numpy(self.indices.astype(np.int64)),
                                       torch.from_numpy(np.ascontiguousarray(self.data)), self.shape,
                                       check_invariants=True)

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> CSRMatrix:
        if t.layout != torch.sparse_csr:
            t = (t.coalesce() if t.layout == torch.sparse_coo else t).to_sparse_csr()
        t = t.cpu()
        return cls(t.crow_indices().numpy().astype(np.int64), t.col_indices().numpy().astype(np.int64),
                   t.values().numpy().copy(), tuple(t.shape))

    def to_scipy(self):
        return _scipy_sparse().csr_matrix((self.data, self.indices, self.indptr), shape=self.shape)

    @classmethod
    def from_scipy(cls, m) -> CSRMatrix:
        m = m.tocsr()
        m.sum_duplicates()
        return cls(m.indptr.astype(np.int64), m.indices.astype(np.int64), m.data.copy(), tuple(m.shape))

    def to_bsr(self, blocksize: tuple[int, int]) -> BSRMatrix:
        return BSRMatrix.from_dense(self.to_dense(), blocksize)


@dataclass(frozen=True)
class BSRMatrix:
    """Block CSR: `blocks[k]` is the dense (bh, bw) tile at block row r, block column indices[k]."""

    indptr: np.ndarray
    indices: np.ndarray
    blocks: np.ndarray
    shape: tuple[int, int]
    blocksize: tuple[int, int]

    @classmethod
    def from_dense(cls, x: Any, blocksize: tuple[int, int]) -> BSRMatrix:
        arr = _dense_2d(x, "x")
        bh, bw = blocksize
        if bh <= 0 or bw <= 0 or arr.shape[0] % bh or arr.shape[1] % bw:
            raise ShapeError(f"blocksize: expected positive divisors of shape {arr.shape}, got {blocksize}")
        tiles = arr.reshape(arr.shape[0] // bh, bh, arr.shape[1] // bw, bw).transpose(0, 2, 1, 3)
        nonzero = (tiles != 0).any(axis=(2, 3))
        br, bc = np.nonzero(nonzero)
        indptr = np.concatenate([[0], np.cumsum(nonzero.sum(1))]).astype(np.int64)
        return cls(indptr, bc.astype(np.int64), tiles[br, bc].copy(), tuple(arr.shape), (bh, bw))

    def to_dense(self) -> np.ndarray:
        bh, bw = self.blocksize
        out = np.zeros(self.shape, dtype=self.blocks.dtype)
        rows = np.repeat(np.arange(len(self.indptr) - 1), np.diff(self.indptr))
        for k, (r, c) in enumerate(zip(rows, self.indices)):
            out[r * bh:(r + 1) * bh, c * bw:(c + 1) * bw] = self.blocks[k]
        return out

    def to_csr(self) -> CSRMatrix:
        return CSRMatrix.from_dense(self.to_dense())

    def to_torch(self) -> torch.Tensor:
        return torch.sparse_bsr_tensor(torch.from_numpy(self.indptr), torch.from_numpy(self.indices),
                                       torch.from_numpy(np.ascontiguousarray(self.blocks)), self.shape,
                                       check_invariants=True)

    @classmethod
    def from_torch(cls, t: torch.Tensor, blocksize: tuple[int, int] | None = None) -> BSRMatrix:
        if t.layout != torch.sparse_bsr:
            if blocksize is None:
                raise ArgumentError("blocksize: expected (bh, bw) to convert a non-BSR tensor, got None")
            return cls.from_dense(t.to_dense(), blocksize)
        t = t.cpu()
        vals = t.values().numpy().copy()
        return cls(t.crow_indices().numpy().astype(np.int64), t.col_indices().numpy().astype(np.int64), vals,
                   tuple(t.shape), (vals.shape[1], vals.shape[2]))

    def to_scipy(self):
        return _scipy_sparse().bsr_matrix((self.blocks, self.indices, self.indptr), shape=self.shape)

    @classmethod
    def from_scipy(cls, m, blocksize: tuple[int, int] | None = None) -> BSRMatrix:
        m = m.tobsr(blocksize=blocksize) if blocksize is not None else m.tobsr()
        m.sum_duplicates()
        return cls(m.indptr.astype(np.int64), m.indices.astype(np.int64), m.data.copy(), tuple(m.shape),
                   tuple(m.blocksize))
