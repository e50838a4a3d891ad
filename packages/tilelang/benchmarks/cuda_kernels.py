"""The kernel sources bench_cuda.py times, written in the public TileLang style so the very same
file runs under our tilelang and under the public TileLang 0.1.15 (each in its own process).

Flash attention is examples/flash_attention.py (the repo's one copy), loaded by path. The
factories return prim_funcs (`tilelang.compile(gemm_nt(...), out_idx=[-1])`); the jit-decorated
forms `gemm_nt_jit` / `flashattn_bhsd_jit` are the usual `@tilelang.jit(out_idx=...)` entry points."""

import importlib.util
import sys
import threading
from pathlib import Path

import tilelang
import tilelang.language as T


def gemm_nt(M, N, K, block_M=128, block_N=256, block_K=32, num_stages=3, threads=256, dtype="float16",
            c_shared=False):
    """C = A @ B.T; `c_shared`: the epilogue staged through a shared tile (16-byte stores to C)."""
    accum = "float"

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared((block_N, block_K), dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum)
            T.use_swizzle(panel_size=10)
            T.clear(C_local)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                T.copy(A[by * block_M, k * block_K], A_shared)
                T.copy(B[bx * block_N, k * block_K], B_shared)
                T.gemm(A_shared, B_shared, C_local, transpose_B=True)
            if c_shared:
                C_shared = T.alloc_shared((block_M, block_N), dtype)
                T.copy(C_local, C_shared)
                T.copy(C_shared, C[by * block_M, bx * block_N])
            else:
                T.copy(C_local, C[by * block_M, bx * block_N])

    return main


_EXAMPLES_LOCK = threading.Lock()


def _load_example(name: str):
    """examples/<name>.py by path (examples/ is not a package; this runs under either tilelang). Registered only
    once it has run, under a lock: the autotuner builds candidates from several threads, and a second thread
    must not see a half-executed module (session 28's tuning run: no attribute 'flash_attention_fwd')."""
    key = f"tilelang_example_{name}"
    with _EXAMPLES_LOCK:
        if key not in sys.modules:
            path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[key] = module
        return sys.modules[key]


def flashattn_bhsd(batch, heads, seq_len, dim, is_causal, block_M=128, block_N=128, num_stages=2, threads=256,
                   dtype="float16"):
    """The repo's one flash-attention source (examples/flash_attention.py), bhsd, MHA."""
    return _load_example("flash_attention").flash_attention_fwd(batch, heads, seq_len, dim, is_causal, block_M, block_N,
                                                                num_stages, threads, dtype, layout="bhsd")


gemm_nt_jit = tilelang.jit(out_idx=[-1])(gemm_nt)
flashattn_bhsd_jit = tilelang.jit(out_idx=[3])(flashattn_bhsd)


# ---------------------------------------------------------------- autotuned entry points (issue 21 item 5)
# The candidates a GPU tuning run times per shape: tile configurations x compiler schedules (a config's
# "pass_configs"): warp-specialized TMA pipelines (the default), + TMA multicast of the B tile (cuda_ws_multicast),
# + two CTAs per SM with a producer warp (cuda_ws_two_ctas, 128 x 128 tiles), and for flash attention the split K / V
# stages (cuda_ws_split_stages) alone or with the FA3 gemm/softmax overlap (cuda_ws_overlap) and pingpong
# (cuda_ws_pingpong), at 2 or 3 stages. `gemm_nt_tuned.tune(M, N, K, dtype=...)` / `flashattn_bhsd_tuned.tune(...)`
# time them on the GPU and cache the fastest per (shape, device); a first call without tuning gets DEFAULTS: the
# fastest form per shape measured on the H200 (2026-12-02 R3 for the GEMMs, R2 for flash attention, and session 28's
# A/B where a session-27 form won by >= 2 %).
_MC, _TWO = {"cuda_ws_multicast": True}, {"cuda_ws_two_ctas": True}


def _tile(bm, bn, bk, stages, c_shared=False, pass_configs=None):
    cfg = {"block_M": bm, "block_N": bn, "block_K": bk, "num_stages": stages, "threads": 256, "c_shared": c_shared}
    return {**cfg, "pass_configs": pass_configs} if pass_configs else cfg


def gemm_tune_configs(M, N, K, **_):
    """Candidates for C = A @ B.T of one shape (the N = 2112 shape also tries the 176 / 192 wide tiles)."""
    out = [_tile(128, 256, 64, 4), _tile(128, 256, 64, 4, True), _tile(128, 256, 64, 4, False, _MC),
           _tile(128, 256, 64, 4, True, _MC)]
    if N % 256:  # a partial last 256-wide tile: narrower tiles waste less (N = 2112: 12 x 176 or 11 x 192)
        out += [_tile(128, 176, 64, 5, True), _tile(128, 192, 64, 5, True), _tile(128, 192, 64, 5, True, _MC)]
    out += [_tile(128, 128, 64, 3, False, _TWO), _tile(128, 128, 64, 3, True, _TWO)]
    return out


