"""Kernels written the way public TileLang programs are (`@tilelang.jit(out_idx=...)` on a factory
returning a `@T.prim_func`), one per "must hold" case of the CUDA backend: each comes with a
torch reference and an input builder. Used by test_cuda.py (compile, CPU emulation, H200) and by
benchmarks/bench_cuda.py.

CASES maps a name to (factory, args, make_inputs(device), reference(*inputs) -> outputs, tolerance).
"""


import importlib.util
import sys
from pathlib import Path

import tilelang
import tilelang.language as T
import torch

# ---------------------------------------------------------------- GEMM family


@tilelang.jit(out_idx=[-1])
def matmul(M, N, K, block_M=128, block_N=128, block_K=32, dtype="float16", accum_dtype="float", num_stages=3,
           threads=128, trans_b=False, epilogue="none"):
    b_shape = (N, K) if trans_b else (K, N)
    b_tile = (block_N, block_K) if trans_b else (block_K, block_N)

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype),
             C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared(b_tile, dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum_dtype)
            T.use_swizzle(panel_size=10)
            T.clear(C_local)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                T.copy(A[by * block_M, k * block_K], A_shared)
                if trans_b:
                    T.copy(B[bx * block_N, k * block_K], B_shared)
                else:
                    T.copy(B[k * block_K, bx * block_N], B_shared)
                T.gemm(A_shared, B_shared, C_local, transpose_B=trans_b)
            if epilogue == "bias_relu":
                for i, j in T.Parallel(block_M, block_N):
                    C_local[i, j] = T.max(C_local[i, j] + Bias[bx * block_N + j], 0)
            T.copy(C_local, C[by * block_M, bx * block_N])

    return main


@tilelang.jit(out_idx=[-1])
def matmul_splitk(M, N, K, block_M=64, block_N=64, block_K=32, split_k=4, dtype="float16", accum_dtype="float"):
    split = K // split_k

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k, threads=128) as (bx, by, bz):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared((block_K, block_N), dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum_dtype)
            T.clear(C_local)
            for ko in T.Pipelined(T.ceildiv(split, block_K), num_stages=2):
                T.copy(A[by * block_M, bz * split + ko * block_K], A_shared)
                T.copy(B[bz * split + ko * block_K, bx * block_N], B_shared)
                T.gemm(A_shared, B_shared, C_local)
            for i, j in T.Parallel(block_M, block_N):
                T.atomic_add(C[by * block_M + i, bx * block_N + j], C_local[i, j])

    return main


@tilelang.jit(out_idx=[-1])
def gemv(N, K, block_N=32, block_K=128, dtype="float16", accum_dtype="float"):
    @T.prim_func
    def main(A: T.Tensor((N, K), dtype), x: T.Tensor((K,), dtype), y: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), threads=128) as bn:
            x_shared = T.alloc_shared((block_K,), dtype)
            acc = T.alloc_fragment((block_N, block_K), accum_dtype)
            y_local = T.alloc_fragment((block_N,), accum_dtype)
            T.clear(acc)
            for kb in T.serial(T.ceildiv(K, block_K)):
                T.copy(x[kb * block_K], x_shared)
                for i, k in T.Parallel(block_N, block_K):
                    acc[i, k] += T.if_then_else(bn * block_N + i < N and kb * block_K + k < K,
                                                A[bn * block_N + i, kb * block_K + k], 0) * x_shared[k]
            T.reduce_sum(acc, y_local, dim=1)
            T.copy(y_local, y[bn * block_N])

    return main


# ---------------------------------------------------------------- row-wise kernels


