"""Paged flash decoding: one query token per sequence attending to a block-table KV cache (GQA).

The cache layout is kvpool's (the example takes the tensors; tilelang does not import kvpool):
K and V `[num_blocks, block_size, kv_heads, head_dim]`, `block_table` int32 `[batch, max_blocks]`
(physical block of each logical block, -1 padded), `seq_lens` int32 `[batch]`. Q and the output
are `[batch, q_heads, head_dim]`; q head h reads kv head h // (q_heads // kv_heads).

Flash decoding: the KV sequence of each (sequence, kv head) is cut into `num_split` parts; one CTA
per (sequence, kv head, part) runs the online softmax over its part for the kv head's query heads
(held as `block_H` rows of one tensor-core tile) and writes a partial output with its log-sum-exp;
a second kernel in the same prim_func combines the parts. Each KV tile of `block_N` tokens is
gathered page by page through the block table inside T.Pipelined.
"""

import tilelang
import tilelang.language as T


def paged_decode_program(batch, q_heads, kv_heads, head_dim, num_blocks, block_size, max_blocks, num_split=1,
                         block_N=64, block_H=16, num_stages=2, threads=128, dtype="bfloat16", scale=None):
    """The prim_func (Q, K_cache, V_cache, block_table, seq_lens, lse_partial, O_partial, Output). block_N must
    be a multiple of block_size; the logical blocks are cut into `num_split` parts of whole KV tiles."""
    groups = q_heads // kv_heads
    sm_scale = (1.0 / head_dim) ** 0.5 if scale is None else scale
    scale_log2 = sm_scale * 1.44269504  # exp(x) = exp2(x * log2(e))
    pages = block_N // block_size  # logical blocks per KV tile
    tiles_total = T.ceildiv(max_blocks, pages)
    tiles_per_split = T.ceildiv(tiles_total, num_split)
    accum = "float"

    @T.prim_func
    def main(Q: T.Tensor((batch, q_heads, head_dim), dtype),
             K_cache: T.Tensor((num_blocks, block_size, kv_heads, head_dim), dtype),
             V_cache: T.Tensor((num_blocks, block_size, kv_heads, head_dim), dtype),
             block_table: T.Tensor((batch, max_blocks), "int32"), seq_lens: T.Tensor((batch,), "int32"),
             lse_partial: T.Tensor((batch, q_heads, num_split), accum),
             O_partial: T.Tensor((batch, q_heads, num_split, head_dim), accum),
             Output: T.Tensor((batch, q_heads, head_dim), dtype)):
        with T.Kernel(num_split, kv_heads, batch, threads=threads) as (bs, hk, b):
            Q_shared = T.alloc_shared((block_H, head_dim), dtype)
            K_shared = T.alloc_shared((block_N, head_dim), dtype)
            V_shared = T.alloc_shared((block_N, head_dim), dtype)
            acc_s = T.alloc_fragment((block_H, block_N), accum)
            acc_s_cast = T.alloc_fragment((block_H, block_N), dtype)
            acc_o = T.alloc_fragment((block_H, head_dim), accum)
            m = T.alloc_fragment((block_H,), accum)
            m_prev = T.alloc_fragment((block_H,), accum)
            rescale = T.alloc_fragment((block_H,), accum)
            row_sum = T.alloc_fragment((block_H,), accum)
            l_sum = T.alloc_fragment((block_H,), accum)

            seq_len = seq_lens[b]
            first = bs * tiles_per_split  # this part's KV tiles: [first, first + n_tiles)
            n_tiles = T.max(T.min(tiles_per_split, T.ceildiv(seq_len, block_N) - first), 0)
            T.fill(Q_shared, 0)
            T.copy(Q[b, hk * groups:(hk + 1) * groups, :], Q_shared[0:groups, :])
            T.fill(acc_o, 0)
            T.fill(l_sum, 0)
            T.fill(m, -T.infinity(accum))
            for t in T.Pipelined(n_tiles, num_stages=num_stages):
                for p in tuple(range(pages)):  # unrolled at trace time: one pipelined copy per page
                    T.copy(K_cache[T.max(block_table[b, T.min((first + t) * pages + p, max_blocks - 1)], 0), 0:block_size,
                                   hk, :], K_shared[p * block_size:(p + 1) * block_size, :])
                T.clear(acc_s)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(block_H, block_N):  # tokens past the sequence's end
                    acc_s[i, j] = T.if_then_else((first + t) * block_N + j < seq_len, acc_s[i, j],
                                                 -T.infinity(accum))
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.Parallel(block_H):
                    rescale[i] = T.exp2(m_prev[i] * scale_log2 - m[i] * scale_log2)
                for i, j in T.Parallel(block_H, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m[i] * scale_log2)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_H):
                    l_sum[i] = l_sum[i] * rescale[i] + row_sum[i]
                T.copy(acc_s, acc_s_cast)
                for i, j in T.Parallel(block_H, head_dim):
                    acc_o[i, j] *= rescale[i]
                for p in tuple(range(pages)):  # unrolled at trace time: one pipelined copy per page
                    T.copy(V_cache[T.max(block_table[b, T.min((first + t) * pages + p, max_blocks - 1)], 0), 0:block_size,
                                   hk, :], V_shared[p * block_size:(p + 1) * block_size, :])
                T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullCol)
            for i, j in T.Parallel(block_H, head_dim):  # an empty part: l_sum 0 -> output 0, lse -inf
                acc_o[i, j] = T.if_then_else(l_sum[i] > 0, acc_o[i, j] / l_sum[i], 0)
            for i in T.Parallel(block_H):
                l_sum[i] = T.if_then_else(l_sum[i] > 0, T.log2(l_sum[i]) + m[i] * scale_log2, -T.infinity(accum))
            for i in T.Parallel(block_H):
                if i < groups:
                    lse_partial[b, hk * groups + i, bs] = l_sum[i]
            for i, j in T.Parallel(block_H, head_dim):
                if i < groups:
                    O_partial[b, hk * groups + i, bs, j] = acc_o[i, j]

        with T.Kernel(q_heads, batch, threads=128) as (h, b):  # combine the parts by their log-sum-exp
            lse = T.alloc_fragment((num_split,), accum)
            o = T.alloc_fragment((head_dim,), accum)
            lmax = T.alloc_var(accum)
            total = T.alloc_var(accum)
            T.copy(lse_partial[b, h, :], lse)
            lmax = -T.infinity(accum)
            for s in T.serial(num_split):
                lmax = T.max(lmax, lse[s])
            T.clear(o)
            total = 0.0
            for s in T.serial(num_split):
                if lse[s] > -T.infinity(accum):
                    total += T.exp2(lse[s] - lmax)
                    for d in T.Parallel(head_dim):
                        o[d] += O_partial[b, h, s, d] * T.exp2(lse[s] - lmax)
            for d in T.Parallel(head_dim):  # a sequence with nothing to attend to gets zeros
                Output[b, h, d] = T.if_then_else(total > 0, o[d] / total, 0)

    return main


