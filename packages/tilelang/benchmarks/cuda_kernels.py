"""The kernel sources bench_cuda.py times, written in the public TileLang style so the very same
file runs under our tilelang and under the public TileLang 0.1.15 (each in its own process).

Flash attention is examples/flash_attention.py (the repo's one copy), loaded by path. The
factories return prim_funcs (`tilelang.compile(gemm_nt(...), out_idx=[-1])`); the jit-decorated
forms `gemm_nt_jit` / `flashattn_bhsd_jit` are the usual `@tilelang.jit(out_idx=...)` entry points."""

import importlib.util
import sys
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


def _load_example(name: str):
    """examples/<name>.py by path (examples/ is not a package; this runs under either tilelang)."""
    key = f"tilelang_example_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def flashattn_bhsd(batch, heads, seq_len, dim, is_causal, block_M=128, block_N=128, num_stages=2, threads=256,
                   dtype="float16"):
    """The repo's one flash-attention source (examples/flash_attention.py), bhsd, MHA."""
    return _load_example("flash_attention").flash_attention_fwd(batch, heads, seq_len, dim, is_causal, block_M, block_N,
                                                                num_stages, threads, dtype, layout="bhsd")


gemm_nt_jit = tilelang.jit(out_idx=[-1])(gemm_nt)
flashattn_bhsd_jit = tilelang.jit(out_idx=[3])(flashattn_bhsd)
