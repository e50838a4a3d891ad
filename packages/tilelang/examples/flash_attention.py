"""Flash-attention forward: online softmax with T.exp2, T.Pipelined over the KV sequence.

MHA or GQA (`groups` query heads per KV head), BSHD or BHSD layout (`layout`), causal or not.
Written as for the public TileLang; a partial KV tile at the end of the sequence is masked, so any
seq_len works (the public example assumes seq_len % block_N == 0).

This is the one flash-attention source of the repo: tests/public_kernels.py (the public-style
kernel cases) and benchmarks/cuda_kernels.py (the kernel bench_cuda.py times against SDPA and
the public TileLang) load this file and call `flash_attention_fwd`.
"""

import tilelang
import tilelang.language as T


def flash_attention_fwd(batch, heads, seq_len, dim, is_causal, block_M=64, block_N=64, num_stages=1, threads=128,
                        dtype="float16", groups=1, layout="bshd"):
    """The prim_func; Q/Output are [batch, seq_len, heads, dim] ("bshd") or [batch, heads, seq_len, dim]
    ("bhsd"), K/V the same with heads // groups heads."""
    scale = (1.0 / dim) ** 0.5 * 1.44269504  # log2(e)
    kv_heads = heads // groups
    if layout == "bhsd":
        q_shape, kv_shape = [batch, heads, seq_len, dim], [batch, kv_heads, seq_len, dim]
    else:
        q_shape, kv_shape = [batch, seq_len, heads, dim], [batch, seq_len, kv_heads, dim]
    accum = "float"

    @T.prim_func
    def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
             Output: T.Tensor(q_shape, dtype)):
        with T.Kernel(T.ceildiv(seq_len, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([block_M, dim], dtype)
            K_shared = T.alloc_shared([block_N, dim], dtype)
            V_shared = T.alloc_shared([block_N, dim], dtype)
            O_shared = T.alloc_shared([block_M, dim], dtype)
            acc_s = T.alloc_fragment([block_M, block_N], accum)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum)
            scores_max = T.alloc_fragment([block_M], accum)
            scores_max_prev = T.alloc_fragment([block_M], accum)
            scores_scale = T.alloc_fragment([block_M], accum)
            scores_sum = T.alloc_fragment([block_M], accum)
            logsum = T.alloc_fragment([block_M], accum)

            if layout == "bhsd":
                T.copy(Q[bz, by, bx * block_M:(bx + 1) * block_M, :], Q_shared)
            else:
                T.copy(Q[bz, bx * block_M:(bx + 1) * block_M, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, -T.infinity(accum))
            loop_range = (T.min(T.ceildiv(seq_len, block_N), T.ceildiv((bx + 1) * block_M, block_N))
                          if is_causal else T.ceildiv(seq_len, block_N))
            for k in T.Pipelined(loop_range, num_stages=num_stages):
                if layout == "bhsd":
                    T.copy(K[bz, by // groups, k * block_N:(k + 1) * block_N, :], K_shared)
                else:
                    T.copy(K[bz, k * block_N:(k + 1) * block_N, by // groups, :], K_shared)
                if is_causal:  # keys past the end are also past every valid query: masked too
                    for i, j in T.Parallel(block_M, block_N):
                        acc_s[i, j] = T.if_then_else(bx * block_M + i >= k * block_N + j, 0, -T.infinity(accum))
                elif seq_len % block_N == 0:
                    T.clear(acc_s)
                else:
                    for i, j in T.Parallel(block_M, block_N):
                        acc_s[i, j] = T.if_then_else(k * block_N + j < seq_len, 0, -T.infinity(accum))
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(scores_max, scores_max_prev)
                T.fill(scores_max, -T.infinity(accum))
                T.reduce_max(acc_s, scores_max, dim=1, clear=False)
                for i in T.Parallel(block_M):
                    scores_max[i] = T.max(scores_max[i], scores_max_prev[i])
                for i in T.Parallel(block_M):
                    scores_scale[i] = T.exp2(scores_max_prev[i] * scale - scores_max[i] * scale)
                for i, j in T.Parallel(block_M, dim):
                    acc_o[i, j] *= scores_scale[i]
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale - scores_max[i] * scale)
                T.reduce_sum(acc_s, scores_sum, dim=1)
                for i in T.Parallel(block_M):
                    logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]
                T.copy(acc_s, acc_s_cast)
                if layout == "bhsd":
                    T.copy(V[bz, by // groups, k * block_N:(k + 1) * block_N, :], V_shared)
                else:
                    T.copy(V[bz, k * block_N:(k + 1) * block_N, by // groups, :], V_shared)
                T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] /= logsum[i]
            T.copy(acc_o, O_shared)
            if layout == "bhsd":
                T.copy(O_shared, Output[bz, by, bx * block_M:(bx + 1) * block_M, :])
            else:
                T.copy(O_shared, Output[bz, bx * block_M:(bx + 1) * block_M, by, :])

    return main


flashattn = tilelang.jit(out_idx=[3])(flash_attention_fwd)


def reference(q, k, v, is_causal):
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                         v.transpose(1, 2).float(), is_causal=is_causal)
    return out.transpose(1, 2).to(q.dtype)


def main(batch: int = 1, heads: int = 2, seq_len: int = 256, dim: int = 64) -> None:
    import torch

    for causal in (False, True):
        kernel = flashattn(batch, heads, seq_len, dim, causal)
        q, k, v = (torch.randn(batch, seq_len, heads, dim).half() for _ in range(3))
        o = kernel(q, k, v)
        err = (o.float() - reference(q, k, v, causal).float()).abs().max().item()
        assert err < 2e-2
        print(f"flash attention b{batch} h{heads} s{seq_len} d{dim} float16, causal={causal}, on {kernel.target}: "
              f"max |O - torch SDPA (float32)| = {err:.1e}")


if __name__ == "__main__":
    main()
