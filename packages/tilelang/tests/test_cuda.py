"""The CUDA backend.

CI (no GPU): every example, every public-style kernel (public_kernels.py) and the property-test
programs compile to sm_90a cubins with NVRTC, and their generated CUDA runs on CPU threads
(target "cuda_emu": a std::thread per CUDA thread, barriers, warp shuffles, ldmatrix and
mma.sync emulated) matching torch / the interpreter. Bad GPU programs raise CompileError naming
file:line. GPU (`gpu` marker): the same kernels on the H200 (target "cuda" and "auto" with CUDA
tensors) match torch; the property test gives cuda == interp.

Tolerances: fp16/bf16 outputs 2e-2..3e-2 relative to max(1, |ref|max); fp32 1e-4; integers exact.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tilehal
import tilelang
import tilelang.language as T
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _load_module(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


pk = _load_module("tilelang_public_kernels", "public_kernels.py")
prop = _load_module("tilelang_property_programs", "test_property.py")

HAVE_NVRTC = tilehal.jit.cuda.compiler_versions()["nvrtc"] is not None or tilehal.jit.cuda.compiler_versions()["nvcc"]
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="no NVRTC/nvcc to build cubins")

SMALL = pk.cases("small")
GPU = pk.cases("gpu")
SLOW_EMU = {"fa_mha_bshd_full", "fa_gqa_bshd_full", "fa_mha_bhsd_causal", "fa_gqa_bhsd_full"}


def _compile(fac, args, target, pass_configs=None):
    return tilelang.compile(fac.get_tir(*args), out_idx=fac.out_idx, target=target, pass_configs=pass_configs)


def _run_case(name, spec, target, device, pass_configs=None):
    fac, args, make, ref, tol = spec
    k = _compile(fac, args, target, pass_configs)
    torch.manual_seed(0)
    inputs = make(device)
    keep = [x.clone() for x in inputs]
    out = k(*inputs)
    expect = ref(*keep)
    pk.check(name, out, expect, tol)
    if name == "linear_attention":  # O is accumulated in place (atomics), final_state returned
        o_ref, _ = pk._linattn_ref(*keep)
        pk.check(name + " O", inputs[3], o_ref, tol)
    return k


# ---------------------------------------------------------------- compile (NVRTC, sm_90a)


@needs_nvrtc
@pytest.mark.parametrize("name", sorted(GPU))
def test_public_kernel_compiles(name):
    fac, args, *_ = GPU[name]
    k = _compile(fac, args, "cuda")
    src = k.get_kernel_source()
    assert "__global__" in src and k._impl.module.cubin[:4] == b"\x7fELF"
    if name.startswith(("gemm", "fa_", "flash", "linear")) and name != "gemv":
        assert ("mma_m16n8k16" in src and "ldmatrix" in src) or "Wgmma" in src, f"{name} does not use the tensor cores"
    if name.startswith(("gemm", "fa_")):
        assert "cp_async" in src or "tma_load_2d" in src


EXAMPLES = [
    ("gemm", "matmul", (256, 256, 256, 64, 64, 32)),
    ("gemm", "matmul", (100, 72, 40, 64, 64, 32)),
    ("gemm_relu", "matmul_relu", (1024, 1024, 1024)),
    ("elementwise_add", "elementwise_add", (70, 130)),
    ("softmax", "softmax", (37, 96, 8, "bfloat16")),
    ("rmsnorm", "rms_norm", (13, 80)),
    ("flash_attention", "flashattn", (4, 32, 4096, 128, True, 128, 128, 2, 256, "float16")),
    ("flash_attention", "flashattn", (2, 1, 96, 16, True, 32, 32, 1, 128, "float32")),
]


@needs_nvrtc
@pytest.mark.parametrize("mod,fn,args", EXAMPLES, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(EXAMPLES)])
def test_example_compiles(example, mod, fn, args):
    f = getattr(example(mod), fn)
    k = tilelang.compile(f.get_tir(*args), out_idx=f.out_idx, target="cuda")
    assert "__global__" in k.get_kernel_source()


# ---------------------------------------------------------------- run on CPU threads (cuda_emu)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EMU else n
                                  for n in sorted(SMALL)])
def test_public_kernel_emulated(name):
    _run_case(name, SMALL[name], "cuda_emu", "cpu")


@pytest.mark.parametrize("seq_len,causal", [(128, False), (100, True)])
def test_flash_attention_example_emulated(example, seq_len, causal):
    m = example("flash_attention")
    k = tilelang.compile(m.flashattn.get_tir(1, 2, seq_len, 32, causal), out_idx=[3], target="cuda_emu")
    q, kk, v = (torch.randn(1, seq_len, 2, 32).half() for _ in range(3))
    torch.testing.assert_close(k(q, kk, v).float(), m.reference(q, kk, v, causal).float(), rtol=2e-2, atol=2e-2)


def test_examples_emulated(example):
    m = example("softmax")
    k = tilelang.compile(m.softmax.get_tir(37, 96, 8, "float32"), out_idx=[-1], target="cuda_emu")
    x = torch.randn(37, 96)
    torch.testing.assert_close(k(x), m.reference(x), rtol=1e-5, atol=1e-5)
    m = example("gemm")
    k = tilelang.compile(m.matmul.get_tir(100, 72, 40, 64, 64, 32), out_idx=[-1], target="cuda_emu")
    a, b = torch.randn(100, 40), torch.randn(40, 72)
    torch.testing.assert_close(k(a, b), a @ b, rtol=1e-4, atol=1e-4)


def _prop_case(prog, seed, target):
    dtype, (M, N), source = prog
    func = prop._load(source)
    rng = np.random.default_rng(seed)
    npd = tilehal.to_numpy_dtype(dtype)
    if dtype == "int32":
        a, b = (rng.integers(-5, 6, size=(M, N)).astype(npd) for _ in range(2))
    else:
        a, b = (rng.standard_normal((M, N)).astype(np.float32).astype(npd) for _ in range(2))
    want = np.asarray(tilelang.compile(func, out_idx=[2], target="interp")(a, b)).astype(np.float64)
    k = tilelang.compile(func, out_idx=[2], target=target)
    if target == "cuda":
        ta, tb = (torch.from_numpy(np.ascontiguousarray(x).view(np.int16 if x.dtype.itemsize == 2 and dtype != "int32"
                                                                else x.dtype)) for x in (a, b))
        if dtype in ("float16", "bfloat16"):
            ta, tb = (t.view(getattr(torch, dtype)) for t in (ta, tb))
        got = k(ta.cuda(), tb.cuda()).float().cpu().numpy().astype(np.float64)
    else:
        got = np.asarray(k(a, b)).astype(np.float64)
    tol = prop.TOL[dtype] * (10 if "gemm" in source else 1)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, equal_nan=True, err_msg=f"program:\n{source}")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prop.programs(), st.integers(0, 2**31 - 1))
def test_property_emulated_matches_interp(prog, seed):
    _prop_case(prog, seed, "cuda_emu")


@needs_nvrtc
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prop.programs())
def test_property_programs_compile(prog):
    tilelang.compile(prop._load(prog[2]), out_idx=[2], target="cuda")


# ---------------------------------------------------------------- gemm variants (wgmma and mma.sync paths)


def _gemm_program(M, N, K, bm, bn, bk, dtype, acc, ta, tb, stages, threads, policy, a_frag=False, dyn_m=False,
                  swizzle=0):
    Mdim = T.dynamic("M") if dyn_m else M
    a_shape = (K, Mdim) if ta else (Mdim, K)
    b_shape = (N, K) if tb else (K, N)
    a_tile = (bk, bm) if ta else (bm, bk)
    b_tile = (bn, bk) if tb else (bk, bn)

    @T.prim_func
    def main(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor((Mdim, N), acc)):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(Mdim, bm), threads=threads) as (bx, by):
            As = T.alloc_shared(a_tile, dtype)
            Bs = T.alloc_shared(b_tile, dtype)
            Af = T.alloc_fragment((bm, bk), dtype)
            Cf = T.alloc_fragment((bm, bn), acc)
            if swizzle:
                T.use_swizzle(panel_size=swizzle)
            T.clear(Cf)
            for k in T.Pipelined(T.ceildiv(K, bk), num_stages=stages):
                if ta:
                    T.copy(A[k * bk, by * bm], As)
                else:
                    T.copy(A[by * bm, k * bk], As)
                if tb:
                    T.copy(B[bx * bn, k * bk], Bs)
                else:
                    T.copy(B[k * bk, bx * bn], Bs)
                if a_frag:
                    T.copy(As, Af)
                    T.gemm(Af, Bs, Cf, transpose_B=tb, policy=policy)
                else:
                    T.gemm(As, Bs, Cf, transpose_A=ta, transpose_B=tb, policy=policy)
            T.copy(Cf, C[by * bm, bx * bn])

    return main


GEMM_VARIANTS = {  # M, N, K, tile, dtype, accumulator, transpose_A, transpose_B, stages, threads, policy, A in regs
    "nn_f16_square_edges": (96, 80, 96, 64, 64, 32, "float16", "float32", False, False, 2, 128, "Square"),
    "tn_f16": (64, 64, 64, 64, 64, 32, "float16", "float32", True, False, 1, 128, "Square"),
    "tt_bf16_3stage": (128, 64, 160, 64, 64, 32, "bfloat16", "float32", True, True, 3, 128, "Square"),
    "nt_bf16_fullcol": (64, 128, 64, 64, 128, 32, "bfloat16", "float32", False, True, 2, 128, "FullCol"),
    "nt_e4m3": (64, 64, 128, 64, 64, 64, "float8_e4m3", "float32", False, True, 2, 128, "Square"),
    "nt_e5m2": (64, 64, 128, 64, 64, 64, "float8_e5m2", "float32", False, True, 2, 128, "Square"),
    "nt_int8": (64, 64, 128, 64, 64, 64, "int8", "int32", False, True, 2, 128, "Square"),
    "a_in_registers_square": (64, 64, 64, 64, 64, 32, "float16", "float32", False, False, 2, 128, "Square", True),
    "a_in_registers_fullrow": (128, 64, 64, 128, 64, 32, "float16", "float32", False, True, 2, 256, "FullRow", True),
    "f32_cuda_cores": (40, 24, 20, 32, 16, 16, "float32", "float32", False, False, 2, 64, "Square"),
    "dynamic_m": (100, 64, 64, 64, 64, 32, "float16", "float32", False, True, 2, 128, "Square", False, True),
    # wgmma forms (sm_90a): 128-byte rows; B N-major in 64-element atoms; A M-major; K rows of two atoms;
    # 64-byte rows (64B swizzle); two m64 blocks per warpgroup; warpgroups split along N; bf16 A in registers
    "wg_nt_f16_2wg": (256, 256, 128, 128, 256, 64, "float16", "float32", False, True, 3, 256, "Square"),
    "wg_nn_bf16_natoms": (128, 256, 128, 64, 256, 64, "bfloat16", "float32", False, False, 2, 128, "Square"),
    "wg_tn_f16_mmajor": (128, 128, 128, 64, 128, 64, "float16", "float32", True, False, 2, 128, "Square"),
    "wg_nt_bf16_k128": (128, 128, 256, 64, 128, 128, "bfloat16", "float32", False, True, 2, 128, "Square"),
    "wg_nt_f16_k32_sw64": (128, 128, 96, 128, 128, 32, "float16", "float32", False, True, 3, 128, "Square"),
    "wg_nt_f16_n_split": (64, 256, 64, 64, 256, 64, "float16", "float32", False, True, 2, 256, "Square"),
    "wg_a_regs_bf16": (128, 128, 64, 128, 128, 64, "bfloat16", "float32", False, True, 2, 256, "FullRow", True),
    "wg_nt_e4m3_k128": (128, 256, 256, 128, 256, 128, "float8_e4m3", "float32", False, True, 2, 256, "Square"),
}
FAST_GEMM = {"nn_f16_square_edges", "tt_bf16_3stage", "nt_e4m3", "nt_int8", "a_in_registers_fullrow", "dynamic_m"}
_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
          "float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _gemm_variant(name, target, device, pass_configs=None):
    c = GEMM_VARIANTS[name]
    M, N, K, _, _, _, dtype, _, ta, tb = c[:10]
    k = tilelang.compile(_gemm_program(*c), out_idx=[2], target=target, pass_configs=pass_configs)
    src = k.get_kernel_source()
    assert ("mma_m16n8k" in src or "Wgmma" in src) == (dtype != "float32"), name
    if name.startswith("wg_"):
        assert ("Wgmma" in src) == (target == "cuda" and not (pass_configs or {}).get("tl.disable_wgmma")), name
    g = torch.Generator().manual_seed(0)
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    if dtype == "int8":
        a = torch.randint(-8, 8, a_shape, dtype=torch.int8, generator=g)
        b = torch.randint(-8, 8, b_shape, dtype=torch.int8, generator=g)
    else:
        a = torch.randn(a_shape, generator=g).to(_TORCH[dtype])
        b = torch.randn(b_shape, generator=g).to(_TORCH[dtype])
    out = k(a.to(device), b.to(device)).cpu()
    ref = (a.double().T if ta else a.double()) @ (b.double().T if tb else b.double())
    tol = 0 if dtype == "int8" else 1e-3 * max(1.0, ref.abs().max().item())
    assert (out.double() - ref).abs().max().item() <= tol, name


@needs_nvrtc
@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_gemm_variant_compiles(name):
    src = tilelang.compile(_gemm_program(*GEMM_VARIANTS[name]), out_idx=[2], target="cuda").get_kernel_source()
    assert "__global__" in src
    if name.startswith("wg_"):
        assert "Wgmma" in src and ("fence_proxy_async_shared" in src or "mbarrier_wait(&_full" in src), name


@needs_nvrtc
def test_wgmma_choice_logged(caplog, tmp_path, monkeypatch):
    """The wgmma / mma.sync choice is logged at DEBUG with the reason (by the build that generates the code:
    an empty kernel cache here); tl.disable_wgmma keeps mma.sync."""
    import logging

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    prog = _gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"])
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        tilelang.compile(prog, out_idx=[2], target="cuda")
    assert any("wgmma.mma_async (A K, B K-major, warpgroups 2x1)" in r.getMessage() for r in caplog.records)
    src = tilelang.compile(prog, out_idx=[2], target="cuda",
                           pass_configs={"tl.disable_wgmma": True}).get_kernel_source()
    assert "Wgmma16" not in src and "mma_m16n8k16" in src
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        src = tilelang.compile(_gemm_program(*GEMM_VARIANTS["nt_e5m2"]), out_idx=[2], target="cuda").get_kernel_source()
    assert "Wgmma16" not in src
    assert any("not wgmma: wgmma is emitted for fp16 / bf16 / fp8 e4m3" in r.getMessage() for r in caplog.records)


@needs_nvrtc
def test_use_wgmma_option():
    """T.gemm(use_wgmma=False) keeps mma.sync; use_wgmma=True on a gemm wgmma cannot run is a CompileError."""

    def prog(dtype, use):
        @T.prim_func
        def main(A: T.Tensor((128, 64), dtype), B: T.Tensor((128, 64), dtype), C: T.Tensor((128, 128), "float32")):
            with T.Kernel(1, threads=256) as bx:
                As = T.alloc_shared((128, 64), dtype)
                Bs = T.alloc_shared((128, 64), dtype)
                Cf = T.alloc_fragment((128, 128), "float32")
                T.copy(A, As)
                T.copy(B, Bs)
                T.gemm(As, Bs, Cf, transpose_B=True, clear_accum=True, use_wgmma=use)
                T.copy(Cf, C)

        return main

    src = tilelang.compile(prog("float16", False), out_idx=[2], target="cuda").get_kernel_source()
    assert "Wgmma16" not in src and "mma_m16n8k16" in src
    src = tilelang.compile(prog("float16", True), out_idx=[2], target="cuda").get_kernel_source()
    assert "Wgmma16" in src
    with pytest.raises(tilelang.CompileError, match="use_wgmma=True.*fp16 / bf16"):
        tilelang.compile(prog("float8_e5m2", True), out_idx=[2], target="cuda")


@pytest.mark.parametrize("name", [n if n in FAST_GEMM else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(GEMM_VARIANTS)])
def test_gemm_variant_emulated(name):
    _gemm_variant(name, "cuda_emu", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["default", "mma.sync"])
@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_gemm_variant_gpu(name, path):
    _gemm_variant(name, "cuda", "cuda", {"tl.disable_wgmma": True} if path == "mma.sync" else None)


ONE_BARRIER = {"cuda_wgmma_one_barrier": True}
WS = {"cuda_warp_specialize": True}  # a producer warpgroup feeds the TMA pipeline (opt-in)
WSP = {**WS, "cuda_persistent": True}  # ... and one block per SM loops over the grid's tiles (opt-in)
WSPP = {**WS, "cuda_ws_pingpong": True}  # ... the two consumer warpgroups take turns (opt-in)
SPLIT = {"cuda_ws_split_stages": True}  # flash attention's K and V stages on their own mbarriers (opt-in, session 27)
_WS_CFG = {"default": None, "ws": WS, "wsp": WSP, "pp": WSPP, "ppp": {**WSP, **WSPP},
           "ov": {**WS, "cuda_ws_overlap": True}, "ovpp": {**WSPP, "cuda_ws_overlap": True},
           "ovp": {**WSP, "cuda_ws_overlap": True}, "sp": {**WS, **SPLIT}, "spp": {**WSP, **SPLIT},
           "ppsp": {**WSPP, **SPLIT}, "ovsp": {**WS, "cuda_ws_overlap": True, **SPLIT},
           "ovppsp": {**WSPP, "cuda_ws_overlap": True, **SPLIT}}
# session 29: the fast softmax forms (cuda_fast_exp2 + cuda_fmnmx + cuda_tree_reduce) on top of a form
FAST_MATH = {"cuda_fast_exp2": True, "cuda_fmnmx": True, "cuda_tree_reduce": True}
_WS_CFG["povppsp"] = {**_WS_CFG["ovppsp"], **WSP}  # ... and persistent
_WS_CFG.update({f"{f}fm": {**_WS_CFG[f], **FAST_MATH} for f in ("ws", "ovpp", "ovppsp", "povppsp", "ppp")})
# ... and the fast division: all four, as tl.enable_fast_math gives them
_WS_CFG.update({f"{f}fmd": {**_WS_CFG[f], "tl.enable_fast_math": True} for f in ("ws", "ov", "ovpp", "ovppsp")})
# ... and a producer thread per split group (cuda_ws_split_producers)
_WS_CFG.update({f"{f}p": {**_WS_CFG[f], "cuda_ws_split_producers": True} for f in ("ovppspfm", "ovppspfmd", "spp")})
CP_ASYNC = {"tl.disable_tma_lower": True}  # pipelined copies on cp.async
TMA = {"cuda_tma": True, "tl.disable_warp_specialized": True}  # TMA pipelines, every thread in one role
DEEP_WGMMA = sorted(n for n in GEMM_VARIANTS if n.startswith("wg_") and GEMM_VARIANTS[n][10] >= 3)


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["tma", "cp.async"])
@pytest.mark.parametrize("name", DEEP_WGMMA)
def test_gemm_one_barrier_gpu(name, copies):
    _gemm_variant(name, "cuda", "cuda", {**ONE_BARRIER, **(TMA if copies == "tma" else CP_ASYNC)})


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_gemm_variant_tma_plain_gpu(name):
    """Every gemm variant with its pipelined copies on TMA, not warp-specialized (tl.disable_warp_specialized)."""
    _gemm_variant(name, "cuda", "cuda", TMA)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_gemm_variant_cp_async_gpu(name):
    """Every gemm variant with its pipelined copies on cp.async (tl.disable_tma_lower)."""
    _gemm_variant(name, "cuda", "cuda", CP_ASYNC)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["ws", "wsp"])
@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_gemm_variant_ws_gpu(name, cfg):
    """Every gemm variant warp-specialized (and persistent) where it can be (the others as by default)."""
    _gemm_variant(name, "cuda", "cuda", WS if cfg == "ws" else WSP)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
def test_gemm_persistent_many_tiles_gpu(stages):
    """A persistent warp-specialized gemm with more tiles than SMs (16 x 24 = 384 on 132 SMs): every block
    runs several tiles, the stage phases continue across them, and an edge row of tiles is partial."""
    M, N, K = 2000, 3072, 320
    k = tilelang.compile(_gemm_program(M, N, K, 128, 128, 64, "float16", "float32", False, True, stages, 256,
                                       "Square"), out_idx=[2], target="cuda", pass_configs=WSP)
    assert list(k._impl.launch_threads.values()) == [[384, 16 * 24]]
    g = torch.Generator().manual_seed(1)
    a = torch.randn(M, K, generator=g).half()
    b = torch.randn(N, K, generator=g).half()
    out = k(a.cuda(), b.cuda()).cpu().double()
    ref = a.double() @ b.double().T
    assert (out - ref).abs().max().item() <= 1e-3 * max(1.0, ref.abs().max().item())


WSM = {**WS, "cuda_ws_multicast": True}  # ... and 2-CTA clusters share the B tile through TMA multicast (opt-in)


@needs_nvrtc
def test_ws_multicast_codegen(caplog, tmp_path, monkeypatch):
    """cuda_ws_multicast: blockIdx.y pairs form 2-CTA clusters that share the B tile (its coordinates do not use
    by): each producer loads its half of the rows with one multicast TMA per atom column into both CTAs, the
    empty barriers count both CTAs' consumer warps (each arrives on both), the CTAs meet at the start and
    before exiting, the launch asks for clusters (1, 2, 1); by = 2 * pair + rank through T.use_swizzle's
    panels. An odd second grid dim keeps the plain kernel (logged)."""
    import logging

    from tilehal import compile_cuda

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    prog = _gemm_program(1024, 768, 512, 128, 256, 64, "bfloat16", "float32", False, True, 4, 256, "Square",
                         swizzle=2)
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        k = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=WSM)
    assert any("TMA multicast: clusters of 2 CTAs" in r.getMessage() for r in caplog.records)
    src = k.get_kernel_source()
    (name, _, _), = k._impl.kernels
    assert k._impl.launch_threads == {name: [384, 0, [1, 2, 1]]}
    assert src.count("tma_load_2d_multicast(") == 1 and src.count("tma_load_2d(") == 1
    assert "_cta_rank * 128" in src and "mbarrier_init(&_empty1[_s], 16)" in src
    assert src.count("tilehal::cluster_sync();") == 3 and src.count("tl_mbar_arrive_peer(&_empty1") == 1
    assert "const int by = (2 * _sy + (int)(blockIdx.y & 1));" in src
    log = compile_cuda(src, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    # a kernel-cache hit keeps the cluster dims (before session 27 the entry's 3-element launch record did not
    # unpack: every multicast kernel was generated again)
    again = tilelang.JITKernel(prog, out_idx=[2], target="cuda", pass_configs=WSM)
    assert again._impl.from_kernel_cache and again._impl.launch_threads == {name: [384, 0, [1, 2, 1]]}
    odd = _gemm_program(640, 768, 512, 128, 256, 64, "bfloat16", "float32", False, True, 4, 256, "Square")
    k2 = tilelang.compile(odd, out_idx=[2], target="cuda", pass_configs=WSM)
    assert "multicast" not in k2.get_kernel_source() and list(k2._impl.launch_threads.values()) == [[384, 0]]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1000, 768, 512, 256, 4, "float16", 0), (1024, 576, 704, 192, 5, "bfloat16", 10),
                                  (512, 1024, 256, 256, 2, "bfloat16", 3)])
def test_gemm_ws_multicast_gpu(case):
    """TMA multicast of the B tile across 2-CTA clusters (cuda_ws_multicast) vs float64: partial edge rows of A,
    192-wide tiles (half = 96 rows), 2..5 stages, with and without T.use_swizzle."""
    M, N, K, bn, stages, dtype, swz = case
    k = tilelang.compile(_gemm_program(M, N, K, 128, bn, 64, dtype, "float32", False, True, stages, 256, "Square",
                                       swizzle=swz), out_idx=[2], target="cuda", pass_configs=WSM)
    assert "tma_load_2d_multicast" in k.get_kernel_source()
    g = torch.Generator().manual_seed(4)
    tdt = getattr(torch, dtype)
    a = torch.randn(M, K, generator=g).to(tdt)
    b = torch.randn(N, K, generator=g).to(tdt)
    out = k(a.cuda(), b.cuda()).cpu().double()
    ref = a.double() @ b.double().T
    assert (out - ref).abs().max().item() <= 1e-3 * max(1.0, ref.abs().max().item())


TWO = {"cuda_ws_two_ctas": True}  # two warp-specialized CTAs per SM, a producer warp (opt-in, session 27)
TWO_CASES = [(1000, 768, 512, 128, 3, "float16", 0), (1024, 2112, 704, 128, 3, "bfloat16", 10),
             (512, 1024, 256, 128, 2, "bfloat16", 3)]


@needs_nvrtc
def test_ws_two_ctas_codegen(caplog, tmp_path, monkeypatch):
    """cuda_ws_two_ctas: a warp-specialized GEMM with 128 x 128 tiles (3 stages, 96 KiB) gets a producer warp
    (T + 32 threads), no setmaxnreg and __launch_bounds__(288, 2); ptxas fits it in 65536 / 576 registers per
    thread without spills (with a producer warpgroup it could not: 80 registers). Where two CTAs do not fit
    (128 x 256 x 64, 4 stages: 192 KiB), the kernel is exactly the default one."""
    import logging

    from tilehal import compile_cuda

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    M, N, K, bn, stages, dtype, swz = TWO_CASES[1]
    prog = _gemm_program(M, N, K, 128, bn, 64, dtype, "float32", False, True, stages, 256, "Square", swizzle=swz)
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        k = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=TWO)
    assert any("two warp-specialized CTAs per SM" in r.getMessage() for r in caplog.records)
    src = k.get_kernel_source()
    assert "__launch_bounds__(288, 2)" in src and "setmaxnreg" not in src and "if (_tx >= 256)" in src
    assert list(k._impl.launch_threads.values()) == [[288, 0]]
    (name, _, smem), = k._impl.kernels
    assert 2 * (smem + 1024) <= 228 * 1024
    log = compile_cuda(src, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    assert int(re.findall(r"Used (\d+) registers", log)[0]) <= 112, log
    big = _gemm_program(1024, 1024, 1024, 128, 256, 64, dtype, "float32", False, True, 4, 256, "Square")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        kb = tilelang.compile(big, out_idx=[2], target="cuda", pass_configs=TWO)
    assert any("cuda_ws_two_ctas not applied" in r.getMessage() for r in caplog.records)
    assert kb.get_kernel_source() == tilelang.compile(big, out_idx=[2], target="cuda").get_kernel_source()
    caplog.clear()  # persistent kernels keep their producer warpgroup (one CTA per SM by design; logged)
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        kp = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs={**TWO, **WSP})
    assert "(288, 2)" not in kp.get_kernel_source() and any(
        "cuda_ws_two_ctas not applied): a persistent kernel" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TWO_CASES)
def test_gemm_ws_two_ctas_gpu(case):
    """Two warp-specialized CTAs per SM (cuda_ws_two_ctas) vs float64: partial edge tiles, 2-3 stages, with
    and without T.use_swizzle."""
    M, N, K, bn, stages, dtype, swz = case
    k = tilelang.compile(_gemm_program(M, N, K, 128, bn, 64, dtype, "float32", False, True, stages, 256, "Square",
                                       swizzle=swz), out_idx=[2], target="cuda", pass_configs=TWO)
    assert "__launch_bounds__(288, 2)" in k.get_kernel_source()
    g = torch.Generator().manual_seed(5)
    tdt = getattr(torch, dtype)
    a = torch.randn(M, K, generator=g).to(tdt)
    b = torch.randn(N, K, generator=g).to(tdt)
    out = k(a.cuda(), b.cuda()).cpu().double()
    ref = a.double() @ b.double().T
    assert (out - ref).abs().max().item() <= 1e-3 * max(1.0, ref.abs().max().item())


FA_LAYOUT_FALLBACK = [(1, 2, 256, 32, False, 128, 128, 2, 128), (1, 2, 256, 32, True, 64, 64, 2, 256)]


@needs_nvrtc
def test_wgmma_layout_conflict_falls_back_to_mma(example, caplog, tmp_path, monkeypatch):
    """Flash attention with two m64 blocks per warpgroup (128 rows, 128 threads) or 64 rows on 256 threads:
    the wgmma accumulator layouts of its two gemms cannot be inferred together, so the kernel keeps mma.sync
    (logged at DEBUG) instead of failing to compile (reported by tlthread, 2026-12-02)."""
    import logging

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    m = example("flash_attention")
    for args in FA_LAYOUT_FALLBACK:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
            k = tilelang.compile(m.flash_attention_fwd(*args, "float16", layout="bhsd"), out_idx=[3], target="cuda")
        src = k.get_kernel_source()
        assert "Wgmma" not in src and "mma_m16n8k16" in src, args
        assert any("T.gemm on mma.sync in this kernel" in r.getMessage() for r in caplog.records), args


@pytest.mark.gpu
@pytest.mark.parametrize("args", FA_LAYOUT_FALLBACK)
def test_wgmma_layout_conflict_fallback_gpu(example, args):
    m = example("flash_attention")
    k = tilelang.compile(m.flash_attention_fwd(*args, "float16", layout="bhsd"), out_idx=[3], target="cuda")
    b, h, s_, d, causal = args[:5]
    g = torch.Generator().manual_seed(4)
    q, kk, v = (torch.randn(b, h, s_, d, generator=g).half().cuda() for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), v.float(), is_causal=causal)
    assert (k(q, kk, v).float() - ref).abs().max().item() <= 2e-2


@pytest.mark.parametrize("causal,seq", [(True, 256), (True, 200), (False, 200)])
def test_masked_fill_unswitched(example, causal, seq):
    """The causal / partial-tile mask fill of flash attention is unswitched: one uniform test of the tile's
    corner (`bx * bm - k * bn - (bn - 1) >= 0` for causal) stores zeros for the whole tile, else the per-element
    select; the result is the same (CPU threads, cp.async pipeline, vs SDPA in float32)."""
    m = example("flash_attention")
    k = tilelang.compile(m.flash_attention_fwd(1, 2, seq, 64, causal, 64, 64, 2, 128, "float16", layout="bhsd"),
                         out_idx=[3], target="cuda_emu")
    src = k.get_kernel_source()
    assert "else {" in src and ("-INFINITY" in src)
    if causal:
        assert "+ -63) >= 0)) {" in src
    g = torch.Generator().manual_seed(5)
    q, kk, v = (torch.randn(1, 2, seq, 64, generator=g).half() for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), v.float(), is_causal=causal)
    assert (k(q, kk, v).float() - ref).abs().max().item() <= 2e-2
    full = m.flash_attention_fwd(1, 2, 256, 64, False, 64, 64, 2, 128, "float16", layout="bhsd")  # T.clear: nothing
    kf = tilelang.compile(full, out_idx=[3], target="cuda_emu")
    assert "else {" not in kf.get_kernel_source()
    # ... and its T.clear(acc_s) before the S gemm is the gemm's clear_accum (fold_clears): same attention
    src_full = tilelang.compile(m.flash_attention_fwd(4, 32, 4096, 128, False, 128, 128, 2, 256, "float16",
                                                      layout="bhsd"), out_idx=[3], target="cuda").get_kernel_source()
    loop = src_full[src_full.index("mbarrier_wait(&_full"):]
    assert "(_kk > 0)" in loop[:loop.index("reduce_max")] and "acc_s[_i] = 0.0f" not in loop[:loop.index("reduce_max")]
    q, kk, v = (torch.randn(1, 2, 256, 64, generator=g).half() for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), v.float())
    assert (kf(q, kk, v).float() - ref).abs().max().item() <= 2e-2


@needs_nvrtc
def test_longest_blocks_first(example):
    """Causal flash attention's KV loop runs ~bx + 1 iterations: bx is dispatched from its largest value down
    (plain and persistent forms); the non-causal loop and a GEMM keep the hardware order."""
    m = example("flash_attention")

    def src(causal, cfg=None):
        func = m.flash_attention_fwd(4, 32, 4096, 128, causal, 128, 128, 2, 256, "float16", layout="bhsd")
        return tilelang.compile(func, out_idx=[3], target="cuda", pass_configs=cfg).get_kernel_source()

    assert "const int bx = (gridDim.x - 1 - blockIdx.x);" in src(True)
    assert "const int bx = (32 - 1 - (_tile % 32));" in src(True, WSP)
    assert "const int bx = blockIdx.x;" in src(False)
    gemm = tilelang.compile(_gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"]), out_idx=[2], target="cuda")
    assert "gridDim.x - 1" not in gemm.get_kernel_source()
    # the reversed order computes the same attention (CPU threads: cp.async pipeline, 4 query blocks)
    k = tilelang.compile(m.flash_attention_fwd(1, 2, 256, 64, True, 64, 64, 2, 128, "float16", layout="bhsd"),
                         out_idx=[3], target="cuda_emu")
    assert "gridDim.x - 1 - blockIdx.x" in k.get_kernel_source()
    g = torch.Generator().manual_seed(3)
    q, kk, v = (torch.randn(1, 2, 256, 64, generator=g).half() for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), v.float(), is_causal=True)
    assert (k(q, kk, v).float() - ref).abs().max().item() <= 2e-2


@needs_nvrtc
def test_warp_specialized_codegen(caplog, tmp_path, monkeypatch, example):
    """cuda_warp_specialize: a TMA pipeline gets a producer warpgroup (threads T..T+127, one issuing thread,
    `empty` / `full` mbarriers per stage, setmaxnreg when T + 128 > 256) launched on top of the T.Kernel's
    threads; the consumers' barriers are named barrier 1 over T threads; the choice is logged at DEBUG;
    tl.disable_warp_specialized and a cp.async pipeline keep the plain form."""
    import logging

    from tilehal import compile_cuda

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    prog = _gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"])
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        k = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=WS)
    assert any("warp-specialized: a producer warpgroup" in r.getMessage() for r in caplog.records)
    src = k.get_kernel_source()
    (name, _, _), = k._impl.kernels
    assert k._impl.launch_threads == {name: [384, 0]} and "__launch_bounds__(384, 1)" in src
    assert "setmaxnreg_dec<40>" in src and "setmaxnreg_inc<232>" in src and "if (_tx == 256)" in src
    body = src[src.index("return;"):]
    assert "__syncthreads" not in body and "mbarrier_arrive(&_empty" in body
    assert src.count("tma_load_2d(") == 2  # the producer's loop only
    assert "0 bytes spill stores" in compile_cuda(src, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
    for cfg in ({**WS, "tl.disable_warp_specialized": True}, {**WS, "tl.disable_tma_lower": True}):
        k2 = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=cfg)
        assert not k2._impl.launch_threads and "setmaxnreg" not in k2.get_kernel_source()
    m = example("flash_attention")
    fa = tilelang.compile(m.flash_attention_fwd(4, 32, 4096, 128, True, 128, 128, 2, 256, "float16", layout="bhsd"),
                          out_idx=[3], target="cuda", pass_configs=WS)
    assert list(fa._impl.launch_threads.values()) == [[384, 0]] and fa.get_kernel_source().count("tma_load_2d(") == 4
    # persistent: the producer and the consumers loop over the 2 x 1 tiles of the grid, the stages share no bytes
    kp = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=WSP)
    srcp = kp.get_kernel_source()
    assert list(kp._impl.launch_threads.values()) == [[384, 1 * 2]]
    assert srcp.count("for (int _tile = blockIdx.x; _tile < 2; _tile += gridDim.x)") == 2 and "_kb += " in srcp
    logp = compile_cuda(srcp, arch="sm_90a", name=list(kp._impl.launch_threads)[0], options=["--ptxas-options=-v"]).log
    assert re.findall(r"(\d+) bytes spill stores", logp) == ["0"], logp
    # pingpong: flash attention's two consumer warpgroups take turns issuing S = Q K^T (named barriers 2, 3)
    fa_pp = m.flash_attention_fwd(4, 32, 4096, 128, False, 128, 128, 2, 256, "float16", layout="bhsd")
    src_pp = tilelang.compile(fa_pp, out_idx=[3], target="cuda", pass_configs=WSPP).get_kernel_source()
    assert src_pp.count("named_barrier_sync(2 + (_tx >> 7), 256)") == 1
    assert src_pp.count("named_barrier_arrive(3 - (_tx >> 7), 256)") == 1 and "named_barrier_arrive(2, 256)" in src_pp
    assert "named_barrier_sync(2" not in tilelang.compile(prog, out_idx=[2], target="cuda",
                                                          pass_configs=WSPP).get_kernel_source()  # wgmma in flight


@needs_nvrtc
@pytest.mark.parametrize("causal", [False, True])
def test_ws_gemm_softmax_overlap_codegen(caplog, tmp_path, monkeypatch, example, causal):
    """cuda_ws_overlap: the warp-specialized flash attention (gemm -> softmax -> gemm) is emitted rotated: a prologue
    iteration, then per iteration S(k) = Q K(k)^T and O += P(k-1) V(k-1) issued together, wgmma_wait<1> (S done),
    the softmax while P V runs, wgmma_wait<0>, the release of the previous stage, the rescale and the cast; the
    last P V after the loop. The register A operand is packed before the wgmma fence (no warpgroup.arrive
    injected by ptxas), no spills. The default (off) and a GEMM main loop keep the plain loop; with pingpong the
    warpgroups take turns on each iteration's pair of gemms (one sync before, one hand-over after the second)."""
    import logging

    from tilehal import compile_cuda

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))  # a cold build logs its choices
    m = example("flash_attention")
    fa = m.flash_attention_fwd(4, 32, 4096, 128, causal, 128, 128, 2, 256, "float16", layout="bhsd")
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        k = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs={"cuda_ws_overlap": True})
    assert any("gemm/softmax overlap" in r.getMessage() for r in caplog.records)
    src = k.get_kernel_source()
    loop = src[src.index("for (int k = 0 + 1;"):]
    loop = loop[:loop.index("const int k = 0 + (")]  # up to the epilogue iteration
    assert loop.count("wgmma_commit()") == 2 and loop.count("wgmma_wait<1>") == 1 and loop.count("wgmma_wait<0>") == 1
    assert loop.index("V_shared[((_prev") < loop.index("wgmma_wait<1>") < loop.index("exp2f") < loop.index(
        "wgmma_wait<0>") < loop.index("mbarrier_arrive(&_empty") < loop.index("= (acc_o[") < loop.index(
        "acc_s_cast[_r")
    assert "wgmma_fence_operands(acc_s)" in loop and "wgmma_fence_operands(acc_o)" in loop
    (name, _, _), = k._impl.kernels
    log = compile_cuda(src, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"] and "C7519" not in log, log
    for cfg in (None, WSPP):
        plain = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs=cfg).get_kernel_source()
        assert "for (int k = 0 + 1;" not in plain and "wgmma_wait<1>" not in plain
    gemm = tilelang.compile(_gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"]), out_idx=[2], target="cuda",
                            pass_configs={"cuda_ws_overlap": True})
    assert "for (int k = 0 + 1;" not in gemm.get_kernel_source()
    pp = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs={**WSPP, "cuda_ws_overlap": True})
    src_pp = pp.get_kernel_source()
    assert src_pp.count("named_barrier_sync(2 + (_tx >> 7), 256)") == 3  # prologue, loop, last P V
    assert src_pp.count("named_barrier_arrive(3 - (_tx >> 7), 256)") == 3 and "if ((_tx >> 7) == 0) tilehal::named" \
        "_barrier_arrive(3" in src_pp
    lp = src_pp[src_pp.index("for (int k = 0 + 1;"):]
    assert lp.index("named_barrier_sync(2 +") < lp.index("wgmma_commit") < lp.index("V_shared[((_prev") < lp.index(
        "named_barrier_arrive(3 -") < lp.index("wgmma_wait<1>")


