"""DeepGEMM-style fp8 GEMM: D = (A * sfa) @ (B * sfb).T in bf16, with DeepSeek-V3's block scaling.

A is `[M, K]` float8_e4m3 with one float32 scale per row and 128 columns (`sfa: [M, K/128]`, the
1x128 activation recipe); B is `[N, K]` float8_e4m3 with one scale per 128x128 block (`sfb:
[N/128, K/128]`). Each 128-wide K block runs one fp8 tensor-core GEMM into a float32 partial
accumulator; the partial sum is then promoted into the main accumulator with that block's
scales (sfa[row] * sfb), as DeepGEMM does, so the fp8 MMA's limited accumulation precision
never spans more than 128 products. Written in the public TileLang's tile style.

A tile whose columns share one weight-scale row (128 % block_N == 0) multiplies by one scalar; wider
tiles (block_N = 192, 256: fewer operand bytes per FLOP) read the scale of each column's 128-block.
"""

import tilelang
import tilelang.language as T

GROUP = 128  # the scale granularity along K (and along N for B)


def fp8_gemm_program(M, N, K, block_M=128, block_N=128, num_stages=4, threads=256, swizzle=8,
                     out_dtype="bfloat16", k_pair=False, staged_epilogue=True):
    """The prim_func: A [M, K] e4m3, B [N, K] e4m3, sfa_t [ceil(K/128), M] f32 (MN-major, as DeepGEMM's TMA
    wants it: `sfa.T.contiguous()`), sfb [ceil(N/128), ceil(K/128)]
    f32 -> D [M, N] out_dtype. M, N, K need not be multiples of the tiles (edges are masked).
    `k_pair=True`: fp8_gemm_overlap_program (two K blocks per stage, overlapped promotion; num_stages counts
    pairs), so one autotuned entry covers both schedules."""
    if k_pair:
        return fp8_gemm_overlap_program(M, N, K, block_M, block_N, num_stages, threads, swizzle, out_dtype,
                                        staged_epilogue)
    block_K = GROUP
    k_blocks = T.ceildiv(K, GROUP)
    n_blocks = T.ceildiv(N, GROUP)
    in_dtype, accum = "float8_e4m3", "float"

    @T.prim_func
    def main(A: T.Tensor((M, K), in_dtype), B: T.Tensor((N, K), in_dtype),
             sfa_t: T.Tensor((k_blocks, M), "float32"), sfb: T.Tensor((n_blocks, k_blocks), "float32"),
             D: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), in_dtype)
            B_shared = T.alloc_shared((block_N, block_K), in_dtype)
            D_shared = T.alloc_shared((block_M, block_N), out_dtype)
            a_scale = T.alloc_shared((1, block_M), "float32")
            partial = T.alloc_fragment((block_M, block_N), accum)
            acc = T.alloc_fragment((block_M, block_N), accum)
            if swizzle:
                T.use_swizzle(panel_size=swizzle)
            T.clear(acc)
            for k in T.Pipelined(k_blocks, num_stages=num_stages):
                T.copy(A[by * block_M, k * block_K], A_shared)
                T.copy(B[bx * block_N, k * block_K], B_shared)
                T.copy(sfa_t[k:k + 1, by * block_M:(by + 1) * block_M], a_scale)  # rides the pipeline with A and B
                T.gemm(A_shared, B_shared, partial, transpose_B=True, clear_accum=True)
                if GROUP % block_N == 0:  # the tile's columns share one weight scale
                    b_scale = sfb[bx * block_N // GROUP, k]
                    for i, j in T.Parallel(block_M, block_N):  # promotion: fp32 FMA with this K block's scales
                        acc[i, j] += partial[i, j] * (a_scale[0, i] * b_scale)
                else:  # wider tiles (or ones straddling a 128-column block): the weight scale of each column
                    for i, j in T.Parallel(block_M, block_N):
                        acc[i, j] += partial[i, j] * (a_scale[0, i] * sfb[T.min((bx * block_N + j) // GROUP,
                                                                                n_blocks - 1), k])
            T.copy(acc, D_shared)
            T.copy(D_shared, D[by * block_M, bx * block_N])

    return main


fp8_gemm = tilelang.jit(out_idx=[-1])(fp8_gemm_program)


def fp8_gemm_overlap_program(M, N, K, block_M=128, block_N=128, num_stages=2, threads=256, swizzle=8,
                             out_dtype="bfloat16", staged_epilogue=True):
    """The same GEMM with two 128-wide K blocks per pipeline stage and two partial accumulators: both blocks'
    wgmma are issued with `wg_wait=-1` (not waited for at the gemm), so the first block's promotion runs while
    the tensor cores still work on the second; the compiler waits for each group right before its partial is
    read (and for all of them before the stage is released). Same arguments and result as fp8_gemm_program
    (block_N <= 128, 128 % block_N == 0). `staged_epilogue=False` stores the accumulator straight from registers
    (no shared tile: 32 KiB more for pipeline stages)."""
    block_K = GROUP
    k_blocks = T.ceildiv(K, GROUP)
    n_blocks = T.ceildiv(N, GROUP)
    in_dtype, accum = "float8_e4m3", "float"

    @T.prim_func
    def main(A: T.Tensor((M, K), in_dtype), B: T.Tensor((N, K), in_dtype),
             sfa_t: T.Tensor((k_blocks, M), "float32"), sfb: T.Tensor((n_blocks, k_blocks), "float32"),
             D: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A0 = T.alloc_shared((block_M, block_K), in_dtype)
            B0 = T.alloc_shared((block_N, block_K), in_dtype)
            A1 = T.alloc_shared((block_M, block_K), in_dtype)
            B1 = T.alloc_shared((block_N, block_K), in_dtype)
            s0 = T.alloc_shared((1, block_M), "float32")
            s1 = T.alloc_shared((1, block_M), "float32")
            p0 = T.alloc_fragment((block_M, block_N), accum)
            p1 = T.alloc_fragment((block_M, block_N), accum)
            acc = T.alloc_fragment((block_M, block_N), accum)
            if swizzle:
                T.use_swizzle(panel_size=swizzle)
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(k_blocks, 2), num_stages=num_stages):
                T.copy(A[by * block_M, (2 * k) * block_K], A0)
                T.copy(B[bx * block_N, (2 * k) * block_K], B0)
                T.copy(sfa_t[2 * k:2 * k + 1, by * block_M:(by + 1) * block_M], s0)
                T.copy(A[by * block_M, (2 * k + 1) * block_K], A1)  # past K (odd block count): zero-filled
                T.copy(B[bx * block_N, (2 * k + 1) * block_K], B1)
                T.copy(sfa_t[2 * k + 1:2 * k + 2, by * block_M:(by + 1) * block_M], s1)
                T.gemm(A0, B0, p0, transpose_B=True, clear_accum=True, wg_wait=-1)
                T.gemm(A1, B1, p1, transpose_B=True, clear_accum=True, wg_wait=-1)
                b0 = sfb[bx * block_N // GROUP, 2 * k]
                for i, j in T.Parallel(block_M, block_N):  # waits for p0 only: p1's wgmma still runs
                    acc[i, j] += p0[i, j] * (s0[0, i] * b0)
                b1 = sfb[bx * block_N // GROUP, T.min(2 * k + 1, k_blocks - 1)]
                for i, j in T.Parallel(block_M, block_N):
                    acc[i, j] += p1[i, j] * (s1[0, i] * b1)
            if staged_epilogue:
                D_shared = T.alloc_shared((block_M, block_N), out_dtype)
                T.copy(acc, D_shared)
                T.copy(D_shared, D[by * block_M, bx * block_N])
            else:
                T.copy(acc, D[by * block_M, bx * block_N])

    return main

# Autotuned entry point: the candidates `fp8_gemm_tuned.tune(M, N, K)` times on the GPU (best cached on disk
# per shape and device), and the default a first call builds without tuning. "pass_configs" picks compiler
# schedules: cuda_persistent (one CTA per SM loops over the tiles: the next tile's loads overlap this one's
# epilogue) and cuda_ws_pingpong (the two consumer warpgroups take turns on the tensor cores, so one
# warpgroup's promotion runs under the other's wgmma).
_TILE = {"block_M": 128, "block_N": 128, "threads": 256, "swizzle": 8}
_P, _PP = {"cuda_persistent": True}, {"cuda_persistent": True, "cuda_ws_pingpong": True}
TUNE_CONFIGS = [
    {**_TILE, "num_stages": 4},
    {**_TILE, "num_stages": 4, "pass_configs": _P},
    {**_TILE, "num_stages": 4, "pass_configs": _PP},
    {**_TILE, "k_pair": True, "num_stages": 2, "pass_configs": _P},
    {**_TILE, "k_pair": True, "num_stages": 3},
    {**_TILE, "k_pair": True, "num_stages": 3, "staged_epilogue": False, "pass_configs": _P},
]
# The fastest correct candidate per DeepSeek shape on the H200 (bench_examples.py, 2026-12-02 R2), and for
# any other shape the first of them: a first call builds these without tuning.
DEFAULTS = {
    (4096, 7168, 2048): TUNE_CONFIGS[3],
    (4096, 2112, 7168): TUNE_CONFIGS[4],
    (4096, 24576, 1536): TUNE_CONFIGS[3],
    "*": TUNE_CONFIGS[3],
}


def _tuning_reference(A, B, sfa_t, sfb):
    return reference(A, sfa_t.T, B, sfb).to(A.device)


fp8_gemm_tuned = tilelang.autotune(configs=TUNE_CONFIGS, defaults=DEFAULTS, ref_prog=_tuning_reference, atol=0.1,
                                   rtol=2e-2)(tilelang.jit(out_idx=[-1], target="cuda")(fp8_gemm_program))


# ---------------------------------------------------------------- the recipe's casts and an independent reference


def per_token_cast_to_fp8(x):
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/128)]): one scale per row and 128 columns."""
    import torch

    m, k = x.shape
    pad = (-k) % GROUP
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, GROUP)
    amax = xp.abs().amax(dim=2).clamp(min=1e-4)
    q = (xp * (448.0 / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(m, -1)[:, :k].contiguous()
    return q, (amax / 448.0).contiguous()


def per_block_cast_to_fp8(x):
    """x [N, K] -> (e4m3 [N, K], float32 scales [ceil(N/128), ceil(K/128)]): one scale per 128x128 block."""
    import torch

    n, k = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, (-k) % GROUP, 0, (-n) % GROUP))
    v = xp.view(xp.shape[0] // GROUP, GROUP, xp.shape[1] // GROUP, GROUP)
    amax = v.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    q = (v * (448.0 / amax)).to(torch.float8_e4m3fn).view_as(xp)[:n, :k].contiguous()
    return q, (amax / 448.0).view(v.shape[0], v.shape[2]).contiguous()


def reference(a, sfa, b, sfb, out_dtype=None):
    """Dequantize both operands in float32 and multiply (no per-block accumulation order: independent of the
    kernel's promotion scheme). Returns float32 unless out_dtype is given."""

    m, k = a.shape
    n = b.shape[0]
    a32 = a.float() * sfa.repeat_interleave(GROUP, dim=1)[:, :k]
    b32 = b.float() * sfb.repeat_interleave(GROUP, dim=0)[:n].repeat_interleave(GROUP, dim=1)[:, :k]
    d = a32 @ b32.T
    return d if out_dtype is None else d.to(out_dtype)


def calc_diff(x, y):
    """DeepGEMM's similarity measure: 1 - 2<x,y> / (|x|^2 + |y|^2) (0 for equal tensors)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp(min=1e-30))


def main(M: int = 256, N: int = 256, K: int = 384) -> None:
    import torch

    kernel = fp8_gemm(M, N, K)
    a, sfa = per_token_cast_to_fp8(torch.randn(M, K))
    b, sfb = per_block_cast_to_fp8(torch.randn(N, K))
    d = kernel(a, b, sfa.T.contiguous(), sfb)
    ref = reference(a, sfa, b, sfb)
    diff = calc_diff(d.float(), ref)
    assert diff < 1e-4, diff
    print(f"fp8 block-scaled GEMM {M}x{N}x{K} on {kernel.target}: calc_diff vs dequantized float32 torch = "
          f"{diff:.1e} (bf16 output; tolerance 1e-4)")


if __name__ == "__main__":
    main()
