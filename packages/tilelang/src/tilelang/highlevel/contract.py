"""tensor_contract(A, B, axes=[(-1, 0)]): tensordot through the tiled gemm schedule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tilehal

from ..runtime.kernel import compile
from .schedules import default_gemm_config, gemm_program

_cache: dict[tuple, Any] = {}


def _gemm_kernel(M: int, N: int, K: int, dtype: str, out_dtype: str, target: str, tA: bool = False,
                 tB: bool = False) -> Any:
    key = (M, N, K, dtype, out_dtype, target, tA, tB)
    if key not in _cache:
        cfg = default_gemm_config(M, N, K)
        _cache[key] = compile(gemm_program(M, N, K, tA, tB, False, dtype, dtype, out_dtype, **cfg), out_idx=[2],
                              target=target)
    return _cache[key]


def tensor_contract(A: Any, B: Any, axes: Sequence[tuple[int, int]] = ((-1, 0),), target: str = "auto") -> Any:
    """Contract A's axes with B's (like numpy.tensordot); result axes: A's free axes then B's."""
    na, nb = A.ndim, B.ndim
    pairs = [(a % na, b % nb) for a, b in axes]
    ca, cb = [p[0] for p in pairs], [p[1] for p in pairs]
    if len(set(ca)) != len(ca) or len(set(cb)) != len(cb):
        raise tilehal.ArgumentError(f"axes: expected distinct axes per tensor, got {list(axes)}")
    for a, b in pairs:
        if A.shape[a] != B.shape[b]:
            raise tilehal.ShapeError(f"axes: A dim {a} has size {A.shape[a]} but B dim {b} has size {B.shape[b]}")
    da, db = tilehal.dtype_of(A).name, tilehal.dtype_of(B).name
    if da != db:
        raise tilehal.ShapeError(f"B: expected dtype {da} (same as A), got {db}")
    fa = [d for d in range(na) if d not in ca]
    fb = [d for d in range(nb) if d not in cb]
    a_np, b_np = tilehal.as_numpy(A), tilehal.as_numpy(B)
    a2 = np.ascontiguousarray(a_np.transpose(fa + ca)).reshape(int(np.prod([A.shape[d] for d in fa])), -1)
    b2 = np.ascontiguousarray(b_np.transpose(cb + fb)).reshape(a2.shape[1], -1)
    M, K = a2.shape
    N = b2.shape[1]
    out = _gemm_kernel(M, N, K, da, da, target)(a2, b2)
    out = out.reshape([A.shape[d] for d in fa] + [B.shape[d] for d in fb])
    return tilehal.from_numpy_like(out, A)