@needs_nvrtc
def test_fast_softmax_codegen(tmp_path, monkeypatch, example):
    """pass_configs cuda_fast_exp2 / cuda_fmnmx / cuda_tree_reduce (session 29) on the benchmark's flash attention
    (split + overlap + pingpong, 2 stages): every T.exp2 becomes one ex2.approx.ftz.f32 (exp2f is ex2.approx.f32,
    which ptxas expands to FSETP + FMUL + MUFU.EX2 + FMUL), float max through max.NaN.f32 (FMNMX, not FSETP +
    FSEL), the row max / sum over 4 partials per row; the rest of the kernel is the same source; no spills."""
    from tilehal import compile_cuda

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    m = example("flash_attention")
    fa = m.flash_attention_fwd(4, 32, 4096, 128, False, 128, 128, 2, 256, "float16", layout="bhsd")
    plain = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs=_WS_CFG["ovppsp"]).get_kernel_source()
    k = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs=_WS_CFG["ovppspfm"])
    src = k.get_kernel_source()
    assert "ex2.approx.ftz.f32" not in plain and "max.NaN.f32" not in plain
    assert src.count("tl_exp2f_ftz(") - 1 == plain.count("exp2f(") > 0 and "exp2f(" not in src.replace("tl_exp2f_ftz", "")
    assert "max.NaN.f32" in src and len(re.findall(r"float _a\d+\[4\];", src)) == 4  # 2 reductions x (prologue, loop)
    assert len(re.findall(r"float _a\d+ = ", plain)) == 4
    assert "__fdividef" not in src and plain.count(" / logsum[") == 1  # the division: cuda_fast_div only
    (name, _, _), = k._impl.kernels
    log = compile_cuda(src, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    # tl.enable_fast_math (the public TileLang's key) turns on all four, cuda_fast_div too; an explicit False wins
    fast = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs={**_WS_CFG["ovppsp"], "tl.enable_fast_math": True})
    fsrc = fast.get_kernel_source()
    assert fsrc.count("__fdividef(") == 1 and "max.NaN.f32" in fsrc and "ex2.approx.ftz.f32" in fsrc
    assert fsrc.count("[4];") == src.count("[4];")
    nodiv = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs={**_WS_CFG["ovppsp"], "tl.enable_fast_math": True,
                                                                          "cuda_fast_div": False})
    assert nodiv.get_kernel_source() == src