@tilelang.jit(out_idx=[-1])
def layer_norm(M, N, block_M=4, eps=1e-5, dtype="float32"):
    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), W: T.Tensor((N,), dtype), Bv: T.Tensor((N,), dtype),
             Y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=128) as bx:
            x = T.alloc_fragment((block_M, N), "float")
            xc = T.alloc_fragment((block_M, N), "float")
            mean = T.alloc_fragment((block_M,), "float")
            var = T.alloc_fragment((block_M,), "float")
            T.copy(X[bx * block_M, 0], x)
            T.reduce_sum(x, mean, dim=1)
            for i in T.Parallel(block_M):
                mean[i] = mean[i] / N
            for i, j in T.Parallel(block_M, N):
                xc[i, j] = (x[i, j] - mean[i]) * (x[i, j] - mean[i])
            T.reduce_sum(xc, var, dim=1)
            for i in T.Parallel(block_M):
                var[i] = T.rsqrt(var[i] / N + eps)
            for i, j in T.Parallel(block_M, N):
                x[i, j] = (x[i, j] - mean[i]) * var[i] * W[j] + Bv[j]
            T.copy(x, Y[bx * block_M, 0])

    return main


@tilelang.jit(out_idx=[-1])
def row_cumsum(M, N, block_M=8, dtype="float32"):
    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=128) as bx:
            x = T.alloc_shared((block_M, N), dtype)
            T.copy(X[bx * block_M, 0], x)
            T.cumsum(x, dim=1)
            T.copy(x, Y[bx * block_M, 0])

    return main


@tilelang.jit(out_idx=[1, 2])
def topk(M, N, k, blk_m=64, threads=128):
    @T.prim_func
    def main(logits: T.Tensor((M, N), "float32"), gates: T.Tensor((M, k), "float32"),
             indices: T.Tensor((M, k), "int32")):
        with T.Kernel(T.ceildiv(M, blk_m), threads=threads) as bx:
            frag = T.alloc_fragment((blk_m, N), "float32")
            max_val = T.alloc_fragment((blk_m,), "float32")
            expand_idx = T.alloc_fragment((blk_m, N), "int32")
            max_idx = T.alloc_fragment((blk_m,), "int32")
            T.copy(logits[bx * blk_m, 0], frag)
            for t in T.serial(k):
                T.fill(expand_idx, -1)
                T.reduce_max(frag, max_val, dim=1, clear=True)
                for i, j in T.Parallel(blk_m, N):
                    expand_idx[i, j] = T.if_then_else(max_val[i] == frag[i, j], j, expand_idx[i, j])
                T.reduce_max(expand_idx, max_idx, dim=1, clear=True)
                for i, j in T.Parallel(blk_m, N):
                    frag[i, j] = T.if_then_else(max_idx[i] == j, -10000.0, frag[i, j])
                for i in T.Parallel(blk_m):
                    if bx * blk_m + i < M:
                        gates[bx * blk_m + i, t] = max_val[i]
                        indices[bx * blk_m + i, t] = max_idx[i]

    return main


# ---------------------------------------------------------------- attention


def _load_example(name: str):
    """An example file by path (examples/ is not a package); the flash-attention source lives there once."""
    key = f"tilelang_example_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


# MHA (groups=1) or GQA (heads // groups KV heads), bhsd or bshd, causal or not: examples/flash_attention.py
flash_attention = _load_example("flash_attention").flashattn


