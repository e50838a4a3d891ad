"""N:M structured weight sparsity: masks, the compressed hardware layout, and a sparse Linear.

Groups of M consecutive weights along the reduction (input) dimension keep their N largest
scores. Scores are |W| ("magnitude") or |W| * ||X_j||_2 over calibration activations ("wanda",
Sun et al. 2023). A 2:4 weight compresses to its kept values plus the metadata the sparse
tensor cores read: a 2-bit position (0..3) per kept value, two per group, packed
little-endian into 16-bit words (8 kept values, i.e. 16 dense columns, per word). This is the
per-row `mma.sp` operand encoding; cuSPARSELt/CUTLASS additionally reorder the words into
their tile-interleaved layout inside `to_sparse_semi_structured`, which we leave to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from tilehal import ArgumentError, ShapeError, check_choice

log = logging.getLogger(__name__)

Pattern = Literal["2:4", "4:8"]
Method = Literal["magnitude", "wanda"]

_PATTERNS: dict[str, tuple[int, int]] = {"2:4": (2, 4), "4:8": (4, 8)}


def parse_pattern(pattern: str) -> tuple[int, int]:
    """'2:4' -> (2, 4); only the patterns we compress exactly are accepted."""
    return _PATTERNS[check_choice(pattern, "pattern", sorted(_PATTERNS))]


def _check_weight(weight: torch.Tensor, m: int) -> None:
    if not isinstance(weight, torch.Tensor):
        raise ShapeError(f"weight: expected a torch tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ShapeError(f"weight: expected 2 dimensions [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.shape[1] % m:
        raise ShapeError(f"weight: expected in_features divisible by {m}, got {weight.shape[1]}")


def scores(weight: torch.Tensor, method: Method = "magnitude", activations: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each weight (float32, same shape as `weight`)."""
    check_choice(method, "method", ("magnitude", "wanda"))
    w = weight.detach().float().abs()
    if method == "magnitude":
        return w
    if method != "wanda":
        raise ArgumentError(f"method: expected 'magnitude' or 'wanda', got {method!r}")
    if activations is None:
        raise ArgumentError("activations: expected calibration inputs [tokens, in_features] for method='wanda', got None")
    x = activations.detach().reshape(-1, activations.shape[-1]).float()
    if x.shape[1] != weight.shape[1]:
        raise ShapeError(f"activations: expected last dimension {weight.shape[1]} (in_features), got {x.shape[1]}")
    col_norm = x.to(w.device).norm(dim=0)  # ||X_j||_2 over calibration tokens
    return w * col_norm.unsqueeze(0)