@needs_nvrtc
@pytest.mark.parametrize("causal", [False, True])
def test_ws_split_stages_codegen(caplog, tmp_path, monkeypatch, example, causal):
    """cuda_ws_split_stages: flash attention's K and V tiles get their own full / empty mbarriers. The producer
    arms and fills K(k) and V(k) separately (32 KiB each); the consumers wait for K before S = Q K^T and release
    it right after that gemm's wait (before the softmax), and wait for V only before O += P V. With the
    gemm/softmax overlap: K(k) waited before S(k) and released after wgmma_wait<1>, V(k-1) waited before
    P(k-1) V(k-1) and released after wgmma_wait<0>. No spills; a GEMM (A and B read by one gemm) is unchanged."""
    import logging

    from tilehal import compile_cuda

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    m = example("flash_attention")
    fa = m.flash_attention_fwd(4, 32, 4096, 128, causal, 128, 128, 2, 256, "float16", layout="bhsd")
    plain = tilelang.compile(fa, out_idx=[3], target="cuda")
    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        k = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs=SPLIT)
    assert any("split stages: K_shared waited" in r.getMessage() for r in caplog.records)
    src = k.get_kernel_source()
    assert "[_s], 32768);" in src and "[_s], 65536);" not in src and "[_s], 65536);" in plain.get_kernel_source()
    assert src.count("arrive_expect_tx") == 2 and src.count("mbarrier_init(&") == 4
    assert k._impl.kernels[0][2] == plain._impl.kernels[0][2] + 2 * 2 * 8  # two more barrier arrays of 2 stages
    prod = src[src.index("if (_tx == 256)"):src.index("return;")]
    fk, ek, fv, ev = re.findall(r"tilehal::u64\* (_\w+) = _tl_mbar", src)
    assert prod.index(f"&{ek}[_s]") < prod.index(f"&{fk}[_s], 32768") < prod.index("&K_shared") < prod.index(
        f"&{ev}[_s]") < prod.index(f"&{fv}[_s], 32768") < prod.index("&V_shared")
    loop = src[src.index("for (int k = 0;", src.index("return;")):]
    loop = loop[:loop.index("\n  }\n")]
    assert loop.index(f"mbarrier_wait(&{fk}") < loop.index("&K_shared[") < loop.index("wgmma_wait<0>") < loop.index(
        f"mbarrier_arrive(&{ek}") < loop.index("exp2f") < loop.index(f"mbarrier_wait(&{fv}") < loop.index(
        "&V_shared[") < loop.index(f"mbarrier_arrive(&{ev}")
    assert loop.count("mbarrier_arrive(") == 2 and loop.count("mbarrier_wait(") == 2
    (name, _, _), = k._impl.kernels
    log = compile_cuda(src, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    # with the FA3 gemm/softmax overlap (and with pingpong as well)
    for cfg in ({"cuda_ws_overlap": True}, {**WSPP, "cuda_ws_overlap": True}):
        ko = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs={**cfg, **SPLIT})
        so = ko.get_kernel_source()
        fk, ek, fv, ev = re.findall(r"tilehal::u64\* (_\w+) = _tl_mbar", so)
        lp = so[so.index("for (int k = 0 + 1;"):]
        lp, epi = lp[:lp.index("const int k = 0 + (")], lp[lp.index("const int k = 0 + ("):]
        assert lp.index(f"mbarrier_wait(&{fk}[_stage") < lp.index("&K_shared[") < lp.index(
            f"mbarrier_wait(&{fv}[_prev") < lp.index("V_shared[((_prev") < lp.index("wgmma_wait<1>") < lp.index(
            f"mbarrier_arrive(&{ek}[_stage") < lp.index("exp2f") < lp.index("wgmma_wait<0>") < lp.index(
            f"mbarrier_arrive(&{ev}[_prev")
        assert "(((k - (0)) - 1) / 2) & 1);" in lp  # V(k-1)'s phase
        assert epi.index(f"mbarrier_wait(&{fv}[") < epi.index("&V_shared[") < epi.index(f"mbarrier_arrive(&{ev}[")
        pro = so[so.index("const int k = 0;", so.index("return;")):so.index("for (int k = 0 + 1;")]
        assert pro.index(f"mbarrier_wait(&{fk}") < pro.index("wgmma_wait<0>") < pro.index(f"mbarrier_arrive(&{ek}")
        assert fv not in pro  # V(0) is waited for by the loop's first iteration (or the epilogue)
        (name, _, _), = ko._impl.kernels
        log = compile_cuda(so, arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
        assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    # a GEMM main loop: A and B are read by the same wgmma (and it stays in flight): nothing to split
    prog = _gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"])
    split_src = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=SPLIT).get_kernel_source()
    assert split_src == tilelang.compile(prog, out_idx=[2], target="cuda").get_kernel_source()
    # persistent and pingpong forms with split stages build without spills too
    for cfg in ("spp", "ppsp"):
        kp = tilelang.compile(fa, out_idx=[3], target="cuda", pass_configs=_WS_CFG[cfg])
        assert kp.get_kernel_source().count("mbarrier_init(&") == 4
        (name, _, _), = kp._impl.kernels
        log = compile_cuda(kp.get_kernel_source(), arch="sm_90a", name=name, options=["--ptxas-options=-v"]).log
        assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (cfg, log)