@tilelang.jit(out_idx=[-1])
def flash_decoding(batch, heads, kv_heads, seqlen_kv, dim, num_split=4, block_N=64, block_H=16, threads=128,
                   dtype="float16"):
    """GQA decode (one query token): split the KV sequence, then combine the partial outputs by their
    log-sum-exp (two kernels in one prim_func). A block holds the `groups` query heads of one KV head
    in block_H rows (the rest are padding the tensor cores need)."""
    scale = (1.0 / dim) ** 0.5 * 1.44269504
    groups = heads // kv_heads
    accum = "float"
    part = seqlen_kv // num_split

    @T.prim_func
    def main(Q: T.Tensor([batch, heads, dim], dtype), K: T.Tensor([batch, seqlen_kv, kv_heads, dim], dtype),
             V: T.Tensor([batch, seqlen_kv, kv_heads, dim], dtype), glse: T.Tensor([batch, heads, num_split], accum),
             O_partial: T.Tensor([batch, heads, num_split, dim], accum), Output: T.Tensor([batch, heads, dim], dtype)):
        with T.Kernel(batch, kv_heads, num_split, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([block_H, dim], dtype)
            K_shared = T.alloc_shared([block_N, dim], dtype)
            V_shared = T.alloc_shared([block_N, dim], dtype)
            acc_s = T.alloc_fragment([block_H, block_N], accum)
            acc_s_cast = T.alloc_fragment([block_H, block_N], dtype)
            acc_o = T.alloc_fragment([block_H, dim], accum)
            m = T.alloc_fragment([block_H], accum)
            m_prev = T.alloc_fragment([block_H], accum)
            sc = T.alloc_fragment([block_H], accum)
            ssum = T.alloc_fragment([block_H], accum)
            lsum = T.alloc_fragment([block_H], accum)
            kvh = by
            T.fill(Q_shared, 0)
            T.copy(Q[bx, by * groups:(by + 1) * groups, :], Q_shared[0:groups, :])
            T.fill(acc_o, 0)
            T.fill(lsum, 0)
            T.fill(m, -T.infinity(accum))
            for k in T.Pipelined(T.ceildiv(part, block_N), num_stages=2):
                T.copy(K[bx, bz * part + k * block_N:bz * part + (k + 1) * block_N, kvh, :], K_shared)
                T.clear(acc_s)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(block_H, block_N):
                    acc_s[i, j] = T.if_then_else(k * block_N + j < part, acc_s[i, j], -T.infinity(accum))
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.Parallel(block_H):
                    sc[i] = T.exp2(m_prev[i] * scale - m[i] * scale)
                for i, j in T.Parallel(block_H, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale - m[i] * scale)
                T.reduce_sum(acc_s, ssum, dim=1)
                for i in T.Parallel(block_H):
                    lsum[i] = lsum[i] * sc[i] + ssum[i]
                T.copy(acc_s, acc_s_cast)
                for i, j in T.Parallel(block_H, dim):
                    acc_o[i, j] *= sc[i]
                T.copy(V[bx, bz * part + k * block_N:bz * part + (k + 1) * block_N, kvh, :], V_shared)
                T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullCol)
            for i, j in T.Parallel(block_H, dim):
                acc_o[i, j] /= lsum[i]
            for i in T.Parallel(block_H):
                lsum[i] = T.log2(lsum[i]) + m[i] * scale
            for i in T.Parallel(block_H):
                if i < groups:
                    glse[bx, by * groups + i, bz] = lsum[i]
            for i, j in T.Parallel(block_H, dim):
                if i < groups:
                    O_partial[bx, by * groups + i, bz, j] = acc_o[i, j]
        with T.Kernel(heads, batch, threads=128) as (hx, bb):
            lse = T.alloc_fragment([num_split], accum)
            lmax = T.alloc_var(accum)
            o = T.alloc_fragment([dim], accum)
            T.copy(glse[bb, hx, :], lse)
            lmax = -T.infinity(accum)
            for s in T.serial(num_split):
                lmax = T.max(lmax, lse[s])
            T.clear(o)
            for s in T.serial(num_split):
                for d in T.Parallel(dim):
                    o[d] += O_partial[bb, hx, s, d] * T.exp2(lse[s] - lmax)
            total = T.alloc_var(accum)
            total = 0.0
            for s in T.serial(num_split):
                total += T.exp2(lse[s] - lmax)
            for d in T.Parallel(dim):
                Output[bb, hx, d] = o[d] / total

    return main