def nm_mask(
    weight: torch.Tensor, pattern: Pattern = "2:4", method: Method = "magnitude",
    activations: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask keeping exactly N of every M consecutive weights along in_features.

    Ties are broken toward the lower column so the mask is deterministic.
    """
    n, m = parse_pattern(pattern)
    _check_weight(weight, m)
    s = scores(weight, method, activations)
    rows, cols = s.shape
    groups = s.reshape(rows, cols // m, m)
    # Stable sort on -score keeps the lower column first among equal scores.
    order = torch.sort(-groups, dim=-1, stable=True).indices[..., :n]
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(-1, order, True)
    return mask.reshape(rows, cols)


def is_nm_sparse(weight: torch.Tensor, pattern: Pattern = "2:4") -> bool:
    """True when every group of M along in_features holds at most N non-zeros."""
    n, m = parse_pattern(pattern)
    _check_weight(weight, m)
    nz = (weight != 0).reshape(weight.shape[0], -1, m).sum(-1)
    return bool((nz <= n).all())


def prune(weight: torch.Tensor, pattern: Pattern = "2:4", method: Method = "magnitude",
          activations: torch.Tensor | None = None) -> torch.Tensor:
    """Weight with the pruned entries set to zero (same dtype and device)."""
    return weight * nm_mask(weight, pattern, method, activations).to(weight.dtype)


@dataclass(frozen=True)
class CompressedNM:
    """Kept values [rows, cols*N/M] plus position metadata; `decompress()` is exact.

    2:4: `metadata` is int16 [rows, ceil(cols/16)], 2 bits per kept value (hardware encoding).
    4:8: `metadata` is uint8 [rows, cols/8], the group's keep bitmask (also 2 bits per kept value).
    """

    values: torch.Tensor
    metadata: torch.Tensor
    shape: tuple[int, int]
    pattern: str

    def decompress(self) -> torch.Tensor:
        return decompress(self)


def _mask_from_weight_or_given(weight: torch.Tensor, mask: torch.Tensor | None, pattern: str) -> torch.Tensor:
    n, m = parse_pattern(pattern)
    if mask is None:
        # Keep the N largest magnitudes; for an already N:M-sparse weight this keeps every non-zero.
        return nm_mask(weight, pattern, "magnitude")
    if mask.shape != weight.shape:
        raise ShapeError(f"mask: expected shape {tuple(weight.shape)}, got {tuple(mask.shape)}")
    per_group = mask.reshape(weight.shape[0], -1, m).sum(-1)
    if not bool((per_group == n).all()):
        raise ArgumentError(f"mask: expected exactly {n} kept of every {m}, got groups with {per_group.unique().tolist()}")
    return mask.bool()


def compress(weight: torch.Tensor, pattern: Pattern = "2:4", mask: torch.Tensor | None = None) -> CompressedNM:
    """Compress an N:M weight. Without `mask`, the N largest magnitudes per group are kept."""
    n, m = parse_pattern(pattern)
    _check_weight(weight, m)
    keep = _mask_from_weight_or_given(weight, mask, pattern)
    rows, cols = weight.shape
    groups = cols // m
    keep_g = keep.reshape(rows, groups, m)
    # Positions of the kept entries, ascending within each group (hardware wants idx0 < idx1).
    pos = torch.sort(torch.where(keep_g, torch.arange(m, device=weight.device), m), dim=-1).values[..., :n]
    values = torch.gather(weight.reshape(rows, groups, m), -1, pos).reshape(rows, groups * n)
    if pattern == "2:4":
        # 4 bits per group: idx0 | idx1 << 2; four groups per 16-bit word, group 0 in the low bits.
        nibble = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.int32)
        pad = (-groups) % 4
        if pad:
            # Padding groups point at positions (0, 1) of nothing; decompress ignores them.
            nibble = torch.cat([nibble, nibble.new_full((rows, pad), 0b0100)], dim=1)
        nib = nibble.reshape(rows, -1, 4)
        word = nib[..., 0] | (nib[..., 1] << 4) | (nib[..., 2] << 8) | (nib[..., 3] << 12)
        # Reinterpret the unsigned 16-bit pattern as int16 (torch has no uint16 arithmetic on all builds).
        metadata = torch.where(word >= 1 << 15, word - (1 << 16), word).to(torch.int16)
    else:
        bits = (keep_g.to(torch.int32) << torch.arange(m, device=weight.device, dtype=torch.int32)).sum(-1)
        metadata = bits.to(torch.uint8)
    return CompressedNM(values=values.contiguous(), metadata=metadata.contiguous(), shape=(rows, cols), pattern=pattern)


def decompress(c: CompressedNM) -> torch.Tensor:
    """Dense weight with zeros at pruned positions; bit-exact inverse of `compress`."""
    if not isinstance(c, CompressedNM):
        raise ArgumentError(f"c: expected a CompressedNM (from compress), got {type(c).__name__}")
    n, m = parse_pattern(c.pattern)
    rows, cols = c.shape
    groups = cols // m
    if c.pattern == "2:4":
        word = c.metadata.to(torch.int32) & 0xFFFF
        shifts = torch.arange(0, 16, 2, device=word.device, dtype=torch.int32)  # 8 fields per word
        fields = ((word.unsqueeze(-1) >> shifts) & 0b11).reshape(rows, -1)[:, : groups * n]
        pos = fields.reshape(rows, groups, n).long()
    else:
        bits = c.metadata.to(torch.int32)
        keep = ((bits.unsqueeze(-1) >> torch.arange(m, device=bits.device, dtype=torch.int32)) & 1).bool()
        pos = torch.sort(torch.where(keep, torch.arange(m, device=bits.device), m), dim=-1).values[..., :n]
    dense = torch.zeros(rows, groups, m, dtype=c.values.dtype, device=c.values.device)
    dense.scatter_(-1, pos, c.values.reshape(rows, groups, n))
    return dense.reshape(rows, cols)


# ---------------------------------------------------------------------------------------------
# SparseLinear


def semi_structured_unavailable_reason(weight: torch.Tensor) -> str | None:
    """Why torch's semi-structured (sparse tensor core) path cannot take `weight`, or None if it can."""
    if not weight.is_cuda:
        return f"weight is on {weight.device}, the sparse tensor core path needs CUDA"
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return f"torch {torch.__version__} has no torch.sparse.to_sparse_semi_structured"
    major, minor = torch.cuda.get_device_capability(weight.device)
    if major < 8:
        return f"compute capability {major}.{minor} has no sparse tensor cores (needs >= 8.0)"
    if weight.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {weight.dtype} not supported (float16 or bfloat16 only)"
    rows, cols = weight.shape
    cls = _semi_structured_class()
    cfg = cls._DTYPE_SHAPE_CONSTRAINTS[weight.dtype]
    if rows % cfg.sparse_min_rows or cols % cfg.sparse_min_cols:
        return (f"shape {rows}x{cols} must be a multiple of ({cfg.sparse_min_rows}, {cfg.sparse_min_cols}) "
                f"for {cls.__name__}")
    return None


def _semi_structured_class():
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    cusparselt = getattr(torch.backends, "cusparselt", None)
    if cusparselt is not None and cusparselt.is_available():
        return SparseSemiStructuredTensorCUSPARSELT
    return SparseSemiStructuredTensorCUTLASS


class SparseLinear(torch.nn.Module):
    """A Linear layer whose weight is N:M sparse.

    `path` says how forward runs: "semi_structured_cusparselt" / "semi_structured_cutlass" (the GPU's
    sparse tensor cores through torch), or "masked_dense" (the pruned weight in a dense matmul,
    the reference used everywhere else). `reason` holds why the fast path was not taken.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, pattern: str,
                 path: str, reason: str | None) -> None:
        super().__init__()
        self.out_features, self.in_features = int(mask.shape[0]), int(mask.shape[1])
        self.pattern = pattern
        self.path = path
        self.reason = reason
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("mask", mask, persistent=True)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, pattern: Pattern = "2:4", method: Method = "magnitude",
                   activations: torch.Tensor | None = None, backend: str = "auto") -> SparseLinear:
        """Prune `linear` to `pattern` by `method` and pick the execution path.

        backend: "auto" (sparse tensor cores when they qualify), "dense" (force the masked reference).
        """
        if not isinstance(linear, torch.nn.Linear):
            raise ArgumentError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        if backend not in ("auto", "dense"):
            raise ArgumentError(f"backend: expected 'auto' or 'dense', got {backend!r}")
        w = linear.weight.detach()
        mask = nm_mask(w, pattern, method, activations)
        pruned = (w * mask.to(w.dtype)).contiguous()
        reason: str | None
        if backend == "dense":
            reason = "backend='dense' was requested"
        elif pattern != "2:4":
            reason = f"pattern {pattern} has no hardware support (sparse tensor cores do 2:4 only)"
        else:
            reason = semi_structured_unavailable_reason(pruned)
        if reason is None:
            try:
                sparse_w = torch.sparse.to_sparse_semi_structured(pruned)
                path = ("semi_structured_cusparselt" if "CUSPARSELT" in type(sparse_w).__name__
                        else "semi_structured_cutlass")
                log.debug("SparseLinear %dx%d: %s", *pruned.shape, path)
                return cls(sparse_w, linear.bias, mask, pattern, path, None)
            except (RuntimeError, NotImplementedError) as exc:  # a torch build without the kernels
                reason = f"to_sparse_semi_structured failed: {exc}"
        log.debug("SparseLinear %dx%d: masked dense reference because %s", *pruned.shape, reason)
        return cls(pruned, linear.bias, mask, pattern, "masked_dense", reason)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"x: expected last dimension {self.in_features}, got {x.shape[-1]}")
        if self.path == "masked_dense":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        # The semi-structured kernels take a 2-D input whose rows meet the dense minimum; flatten and
        # let torch pad the rows.
        lead = x.shape[:-1]
        y = torch.nn.functional.linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*lead, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The pruned weight as a dense tensor (for checks)."""
        if self.path == "masked_dense":
            return self.weight.detach()
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.pattern}, path={self.path}"