@needs_nvrtc
@pytest.mark.parametrize("name", ["wg_nt_f16_k32_sw64", "wg_tn_f16_mmajor", "wg_nt_bf16_k128"])
def test_tma_mbarriers_in_dynamic_smem(name):
    """The stages' mbarriers are planned in the dynamic shared memory, after the buffers: ptxas reports no
    static shared memory for the kernel, and the launch size counts them. (As a static __shared__ array
    they were padded to _tl_smem's 1 KiB alignment, and wg_nt_f16_k32_sw64 / wg_tn_f16_mmajor, whose
    stages are exactly 48 KiB, asked for 49 KiB without the opt-in and did not launch on the H200.)"""
    from tilehal import compile_cuda

    c = GEMM_VARIANTS[name]
    k = tilelang.compile(_gemm_program(*c), out_idx=[2], target="cuda", pass_configs=TMA)
    src = k.get_kernel_source()
    assert "tma_load_2d(" in src and src.count("__shared__") == 1, name  # only extern _tl_smem
    (kname, _, smem), = k._impl.kernels
    bm, bn, bk, dtype, ta, tb, stages = c[3], c[4], c[5], c[6], c[8], c[9], c[10]
    stage_bytes = (bm * bk + bn * bk) * (2 if dtype in ("float16", "bfloat16") else 1)
    assert smem == stages * stage_bytes + 8 * stages, (name, smem)
    m = compile_cuda(src, arch="sm_90a", name=kname, options=["--ptxas-options=-v"])
    assert "bytes smem" not in m.log, m.log  # no static shared memory


