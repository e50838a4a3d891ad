"""Tile-program templates the high-level front end schedules patterns into."""

# no `from __future__ import annotations` here: prim_func parameter annotations must be evaluated
# when the def runs, so they can name local variables of the factory

from .. import language as T
from ..ir.nodes import PrimFunc


def gemm_program(M: int, N: int, K: int, transpose_A: bool, transpose_B: bool, accumulate: bool, a_dtype: str,
                 b_dtype: str, c_dtype: str, block_M: int = 64, block_N: int = 64, block_K: int = 32) -> PrimFunc:
    """C (+)= op(A) @ op(B) with op = transpose where asked; partial tiles handled by T.copy."""
    a_shape = (K, M) if transpose_A else (M, K)
    b_shape = (N, K) if transpose_B else (K, N)
    a_tile = (block_K, block_M) if transpose_A else (block_M, block_K)
    b_tile = (block_N, block_K) if transpose_B else (block_K, block_N)

    @T.prim_func
    def contract(A: T.Tensor(a_shape, a_dtype), B: T.Tensor(b_shape, b_dtype), C: T.Tensor((M, N), c_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128) as (bx, by):
            A_s = T.alloc_shared(a_tile, a_dtype)
            B_s = T.alloc_shared(b_tile, b_dtype)
            C_f = T.alloc_fragment((block_M, block_N), "float32")
            if accumulate:
                T.copy(C[by * block_M, bx * block_N], C_f)
            else:
                T.clear(C_f)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=2):
                if transpose_A:
                    T.copy(A[k * block_K, by * block_M], A_s)
                else:
                    T.copy(A[by * block_M, k * block_K], A_s)
                if transpose_B:
                    T.copy(B[bx * block_N, k * block_K], B_s)
                else:
                    T.copy(B[k * block_K, bx * block_N], B_s)
                T.gemm(A_s, B_s, C_f, transpose_A=transpose_A, transpose_B=transpose_B)
            T.copy(C_f, C[by * block_M, bx * block_N])

    return contract


def gemm_configs(M: int, N: int, K: int) -> list[dict]:
    """Candidate tile sizes for the autotuner, trimmed to the problem."""
    out = []
    for bm, bn, bk in ((32, 32, 32), (64, 64, 32), (128, 128, 32), (64, 128, 64)):
        if bm <= max(32, M * 2) and bn <= max(32, N * 2):
            out.append({"block_M": bm, "block_N": bn, "block_K": bk})
    return out or [{"block_M": 32, "block_N": 32, "block_K": 32}]


def default_gemm_config(M: int, N: int, K: int) -> dict:
    if M >= 512 and N >= 512:
        return {"block_M": 128, "block_N": 128, "block_K": 32}
    return {"block_M": 64 if M > 32 else 32, "block_N": 64 if N > 32 else 32, "block_K": 32}
