"""RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * w."""

import tilelang
import tilelang.language as T


@tilelang.jit(out_idx=[-1])
def rms_norm(M, N, block_M=4, eps=1e-6, dtype="float32"):
    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), W: T.Tensor((N,), dtype), Y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=128) as bx:
            x = T.alloc_shared((block_M, N), dtype)
            x_sq = T.alloc_fragment((block_M, N), "float")
            w = T.alloc_shared((N,), dtype)
            ssq = T.alloc_fragment((block_M,), "float")
            T.copy(X[bx * block_M, 0], x)
            T.copy(W, w)
            for i, j in T.Parallel(block_M, N):
                x_sq[i, j] = T.cast(x[i, j], "float") * x[i, j]
            T.reduce_sum(x_sq, ssq, dim=1)
            for i in T.Parallel(block_M):
                ssq[i] = T.rsqrt(ssq[i] / N + eps)
            for i, j in T.Parallel(block_M, N):
                x[i, j] = x[i, j] * ssq[i] * w[j]
            T.copy(x, Y[bx * block_M, 0])

    return main


def reference(x, w, eps=1e-6):
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w.float()).to(x.dtype)


def main(M: int = 64, N: int = 512) -> None:
    import torch

    kernel = rms_norm(M, N)
    x, w = torch.randn(M, N), torch.randn(N)
    y = kernel(x, w)
    err = (y - reference(x, w)).abs().max().item()
    assert err < 1e-4
    print(f"RMSNorm {M}x{N} float32 on {kernel.target}: max |y - torch reference| = {err:.1e}")


if __name__ == "__main__":
    main()