@tilelang.jit(out_idx=[4])
def linear_attention(B, S, H, DK, DV, chunk=64, BK=64, BV=64, dtype="float16"):
    """Chunked causal linear attention (no normalization): O = sum over s <= t of (q_t . k_s) v_s."""
    scale = DK ** -0.5
    accum = "float"
    NK, NV, NT = DK // BK, DV // BV, S // chunk

    @T.prim_func
    def main(Q: T.Tensor([B, S, H, DK], dtype), K: T.Tensor([B, S, H, DK], dtype), V: T.Tensor([B, S, H, DV], dtype),
             O: T.Tensor([B, S, H, DV], accum), final_state: T.Tensor([B, H, DK, DV], accum)):
        with T.Kernel(NV, NK, B * H) as (i_v, i_k, i_bh):
            i_b = i_bh // H
            i_h = i_bh % H
            q = T.alloc_shared([chunk, BK], dtype)
            k = T.alloc_shared([chunk, BK], dtype)
            v = T.alloc_shared([chunk, BV], dtype)
            h = T.alloc_fragment([BK, BV], accum)
            h_shared = T.alloc_shared([BK, BV], dtype)
            s = T.alloc_fragment([chunk, chunk], accum)
            s_shared = T.alloc_shared([chunk, chunk], dtype)
            o = T.alloc_fragment([chunk, BV], accum)
            o_shared = T.alloc_shared([chunk, BV], accum)
            T.clear(h)
            for i in T.Pipelined(0, NT):
                for row, col in T.Parallel(chunk, BK):
                    q[row, col] = Q[i_b, i * chunk + row, i_h, i_k * BK + col] * scale
                T.copy(K[i_b, i * chunk:(i + 1) * chunk, i_h, i_k * BK:(i_k + 1) * BK], k)
                T.copy(V[i_b, i * chunk:(i + 1) * chunk, i_h, i_v * BV:(i_v + 1) * BV], v)
                T.gemm(q, k, s, clear_accum=True, transpose_B=True)
                for row, col in T.Parallel(chunk, chunk):
                    s_shared[row, col] = T.if_then_else(row >= col, s[row, col], 0)
                T.gemm(s_shared, v, o, clear_accum=True)
                T.copy(h, h_shared)
                T.gemm(k, v, h, transpose_A=True)
                T.gemm(q, h_shared, o)
                T.copy(o, o_shared)
                T.atomic_add(O[i_b, i * chunk:(i + 1) * chunk, i_h, i_v * BV:(i_v + 1) * BV], o_shared)
            T.copy(h, final_state[i_b, i_h, i_k * BK:(i_k + 1) * BK, i_v * BV:(i_v + 1) * BV])

    return main


# ---------------------------------------------------------------- references and inputs


def _attn_ref(q, k, v, causal, layout, groups):
    import torch.nn.functional as F

    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    if layout == "bshd":
        o = o.transpose(1, 2)
    return o.to(q.dtype).contiguous()