def _main_loop(src: str) -> str:
    """The text of the pipelined main loop (from its `for` to the wgmma_wait<0> after it)."""
    start = src.index("for (int k = 0;")
    return src[start:src.index("tilehal::wgmma_wait<0>();", start)]


@needs_nvrtc
def test_pipelined_wgmma_one_barrier():
    """cuda_wgmma_one_barrier: the wgmma left in flight reads stage k while the refill goes into the stage of
    iteration k-2 (num_stages - 2 ahead), behind the loop's only barrier, before the wgmma_wait<1>; the
    default refills stage k-1 (num_stages - 1 ahead) behind a second barrier. Fewer than 3 stages: the
    option cannot apply (logged) and the default code comes out."""
    prog = _gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"])  # 3 stages

    def loop(cfg):
        return _main_loop(tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=cfg).get_kernel_source())

    two, one = loop(CP_ASYNC), loop({**CP_ASYNC, **ONE_BARRIER})
    assert two.count("__syncthreads()") == 2 and "= k + 2;" in two and "cp_async_wait<1>" in two
    assert one.count("__syncthreads()") == 1 and "= k + 1;" in one and "cp_async_wait<0>" in one
    assert one.index("cp_async_16(") < one.rindex("wgmma_wait<1>") and one.index("wgmma_commit") < one.index(
        "cp_async_16(")
    two, one = loop(TMA), loop({**TMA, **ONE_BARRIER})  # TMA: the same schedule, thread 0 issues the refill
    assert two.count("__syncthreads()") == 2 and "= k + 2;" in two
    assert one.count("__syncthreads()") == 1 and "= k + 1;" in one
    assert one.index("wgmma_commit") < one.index("tma_load_2d(") < one.rindex("wgmma_wait<1>")
    shallow = _gemm_program(*GEMM_VARIANTS["wg_nt_bf16_k128"])  # 2 stages
    assert (tilelang.compile(shallow, out_idx=[2], target="cuda", pass_configs=ONE_BARRIER).get_kernel_source()
            == tilelang.compile(shallow, out_idx=[2], target="cuda").get_kernel_source())


