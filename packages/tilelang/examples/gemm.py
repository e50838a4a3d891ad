"""Tiled GEMM, C = A @ B, written exactly as for public TileLang."""

import tilelang
import tilelang.language as T


@tilelang.jit(out_idx=[-1])
def matmul(M, N, K, block_M=128, block_N=128, block_K=32, dtype="float32", accum_dtype="float", num_stages=3,
           threads=128):
    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared((block_K, block_N), dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum_dtype)
            T.clear(C_local)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                T.copy(A[by * block_M, k * block_K], A_shared)
                T.copy(B[k * block_K, bx * block_N], B_shared)
                T.gemm(A_shared, B_shared, C_local)
            T.copy(C_local, C[by * block_M, bx * block_N])

    return main


def main(M: int = 256, N: int = 256, K: int = 256, target: str = "auto") -> None:
    import torch

    kernel = matmul(M, N, K, 64, 64, 32)
    a, b = torch.randn(M, K), torch.randn(K, N)
    c = kernel(a, b)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-3)
    err = (c - a @ b).abs().max().item()
    print(f"gemm {M}x{N}x{K} float32 on {kernel.target}: max |C - torch A @ B| = {err:.1e} "
          "(float32 summation order; tolerance 1e-3 + 1e-4 * |C|)")


if __name__ == "__main__":
    main()
