"""GEMM with a fused ReLU epilogue: C = relu(A @ B), the epilogue applied on the fragment."""

import tilelang
import tilelang.language as T


@tilelang.jit(out_idx=[-1])
def matmul_relu(M, N, K, block_M=64, block_N=64, block_K=32, dtype="float16", accum_dtype="float"):
    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared((block_K, block_N), dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum_dtype)
            T.clear(C_local)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=2):
                T.copy(A[by * block_M, k * block_K], A_shared)
                T.copy(B[k * block_K, bx * block_N], B_shared)
                T.gemm(A_shared, B_shared, C_local)
            for i, j in T.Parallel(block_M, block_N):
                C_local[i, j] = T.max(C_local[i, j], 0)
            T.copy(C_local, C[by * block_M, bx * block_N])

    return main


def reference(a, b):
    return (a.float() @ b.float()).relu().to(a.dtype)


def main(M: int = 256, N: int = 192, K: int = 128) -> None:
    import torch

    kernel = matmul_relu(M, N, K)
    a, b = torch.randn(M, K).half(), torch.randn(K, N).half()
    c = kernel(a, b)
    err = (c.float() - reference(a, b).float()).abs().max().item()
    assert err <= 2e-2 * max(1.0, reference(a, b).float().abs().max().item())
    print(f"relu(A @ B) {M}x{N}x{K} float16 (float32 accumulation) on {kernel.target}: "
          f"max |C - torch reference| = {err:.2e} (float16 output rounding; {int((c > 0).sum())} of {c.numel()} positive)")


if __name__ == "__main__":
    main()