@needs_nvrtc
def test_thread_loops_have_constant_trip_counts():
    """Copies spread over the block's threads loop a constant number of times (`_j < 4`, element
    `_tx + _j * threads`), not `e = _tx; e < n; e += threads` (a trip count that depends on _tx, which nvcc
    compiles to a runtime loop with a remainder); a count the threads do not divide stops early."""
    src = tilelang.compile(_gemm_program(*GEMM_VARIANTS["wg_nt_f16_2wg"]), out_idx=[2], target="cuda",
                           pass_configs=CP_ASYNC).get_kernel_source()
    assert not re.search(r"for \(int _e\d+ = _tx;", src)
    assert re.search(r"for \(int _j\d+ = 0; _j\d+ < 8; \+\+_j\d+\)", src)  # B: 256 rows x 8 chunks / 256
    # the chunk column comes from _tx alone, the row moves by threads / 8 per step
    assert re.search(r"const int _c\d+ = _tx % 8;", src) and re.search(r"= \(_tx / 8\) \+ _j\d+ \* 32;", src)
    assert "desc_advance(_da, " in src and "desc_advance(_db, " in src  # 32-bit descriptor steps
    odd = tilelang.compile(_gemm_program(96, 80, 96, 64, 64, 32, "float16", "float32", False, False, 2, 96,
                                         "Square"), out_idx=[2], target="cuda", pass_configs=CP_ASYNC).get_kernel_source()
    assert re.search(r"if \(_e\d+ >= \d+\) break;", odd)


@needs_nvrtc
def test_staged_epilogue_keeps_wgmma_async(tmp_path, monkeypatch):
    """An fp32 accumulator pair stored to a 16-bit buffer is one packed conversion and one 32-bit store;
    staged through shared memory the old per-element form made ptxas serialize every wgmma (C7514)."""
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))  # a fresh build: ptxas's log is kept

    @T.prim_func
    def main(A: T.Tensor((256, 512), "bfloat16"), B: T.Tensor((256, 512), "bfloat16"),
             C: T.Tensor((256, 256), "bfloat16")):
        with T.Kernel(1, 2, threads=256) as (bx, by):
            As = T.alloc_shared((128, 64), "bfloat16")
            Bs = T.alloc_shared((256, 64), "bfloat16")
            Cf = T.alloc_fragment((128, 256), "float")
            Cs = T.alloc_shared((128, 256), "bfloat16")
            T.clear(Cf)
            for k in T.Pipelined(8, num_stages=3):  # (the old form warned at this size: checked by hand)
                T.copy(A[by * 128, k * 64], As)
                T.copy(B[0, k * 64], Bs)
                T.gemm(As, Bs, Cf, transpose_B=True)
            T.copy(Cf, Cs)
            T.copy(Cs, C[by * 128, 0])

    k = tilelang.compile(main, out_idx=[2], target="cuda")
    src = k.get_kernel_source()
    assert "Wgmma" in src and "tilehal::from_float2<__nv_bfloat16>(Cf[" in src
    assert not k._impl.module.cache_hit and "C7514" not in k._impl.module.log


def test_high_level_schedules_onto_cuda():
    """@tile_kernel loop nests and tensor_contract build with the cuda backend (run on CPU threads here)."""
    from tilelang import tensor_contract, tile_kernel

    @tile_kernel(target="cuda_emu")
    def matmul(A, B, C):
        for i in range(A.shape[0]):
            for j in range(B.shape[1]):
                for k in range(A.shape[1]):
                    C[i, j] += A[i, k] * B[k, j]

    @tile_kernel(target="cuda_emu")
    def row_max(X, R):
        for i in range(X.shape[0]):
            for j in range(X.shape[1]):
                R[i] = max(R[i], X[i, j])

    a, b = torch.randn(70, 50), torch.randn(50, 40)
    c = torch.ones(70, 40)
    matmul(a, b, c)
    torch.testing.assert_close(c, 1 + a @ b, rtol=1e-4, atol=1e-4)
    x = torch.randn(33, 17)
    r = torch.full((33,), -1e30)
    row_max(x, r)
    torch.testing.assert_close(r, x.max(1).values, rtol=0, atol=0)
    ah, bh = torch.randn(70, 64).half(), torch.randn(64, 30).half()
    torch.testing.assert_close(tensor_contract(ah, bh, target="cuda_emu").float(), ah.float() @ bh.float(),
                               rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- bad programs for the GPU

def test_threads_not_multiple_of_32():
    @T.prim_func
    def main(A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=100):
            for i in T.Parallel(64):
                B[i] = A[i]

    with pytest.raises(tilelang.CompileError, match=r"test_cuda\.py:\d+: T\.Kernel threads=100: .*multiple of 32"):
        tilelang.compile(main, out_idx=[1], target="cuda")


def test_shared_memory_over_limit():
    @T.prim_func
    def main(A: T.Tensor((256, 256), "float32"), B: T.Tensor((256, 256), "float32")):
        with T.Kernel(1, threads=128):
            s = T.alloc_shared((256, 256), "float32")
            T.copy(A, s)
            T.copy(s, B)

    with pytest.raises(tilelang.CompileError, match=r"test_cuda\.py:\d+: T\.Kernel needs 262144 bytes of shared "
                                                    r"memory .*at most 232448"):
        tilelang.compile(main, out_idx=[1], target="cuda")


def test_gemm_mixed_input_types():
    @T.prim_func
    def main(A: T.Tensor((64, 64), "float16"), B: T.Tensor((64, 64), "bfloat16"), C: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=128):
            a = T.alloc_shared((64, 64), "float16")
            b = T.alloc_shared((64, 64), "bfloat16")
            c = T.alloc_fragment((64, 64), "float32")
            T.copy(A, a)
            T.copy(B, b)
            T.gemm(a, b, c, clear_accum=True)
            T.copy(c, C)

    with pytest.raises(tilelang.CompileError, match=r"test_cuda\.py:\d+: T\.gemm: A is float16 and B is bfloat16"):
        tilelang.compile(main, out_idx=[2], target="cuda")


def test_uninferrable_fragment_layout():
    @T.prim_func
    def main(A: T.Tensor((64, 64), "float32"), B: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=128):
            x = T.alloc_fragment((64, 64), "float32")
            T.copy(A, x)
            for i, j in T.Parallel(64, 64):
                x[i, j] = x[j, i] + 1.0  # another thread's element
            T.copy(x, B)

    with pytest.raises(tilelang.CompileError, match=r"test_cuda\.py:\d+: .*fragment x"):
        tilelang.compile(main, out_idx=[1], target="cuda")


def test_cuda_launch_needs_cuda_tensors():
    f = pk.gemv
    k = tilelang.compile(f.get_tir(64, 64), out_idx=[-1], target="cuda")
    with pytest.raises(tilehal.ShapeError, match="A: expected device cuda, got cpu"):
        k(torch.zeros(64, 64).half(), torch.zeros(64).half())


# ---------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU))
def test_public_kernel_gpu(name):
    _run_case(name, GPU[name], "cuda", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(n for n in GPU if n.startswith("gemm")))  # their FA cases have 1 stage
@pytest.mark.parametrize("cfg", ["ws", "wsp"])
def test_public_kernel_ws_gpu(name, cfg):
    """The public-style GEMM and flash-attention kernels with pass_configs cuda_warp_specialize (and
    cuda_persistent): the pipelined ones are warp-specialized, the others as by default."""
    _run_case(name, GPU[name], "cuda", "cuda", _WS_CFG[cfg])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["default", "ws", "wsp", "pp", "ppp", "ov", "ovpp", "ovp", "sp", "spp", "ppsp", "ovsp",
                                 "ovppsp", "wsfm", "ovppfm", "ovppspfm", "povppspfm", "pppfm", "wsfmd", "ovfmd", "ovppfmd",
                                 "ovppspfmd", "ovppspfmp", "ovppspfmdp", "sppp"])