paged_decode_kernel = tilelang.jit(out_idx=[-1])(paged_decode_program)


def paged_decode(q, k_cache, v_cache, block_table, seq_lens, num_split=8, block_N=16, num_stages=4, threads=32,
                 scale=None):
    """Run the example on kvpool-layout tensors: q [B, Hq, D] -> [B, Hq, D] (target: where the tensors are).
    The default schedule (one warp per CTA, 16-token tiles, 4 stages, 8 splits) was the fastest at b64 x 4096
    on the H200 (3907 GB/s, 2026-12-02 R3; 1 split of 128-thread CTAs with 64-token tiles: 3848)."""
    import torch

    B, hq, d = q.shape
    num_blocks, bs, hk, _ = k_cache.shape
    kernel = paged_decode_kernel(B, hq, hk, d, num_blocks, bs, block_table.shape[1], num_split, block_N,
                                 max(16, hq // hk), num_stages, threads, _dtype_name(q.dtype), scale)
    lse = torch.empty(B, hq, num_split, dtype=torch.float32, device=q.device)
    o_part = torch.empty(B, hq, num_split, d, dtype=torch.float32, device=q.device)
    return kernel(q, k_cache, v_cache, block_table, seq_lens, lse, o_part)


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def reference(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """float32 torch: gather each sequence's tokens through its block table, softmax(q k^T) v per kv head."""
    import torch

    B, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    scale = (1.0 / d) ** 0.5 if scale is None else scale
    out = torch.zeros(B, hq, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        blocks = block_table[b, :(n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, hk, d)[:n].float()  # [n, hk, d]
        v = v_cache[blocks].reshape(-1, hk, d)[:n].float()
        qg = q[b].float().view(hk, hq // hk, d)
        s = torch.einsum("hgd,nhd->hgn", qg, k) * scale
        out[b] = torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(hq, d)
    return out.to(q.dtype)


def random_cache(batch, q_heads, kv_heads, head_dim, block_size, seq_lens, dtype="bfloat16", device="cpu", seed=0):
    """Random q / K / V and a shuffled block table (blocks of all sequences interleaved in the pool)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    need = [(int(n) + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(1, max(need))
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(need):
        table[b, :nb] = perm[used:used + nb].int()
        used += nb
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(tdt)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(tdt)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(tdt)
    lens = torch.tensor([int(n) for n in seq_lens], dtype=torch.int32)
    return tuple(x.to(device) for x in (q, k, v, table, lens))


def main(batch: int = 3, q_heads: int = 8, kv_heads: int = 2, head_dim: int = 64, block_size: int = 16) -> None:
    q, k, v, table, lens = random_cache(batch, q_heads, kv_heads, head_dim, block_size, [100, 37, 256])
    out = paged_decode(q, k, v, table, lens, num_split=2, block_N=32)
    err = (out.float() - reference(q, k, v, table, lens).float()).abs().max().item()
    assert err < 2e-2, err
    print(f"paged decode b{batch} GQA {q_heads}/{kv_heads} d{head_dim} block {block_size}: max |O - torch| = {err:.1e}")


if __name__ == "__main__":
    main()