def _decode_ref(q, k, v, glse, op):
    b, h, d = q.shape
    kvh = k.shape[2]
    kk = k.float().permute(0, 2, 1, 3).repeat_interleave(h // kvh, dim=1)
    vv = v.float().permute(0, 2, 1, 3).repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("bhd,bhsd->bhs", q.float(), kk) / d ** 0.5
    return torch.einsum("bhs,bhsd->bhd", s.softmax(-1), vv).to(q.dtype)


def _linattn_ref(q, k, v, o):
    b, s, h, dk = q.shape
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    qf = (qf * dk ** -0.5).half().float()
    att = (qf @ kf.transpose(-1, -2)).tril()
    out = (att @ vf).transpose(1, 2).contiguous()
    state = kf.transpose(-1, -2) @ vf
    return out, state


def _fa_inputs(qs, ks):
    return lambda d: [_r(*qs, device=d), _r(*ks, device=d), _r(*ks, device=d)]


def _fa_ref(causal, layout, groups):
    return lambda q, k, v: _attn_ref(q, k, v, causal, layout, groups)


def _r(*shape, dtype=torch.float16, device="cpu", scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(dtype).to(device)


def cases(size: str = "small") -> dict:
    """name -> (factory, args, make_inputs(device) -> list, reference(*inputs) -> output(s), tolerance)."""
    big = size == "gpu"
    M, N, K = (1000, 1000, 512) if big else (100, 72, 128)
    c = {}
    c["gemm_nn_bias_relu"] = (matmul, (M, N, K, 64, 64, 32, "float16", "float", 2, 128, False, "bias_relu"),
                              lambda d: [_r(M, K, device=d), _r(K, N, device=d), _r(N, device=d)],
                              lambda a, b, bias: (a.float() @ b.float() + bias.float()).relu().half(), 2e-2)
    c["gemm_nt_bf16"] = (matmul, (M, N, K, 64, 64, 32, "bfloat16", "float", 3, 128, True, "none"),
                         lambda d: [_r(M, K, dtype=torch.bfloat16, device=d), _r(N, K, dtype=torch.bfloat16, device=d),
                                    _r(N, dtype=torch.bfloat16, device=d)],
                         lambda a, b, bias: (a.float() @ b.float().T).bfloat16(), 3e-2)
    c["gemm_splitk_atomic"] = (matmul_splitk, (M, N, K, 64, 64, 32, 4),
                               lambda d: [_r(M, K, device=d), _r(K, N, device=d)],
                               lambda a, b: a.float() @ b.float(), 2e-2)
    NV, KV = (4096, 4096) if big else (70, 300)
    c["gemv"] = (gemv, (NV, KV), lambda d: [_r(NV, KV, device=d), _r(KV, device=d)],
                 lambda a, x: (a.float() @ x.float()).half(), 3e-2)
    LM, LN = (2048, 1024) if big else (13, 96)
    c["layernorm"] = (layer_norm, (LM, LN), lambda d: [_r(LM, LN, device=d, dtype=torch.float32),
                                                       _r(LN, device=d, dtype=torch.float32),
                                                       _r(LN, device=d, dtype=torch.float32)],
                      lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5), 1e-4)
    CM, CN = (1024, 512) if big else (20, 64)
    c["cumsum"] = (row_cumsum, (CM, CN), lambda d: [_r(CM, CN, device=d, dtype=torch.float32)],
                   lambda x: x.cumsum(-1), 1e-4)
    TM, TN, TK = (320, 128, 6) if big else (70, 64, 4)
    c["topk"] = (topk, (TM, TN, TK, 64), lambda d: [torch.rand(TM, TN).to(d)],
                 lambda x: (lambda r: (r.values, r.indices.int()))(x.topk(TK, dim=1)), 0)
    for layout in ("bhsd", "bshd"):
        for groups in (1, 4):
            for causal in (False, True):
                b, h, s, dd = (2, 8, 512, 64) if big else (1, 4, 100, 32)
                kvh = h // groups
                qs = (b, h, s, dd) if layout == "bhsd" else (b, s, h, dd)
                ks = (b, kvh, s, dd) if layout == "bhsd" else (b, s, kvh, dd)
                name = f"fa_{'mha' if groups == 1 else 'gqa'}_{layout}_{'causal' if causal else 'full'}"
                c[name] = (flash_attention, (b, h, s, dd, causal, 64, 64, 1, 128, "float16", groups, layout),
                           _fa_inputs(qs, ks),
                           _fa_ref(causal, layout, groups), 2e-2)
    db, dh, dkvh, ds, dd = (4, 32, 8, 4096, 128) if big else (1, 16, 4, 256, 32)
    c["flash_decoding"] = (flash_decoding, (db, dh, dkvh, ds, dd, 4),
                           lambda d: [_r(db, dh, dd, device=d), _r(db, ds, dkvh, dd, device=d),
                                      _r(db, ds, dkvh, dd, device=d),
                                      torch.zeros(db, dh, 4, device=d), torch.zeros(db, dh, 4, dd, device=d)],
                           _decode_ref, 2e-2)
    lb, ls, lh, ldk = (2, 512, 8, 64) if big else (1, 128, 2, 64)
    c["linear_attention"] = (linear_attention, (lb, ls, lh, ldk, ldk),
                             lambda d: [_r(lb, ls, lh, ldk, device=d, scale=0.5), _r(lb, ls, lh, ldk, device=d, scale=0.5),
                                        _r(lb, ls, lh, ldk, device=d, scale=0.5),
                                        torch.zeros(lb, ls, lh, ldk, device=d)],
                             lambda q, k, v, o: _linattn_ref(q, k, v, o)[1], 5e-2)
    return c


def check(name: str, out, ref, tol: float) -> None:
    outs = out if isinstance(out, (list, tuple)) else [out]
    refs = ref if isinstance(ref, (list, tuple)) else [ref]
    for o, r in zip(outs, refs):
        o = torch.as_tensor(o).cpu()
        r = torch.as_tensor(r).cpu()
        if not o.dtype.is_floating_point:
            assert torch.equal(o, r.to(o.dtype)), f"{name}: integer outputs differ"
            continue
        scale = max(1.0, r.float().abs().max().item())
        torch.testing.assert_close(o.float(), r.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")


_ = tilelang