# (M, N, K) -> config; R3 of 2026-12-02 (docs/benchmarks/tilelang_cuda_2026-12-02_1053_r3.json); 4096 x 7168 x 2048:
# two CTAs per SM, 632 vs 595 TFLOP/s warp-specialized, 572 with multicast (session 28,
# docs/benchmarks/gpu_runs_2026-12-02_s28/r1/tlfa)
GEMM_DEFAULTS = {
    (8192, 8192, 8192): _tile(128, 256, 64, 4, False, _MC),
    (4096, 7168, 2048): _tile(128, 128, 64, 3, True, _TWO),
    (4096, 2112, 7168): _tile(128, 176, 64, 5, True),
    (4096, 24576, 1536): _tile(128, 256, 64, 4, True),
}


def _gemm_default(M, N, K, **_):
    return GEMM_DEFAULTS.get((M, N, K), _tile(128, 256, 64, 4))


def _gemm_reference(A, B):
    return (A.float() @ B.float().T).to(A.dtype)


_SPLIT, _OV, _PP = {"cuda_ws_split_stages": True}, {"cuda_ws_overlap": True}, {"cuda_ws_pingpong": True}
_FM = {"cuda_fast_exp2": True, "cuda_fmnmx": True, "cuda_tree_reduce": True}
_FMD = {"tl.enable_fast_math": True}  # the four fast float32 forms (_FM + cuda_fast_div)
FA_TUNE_CONFIGS = [
    {"num_stages": 2}, {"num_stages": 2, "pass_configs": _SPLIT}, {"num_stages": 2, "pass_configs": {**_SPLIT, **_OV}},
    {"num_stages": 2, "pass_configs": {**_SPLIT, **_OV, **_PP}}, {"num_stages": 3, "pass_configs": _OV},
    {"num_stages": 3, "pass_configs": {**_SPLIT, **_OV}}, {"num_stages": 3, "pass_configs": {**_SPLIT, **_OV, **_PP}},
    {"num_stages": 3, "pass_configs": {**_OV, **_PP}},
    # session 29: the same forms with the fast float32 softmax (backends/cuda/codegen.py MATH_OPTIONS): "fm" = one
    # MUFU.EX2 per exp2, FMNMX max, reductions over partials; "fmd" = + the fast division (= tl.enable_fast_math)
    {"num_stages": 2, "pass_configs": {**_SPLIT, **_OV, **_PP, **_FM}}, {"num_stages": 3, "pass_configs": {**_OV, **_FM}},
    {"num_stages": 3, "pass_configs": {**_OV, **_FMD}}, {"num_stages": 3, "pass_configs": {**_OV, **_PP, **_FMD}},
    {"num_stages": 2, "pass_configs": {**_SPLIT, **_OV, **_PP, **_FMD}},
]
# Session 29, R2 (docs/benchmarks/gpu_runs_2026-12-02_s29/r2/tl21; interleaved with SDPA and the previous forms, one
# H200): the fastest form per shape, each 1.07-1.11x the shape's previous default (session 28's table: ovppsp 2 st.,
# ovpp 3 st., ov 3 st., ws 2 st.): b4 s4096 full split + overlap + pingpong + fm, 2 st. (551 vs 506 TFLOP/s); causal
# overlap + fmd, 3 st. (501 vs 453); b1 s16384 full split + overlap + pingpong + fmd, 2 st. (570 vs 522); causal
# overlap + fmd, 3 st. (538 vs 504)
FA_DEFAULTS = {
    (4, 32, 4096, 128, False): FA_TUNE_CONFIGS[8], (1, 32, 16384, 128, False): FA_TUNE_CONFIGS[12],
    (4, 32, 4096, 128, True): FA_TUNE_CONFIGS[10], (1, 32, 16384, 128, True): FA_TUNE_CONFIGS[10],
}


def _fa_default(batch, heads, seq_len, dim, is_causal, **_):
    return FA_DEFAULTS.get((batch, heads, seq_len, dim, bool(is_causal)), FA_TUNE_CONFIGS[0])


def _fa_reference(is_causal):
    def ref(q, k, v):
        import torch

        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return ref


def _fa_tuned(is_causal):
    def factory(batch, heads, seq_len, dim, block_M=128, block_N=128, num_stages=2, threads=256, dtype="float16"):
        return flashattn_bhsd(batch, heads, seq_len, dim, is_causal, block_M, block_N, num_stages, threads, dtype)

    factory.__name__ = factory.__qualname__ = f"flashattn_bhsd_{'causal' if is_causal else 'full'}"
    return tilelang.autotune(configs=FA_TUNE_CONFIGS, ref_prog=_fa_reference(is_causal), atol=2e-2, rtol=2e-2,
                             defaults=lambda b, h, s, d, **kw: _fa_default(b, h, s, d, is_causal))(
        tilelang.jit(out_idx=[3], target="cuda")(factory))


gemm_nt_tuned = tilelang.autotune(configs=gemm_tune_configs, defaults=_gemm_default, ref_prog=_gemm_reference,
                                  atol=0.5, rtol=2e-2)(tilelang.jit(out_idx=[-1], target="cuda")(gemm_nt))
flashattn_bhsd_tuned = {False: _fa_tuned(False), True: _fa_tuned(True)}  # is_causal -> the tuned kernel