@pytest.mark.parametrize("causal", [False, True])
def test_fa_pipelined_ws_gpu(example, causal, cfg):
    """Flash attention at the benchmark's tiles (128 x 128, 2 stages, 256 threads; bhsd, so K / V go through
    TMA: seq a multiple of the tile, else the flattened rows could not be proven inside a head), GQA 8 / 2: the
    default, warp-specialized, persistent (2 x 8 x 12 = 192 tiles on 132 SMs: some blocks run two), pingpong and
    persistent + pingpong forms, and each with K and V on their own mbarriers (cuda_ws_split_stages) vs SDPA in
    float32."""
    m = example("flash_attention")
    b, h, s, d, groups = 2, 8, 1536, 128, 4
    func = m.flash_attention_fwd(b, h, s, d, causal, 128, 128, 2, 256, "float16", groups=groups, layout="bhsd")
    k = tilelang.compile(func, out_idx=[3], target="cuda", pass_configs=_WS_CFG.get(cfg))
    src = k.get_kernel_source()
    assert "tma_load_2d" in src and k._impl.launch_threads  # warp-specialized in every form (the default too)
    opts = _WS_CFG[cfg] or {}
    assert ("named_barrier_sync(2 +" in src) == bool(opts.get("cuda_ws_pingpong"))
    assert ("for (int k = 0 + 1;" in src) == bool(opts.get("cuda_ws_overlap"))  # gemm/softmax overlap
    assert ("_tile += gridDim.x" in src) == bool(opts.get("cuda_persistent"))
    assert ("ex2.approx.ftz.f32" in src) == ("fm" in cfg)  # the fast softmax forms (session 29)
    assert ("__fdividef(" in src) == ("fmd" in cfg)
    assert ("if (_tx == 288) {" in src) == bool(opts.get("cuda_ws_split_producers"))  # V's own producer thread
    assert src.count("mbarrier_init(&") == (4 if "cuda_ws_split_stages" in (_WS_CFG[cfg] or {}) else 2)  # K, V apart
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, h, s, d, generator=g).half().cuda()
    kk = torch.randn(b, h // groups, s, d, generator=g).half().cuda()
    v = torch.randn(b, h // groups, s, d, generator=g).half().cuda()
    out = k(q, kk, v).float()
    rep = groups  # query heads per KV head
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float().repeat_interleave(rep, 1),
                                                           v.float().repeat_interleave(rep, 1), is_causal=causal)
    assert (out - ref).abs().max().item() <= 2e-2


@pytest.mark.gpu
def test_examples_gpu(example):
    m = example("gemm")
    k = m.matmul(512, 384, 256, 128, 128, 32)  # target auto: cuda for CUDA tensors
    a, b = torch.randn(512, 256, device="cuda"), torch.randn(256, 384, device="cuda")
    torch.testing.assert_close(k(a, b), a @ b, rtol=1e-4, atol=1e-3)
    m = example("gemm_relu")
    k = tilelang.compile(m.matmul_relu.get_tir(1000, 520, 264), out_idx=[-1], target="cuda")
    a, b = torch.randn(1000, 264, device="cuda").half(), torch.randn(264, 520, device="cuda").half()
    torch.testing.assert_close(k(a, b).float(), m.reference(a, b).float(), rtol=2e-2, atol=2e-2)
    m = example("elementwise_add")
    k = tilelang.compile(m.elementwise_add.get_tir(700, 1300), out_idx=[-1], target="cuda")
    a, b = torch.randn(700, 1300, device="cuda"), torch.randn(700, 1300, device="cuda")
    torch.testing.assert_close(k(a, b), a + b, rtol=0, atol=0)
    m = example("softmax")
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 2e-2)):
        k = tilelang.compile(m.softmax.get_tir(370, 960, 8, dtype), out_idx=[-1], target="cuda")
        x = torch.randn(370, 960, device="cuda").to(getattr(torch, dtype))
        torch.testing.assert_close(k(x).float(), m.reference(x).float(), rtol=tol, atol=tol)
    m = example("rmsnorm")
    k = tilelang.compile(m.rms_norm.get_tir(130, 800), out_idx=[-1], target="cuda")
    x, w = torch.randn(130, 800, device="cuda"), torch.randn(800, device="cuda")
    torch.testing.assert_close(k(x, w), m.reference(x, w), rtol=1e-5, atol=1e-5)
    m = example("flash_attention")
    for causal, s in ((False, 1024), (True, 1000)):
        k = tilelang.compile(m.flashattn.get_tir(2, 8, s, 64, causal, 64, 64, 2, 128), out_idx=[3], target="cuda")
        q, kk, v = (torch.randn(2, s, 8, 64, device="cuda").half() for _ in range(3))
        torch.testing.assert_close(k(q, kk, v).float(), m.reference(q, kk, v, causal).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prop.programs(), st.integers(0, 2**31 - 1))
def test_property_gpu_matches_interp(prog, seed):
    _prop_case(prog, seed, "cuda")



@pytest.mark.gpu
def test_do_bench_gpu_events_and_l2_flush():
    """do_bench on the GPU: event-timed calls (every one, for means and quantiles), cold L2 by default."""
    from tilelang.profiler import do_bench

    x = torch.randn(32 * 2**20 // 4, device="cuda")  # 32 MiB: fits the L2, so a flush is visible
    ms = do_bench(lambda: x.mul_(1.0), warmup=5, rep=20)
    hot = do_bench(lambda: x.mul_(1.0), warmup=5, rep=20, fast_flush=False)
    q = do_bench(lambda: x.mul_(1.0), _n_warmup=2, _n_repeat=9, quantiles=[0.0, 0.5, 1.0])
    assert ms > 0 and hot > 0 and q[0] <= q[1] <= q[2]
    assert all(do_bench(lambda: x.mul_(1.0), _n_repeat=5, return_mode=m) > 0 for m in ("min", "max", "median"))
    print(f"do_bench 32 MiB scale: cold L2 {ms * 1e3:.1f} us, warm {hot * 1e3:.1f} us")


@pytest.mark.gpu
def test_autotune_gpu_picks_and_caches(tmp_path, monkeypatch):
    """@tilelang.autotune over cuda gemm tiles: checked against torch, timed on the GPU, best config cached
    (the key names the GPU), a second tuner instance reads it back."""
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    configs = [{"bn": 64, "stages": 2}, {"bn": 128, "stages": 3}]

    def make():
        @tilelang.autotune(configs=configs, warmup=2, rep=5, progress=True,
                           ref_prog=lambda a, b: a.float() @ b.float().T, atol=1e-1, rtol=1e-2)
        @tilelang.jit(out_idx=[2], target="cuda")
        def gemm(n, bn=64, stages=2):
            return _gemm_program(n, n, n, 128, bn, 64, "float16", "float32", False, True, stages, 256, "Square")

        return gemm

    g = make()
    k = g(1024)
    assert k.config in configs and not g.last_result.from_cache and len(g.last_result.timings) == 2
    files = list((tmp_path / "tilelang_autotune").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["config"] == k.config
    g2 = make()
    k2 = g2(1024)
    assert g2.last_result.from_cache and k2.config == k.config
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(k2(a, b), a.float() @ b.float().T, atol=1e-1, rtol=1e-2)


@needs_nvrtc
def test_kernel_cache_skips_lowering(tmp_path, monkeypatch):
    """A program compiled again (a fresh build of the same factory) is found by its structure: no IR pass or
    code generation runs; the source is the same; `.lowered` still lowers on request; any change of the
    program or of the options is another entry."""
    import tilelang.backends.cuda.backend as cb

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    cfg = GEMM_VARIANTS["wg_nt_f16_2wg"]
    k1 = tilelang.JITKernel(_gemm_program(*cfg), out_idx=[2], target="cuda")
    calls = []
    real = cb.build_cuda_kernel
    monkeypatch.setattr(cb, "build_cuda_kernel", lambda *a: calls.append(1) or real(*a))
    k2 = tilelang.JITKernel(_gemm_program(*cfg), out_idx=[2], target="cuda")
    assert not calls and k2.get_kernel_source() == k1.get_kernel_source() and k2.cache_hit
    assert k2.lowered.script() == k1.lowered.script()
    other = tilelang.JITKernel(_gemm_program(*cfg[:5], 32, *cfg[6:]), out_idx=[2], target="cuda")
    mma = tilelang.JITKernel(_gemm_program(*cfg), out_idx=[2], target="cuda", pass_configs={"tl.disable_wgmma": True})
    assert len(calls) == 2 and "Wgmma16" not in mma.get_kernel_source()
    assert other.get_kernel_source() != k1.get_kernel_source()


def _transpose_program(M, N, dtype, annotate):
    from tilelang.layout import make_swizzled_layout

    @T.prim_func
    def main(A: T.Tensor((M, N), dtype), B: T.Tensor((N, M), dtype)):
        with T.Kernel(T.ceildiv(N, 64), T.ceildiv(M, 64), threads=128) as (bx, by):
            S = T.alloc_shared((64, 64), dtype)
            if annotate:
                T.annotate_layout({S: make_swizzled_layout(S)})
            T.copy(A[by * 64, bx * 64], S)
            for i, j in T.Parallel(64, 64):
                B[bx * 64 + j, by * 64 + i] = S[i, j]

    return main


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_annotate_swizzled_layout_honoured(dtype):
    """make_swizzled_layout on a staging buffer swizzles its accesses (the XOR of 16-byte chunks by row);
    the transposition stays exact (run by cuda_emu)."""
    src = tilelang.compile(_transpose_program(96, 80, dtype, True), out_idx=[1], target="cuda").get_kernel_source() \
        if HAVE_NVRTC else None
    plain = tilelang.compile(_transpose_program(96, 80, dtype, False), out_idx=[1], target="cuda_emu").get_kernel_source()
    k = tilelang.compile(_transpose_program(96, 80, dtype, True), out_idx=[1], target="cuda_emu")
    assert "^" in k.get_kernel_source() and "^" not in plain.split("extern", 1)[1]
    if src is not None:
        assert "^" in src.split("extern", 1)[1]
    a = torch.randn(96, 80).to(getattr(torch, dtype))  # partial tiles: T.Parallel element stores masked
    torch.testing.assert_close(k(a), a.T.contiguous())


def _splitk_tile_program(M, N, K, splits, out_dtype):
    @T.prim_func
    def main(A: T.Tensor((M, K), "float16"), B: T.Tensor((N, K), "float16"), C: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, 64), T.ceildiv(M, 64), splits, threads=128) as (bx, by, bz):
            As = T.alloc_shared((64, 32), "float16")
            Bs = T.alloc_shared((64, 32), "float16")
            Cf = T.alloc_fragment((64, 64), "float32")
            T.clear(Cf)
            for k in T.Pipelined(K // 32 // splits, num_stages=2):
                T.copy(A[by * 64, (bz * (K // 32 // splits) + k) * 32], As)
                T.copy(B[bx * 64, (bz * (K // 32 // splits) + k) * 32], Bs)
                T.gemm(As, Bs, Cf, transpose_B=True)
            T.atomic_add(C[by * 64, bx * 64], Cf)

    return main


@pytest.mark.parametrize("out_dtype,vec", [("float32", "float2"), ("float16", "__half2"), ("bfloat16", "__nv_bfloat162")])
def test_vectorized_atomic_add(out_dtype, vec):
    """T.atomic_add(global tile, fragment): the accumulator's column pairs go out as one vector atomic each;
    split-K sums match torch (cuda_emu)."""
    k = tilelang.compile(_splitk_tile_program(64, 128, 128, 2, out_dtype), out_idx=[2], target="cuda_emu")
    assert f"reinterpret_cast<{vec}*>" in k.get_kernel_source()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=g).half()
    b = torch.randn(128, 128, generator=g).half()
    ref = a.float() @ b.float().T
    tol = 1e-3 if out_dtype == "float32" else 0.25
    torch.testing.assert_close(k(a, b).float(), ref, atol=tol, rtol=1e-2)
    if HAVE_NVRTC:
        src = tilelang.compile(_splitk_tile_program(64, 128, 128, 2, out_dtype), out_idx=[2],
                               target="cuda").get_kernel_source()
        assert f"reinterpret_cast<{vec}*>" in src


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
def test_vectorized_atomic_add_gpu(out_dtype):
    k = tilelang.compile(_splitk_tile_program(256, 384, 1024, 4, out_dtype), out_idx=[2], target="cuda")
    a = torch.randn(256, 1024, device="cuda").half()
    b = torch.randn(384, 1024, device="cuda").half()
    ref = a.float() @ b.float().T
    tol = 1e-2 if out_dtype == "float32" else 0.5
    torch.testing.assert_close(k(a, b).float(), ref, atol=tol, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_annotate_swizzled_layout_gpu(dtype):
    k = tilelang.compile(_transpose_program(500, 770, dtype, True), out_idx=[1], target="cuda")
    a = torch.randn(500, 770, device="cuda").to(getattr(torch, dtype))
    torch.testing.assert_close(k(a), a.T.contiguous())


@needs_nvrtc
def test_tma_pipelined_copies(example):
    """On sm_90a pipelined whole-tile copies of kernel parameters go through TMA (one descriptor per copy,
    one load per 128-byte atom column, an mbarrier per stage); tl.disable_tma_lower and disable_tma keep
    cp.async; 4-D sources are flattened only where the value ranges prove the tile inside."""
    prog = _gemm_program(*GEMM_VARIANTS["wg_nt_bf16_k128"])
    on = {"tl.disable_warp_specialized": True}  # TMA in every thread's program (warp-specialized: tests below)
    assert "tma_load_2d" not in tilelang.compile(prog, out_idx=[2], target="cuda",
                                                 pass_configs={"cuda_tma": False}).get_kernel_source()
    assert "tma_load_2d" not in tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs={
        "tl.disable_wgmma": True}).get_kernel_source()  # TMA pipelines come with the sm_90a (wgmma) path
    k = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs=on)
    src = k.get_kernel_source()
    specs = next(iter(k._impl.tma.values()))
    assert [(s.param, s.box_rows, s.box_cols, s.swizzle) for s in specs] == [(0, 64, 64, "128B"), (1, 128, 64, "128B")]
    assert src.count("tma_load_2d(") == 2 * 2 * 2 and "mbarrier_wait" in src and "cp_async_16" not in src
    off = tilelang.compile(prog, out_idx=[2], target="cuda", pass_configs={**on, "tl.disable_tma_lower": True})
    assert "tma_load_2d" not in off.get_kernel_source() and not any(off._impl.tma.values())
    m = example("flash_attention")
    bhsd = m.flash_attention_fwd(4, 32, 4096, 128, True, 128, 128, 2, 256, "float16", layout="bhsd")
    fa = tilelang.compile(bhsd, out_idx=[3], target="cuda", pass_configs=on)
    assert fa.get_kernel_source().count("tma_load_2d(") == 2 * 2 * 2  # K and V, 2 atom columns, prologue + loop
    bshd = m.flash_attention_fwd(4, 32, 4096, 128, True, 128, 128, 2, 256, "float16", layout="bshd")
    assert "tma_load_2d" not in tilelang.compile(bshd, out_idx=[3], target="cuda",
                                                 pass_configs=on).get_kernel_source()  # strided rows


@needs_nvrtc
def test_tma_disable_per_copy_logged(caplog, tmp_path, monkeypatch):
    """T.copy(disable_tma=True) keeps that copy on cp.async while the other one of the stage goes through TMA;
    both choices are logged at DEBUG (by the build that generates the code: an empty kernel cache)."""
    import logging

    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))

    @T.prim_func
    def main(A: T.Tensor((256, 256), "float16"), B: T.Tensor((256, 256), "float16"), C: T.Tensor((256, 256), "float32")):
        with T.Kernel(2, 2, threads=128) as (bx, by):
            As = T.alloc_shared((128, 64), "float16")
            Bs = T.alloc_shared((128, 64), "float16")
            Cf = T.alloc_fragment((128, 128), "float32")
            T.clear(Cf)
            for k in T.Pipelined(4, num_stages=3):
                T.copy(A[by * 128, k * 64], As, disable_tma=True)
                T.copy(B[bx * 128, k * 64], Bs)
                T.gemm(As, Bs, Cf, transpose_B=True)
            T.copy(Cf, C[by * 128, bx * 128])

    with caplog.at_level(logging.DEBUG, logger="tilelang.backends.cuda"):
        k = tilelang.compile(main, out_idx=[2], target="cuda")
    src = k.get_kernel_source()
    assert "tma_load_2d(&Bs" in src and "tma_load_2d(&As" not in src and "cp_async_16(&As" in src
    msgs = [r.getMessage() for r in caplog.records]
    assert any("A -> As on cp.async, not TMA: disable_tma=True" in m for m in msgs), msgs
    assert any("B -> Bs through TMA: box 128x64, swizzle 128B" in m for m in msgs), msgs


@needs_nvrtc
def test_value_ranges_drop_proven_bounds_checks():
    """Block indices range over the grid and loop variables over their extents: a tile that divides the
    tensor copies without edge predicates; one that does not keeps them (and its results stay exact:
    the edge variants above). cp.async path (tl.disable_tma_lower) so the predicates are visible."""
    cfg = {"tl.disable_tma_lower": True}
    full = tilelang.compile(_gemm_program(256, 256, 128, 64, 64, 32, "float16", "float32", False, True, 2, 128,
                                          "Square"), out_idx=[2], target="cuda", pass_configs=cfg).get_kernel_source()
    edge = tilelang.compile(_gemm_program(200, 256, 128, 64, 64, 32, "float16", "float32", False, True, 2, 128,
                                          "Square"), out_idx=[2], target="cuda", pass_configs=cfg).get_kernel_source()
    copies = [ln for ln in full.splitlines() if "cp_async_16(" in ln]
    assert copies and not any("?" in ln for ln in copies)  # a predicated copy selects its address with ?:
    assert any("?" in ln and "< 200" in ln for ln in edge.splitlines() if "cp_async_16(" in ln)


@needs_nvrtc
def test_bench_tuned_entries_build(tmp_path, monkeypatch):
    """benchmarks/cuda_kernels.py's autotuned GEMM and flash attention (what next session's GPU tuning run picks
    from per shape): every candidate, tile configs x compiler schedules with the session-27 forms among them,
    builds for sm_90a (build_candidates: no GPU); each defaults-table entry is a candidate of its shape."""
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location("tl_bench_kernels_t", Path(__file__).parents[1] / "benchmarks" /
                                                  "cuda_kernels.py")
    ck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ck)
    for shape, cfg in ck.GEMM_DEFAULTS.items():
        assert cfg in ck.gemm_tune_configs(*shape), shape
    for (b, h, s, d, causal), cfg in ck.FA_DEFAULTS.items():
        assert cfg in ck.FA_TUNE_CONFIGS
        assert ck.flashattn_bhsd_tuned[causal].default_config((b, h, s, d), {}, ck.FA_TUNE_CONFIGS) == cfg
    forms = {k for c in ck.gemm_tune_configs(256, 320, 128) + ck.FA_TUNE_CONFIGS for k in c.get("pass_configs", {})}
    assert {"cuda_ws_two_ctas", "cuda_ws_multicast", "cuda_ws_split_stages", "cuda_ws_overlap", "cuda_fast_exp2",
            "tl.enable_fast_math"} <= forms
    built = ck.gemm_nt_tuned.build_candidates(256, 320, 128, dtype="bfloat16")
    built += ck.flashattn_bhsd_tuned[True].build_candidates(1, 1, 256, 128)
    assert len(built) == 9 + len(ck.FA_TUNE_CONFIGS) == 9 + 13 and all(k is not None for _, k, _ in built), [(c, e) for c, k, e in built if k is None]
    two = [k for c, k, _ in built if c.get("pass_configs") == {"cuda_ws_two_ctas": True}]
    assert len(two) == 2 and all("__launch_bounds__(288, 2)" in k.get_kernel_source() for k in two)
