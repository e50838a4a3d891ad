"""Issue 14 item 5: the CUDA backend's thread-level program (backends/cuda/lower_thread.py, the program
the generated CUDA is printed from) runs on the thread interpreter (target "cuda_threads": the block's
threads as numpy lanes) and matches the tile-level interpreter, on the CPU.

Tolerances (thread program vs tile interpreter): integer and selection results exact; fp32 results
1e-5 relative to max(1, |ref|max) (reductions add in another order: per-thread registers, then a
shuffle tree, then shared memory); fp16 / bf16 outputs 1e-2 / 2e-2 (one rounding of a value that may
differ in its last fp32 bits).
"""

import importlib.util
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
from tilelang.backends.cuda.codegen import KernelCodegen
from tilelang.backends.cuda.emit import Verbatim
from tilelang.backends.cuda.thread_target import lower_to_threads
from tilelang.backends.thread_interp import ThreadInterpreter
from tilelang.errors import CompileError
from tilelang.ir.nodes import Kernel, Seq
from tilelang.ir.thread import AsyncCopy, AsyncWait
from tilelang.ir.visit import map_stmt, walk_stmts
from tilelang.passes.pipeline import run_pipeline


def _load_module(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


pk = _load_module("tilelang_public_kernels", "public_kernels.py")
prop = _load_module("tilelang_property_programs", "test_property.py")
tc = _load_module("tilelang_test_cuda", "test_cuda.py")  # its gemm variants (loaded here: it applies @given)
SMALL = pk.cases("small")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _close(name, got, want):
    got = got if isinstance(got, (tuple, list)) else [got]
    want = want if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want), name
    for g, w in zip(got, want):
        g, w = torch.as_tensor(g), torch.as_tensor(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        if not w.is_floating_point():
            assert torch.equal(g, w), f"{name}: integer results differ"
            continue
        tol = TOL[w.dtype] * max(1.0, w.float().abs().max().item())
        err = (g.float() - w.float()).abs().max().item()
        assert err <= tol, f"{name}: |thread - tile| = {err} > {tol}"


def _both(func, out_idx, inputs, pass_configs=None):
    """(tile interpreter's outputs, thread program's outputs) on copies of `inputs`."""
    outs = []
    for target, cfg in (("interp", None), ("cuda_threads", pass_configs)):
        k = tilelang.compile(func, out_idx=out_idx, target=target, pass_configs=cfg)
        outs.append(k(*[x.clone() for x in inputs]))
    return outs


# every public-style kernel (tests/public_kernels.py at its small sizes); flash attention runs 2-8 s each on
# the thread interpreter, so CI runs one of the eight (the others: slow marker)
SLOW = {"fa_mha_bhsd_full", "fa_mha_bshd_full", "fa_mha_bshd_causal", "fa_mha_bhsd_causal", "fa_gqa_bshd_full",
        "fa_gqa_bhsd_full", "fa_gqa_bshd_causal"}
THREAD_LOWERED = sorted(SMALL)


# the two code paths: mma.sync + cp.async (cuda_emu's), and sm_90a's wgmma + single-role TMA pipelines (target
# "cuda" warp-specializes those by default; that form is still text)
PATHS = {"mma": None, "wgmma_tma": {"cuda_tma": True}}


# kernels without a gemm or a pipeline lower the same on both paths: run once
SAME_ON_BOTH = {"cumsum", "gemv", "layernorm", "topk"}


@pytest.mark.parametrize("name,path", [pytest.param(n, p, marks=pytest.mark.slow) if n in SLOW else (n, p)
                                       for n in THREAD_LOWERED for p in sorted(PATHS)
                                       if not (n in SAME_ON_BOTH and p != "mma")])
def test_public_kernel_thread_program_matches_tile_interp(name, path):
    fac, args, make, ref, tol = SMALL[name]
    torch.manual_seed(0)
    inputs = make("cpu")
    want, got = _both(fac.get_tir(*args), fac.out_idx, inputs, PATHS[path])
    _close(name, got, want)
    pk.check(name, got, ref(*inputs), tol)  # and the reference, as the GPU test checks it


@pytest.mark.parametrize("mod,fn,args,dtype", [
    ("elementwise_add", "elementwise_add", (70, 130), torch.float32),
    ("softmax", "softmax", (37, 96, 8, "float32"), torch.float32),
    ("softmax", "softmax", (37, 96, 8, "bfloat16"), torch.bfloat16),
    ("rmsnorm", "rms_norm", (13, 80), torch.float32),
    ("gemm", "matmul", (70, 40, 24, 32, 32, 16), torch.float32),
    ("gemm_relu", "matmul_relu", (96, 80, 64), torch.float16),
    ("flash_attention", "flashattn", (1, 2, 100, 32, True), torch.float16),
], ids=["elementwise_add", "softmax_f32", "softmax_bf16", "rmsnorm", "gemm_f32", "gemm_relu_f16", "flash_attention"])
def test_example_thread_program_matches_tile_interp(example, mod, fn, args, dtype):
    f = getattr(example(mod), fn)
    func = f.get_tir(*args)
    torch.manual_seed(0)
    inputs = [torch.randn(*[int(s.value) for s in p.shape]).to(dtype) for p in func.params[:len(func.params) - 1]]
    want, got = _both(func, f.out_idx, inputs)
    _close(mod, got, want)


@pytest.mark.parametrize("mod,fn,args,dtype", [
    ("softmax", "softmax", (37, 96, 8, "float32"), torch.float32),
    ("rmsnorm", "rms_norm", (13, 80), torch.float32),
    ("flash_attention", "flashattn", (1, 2, 100, 32, True), torch.float16),
], ids=["softmax_f32", "rmsnorm", "flash_attention"])
def test_tree_reduce_thread_program_matches_tile_interp(example, mod, fn, args, dtype):
    """pass_configs cuda_tree_reduce (session 29): each thread's registers reduced into independent partials,
    combined pairwise; the thread program still computes what the tile program means."""
    f = getattr(example(mod), fn)
    func = f.get_tir(*args)
    cfg = {"cuda_tree_reduce": True}
    src = tilelang.compile(func, out_idx=f.out_idx, target="cuda_threads", pass_configs=cfg).get_kernel_source()
    assert re.search(r"float _a\d+\[(2|4)\];", src), "no reduction got partials"
    torch.manual_seed(0)
    inputs = [torch.randn(*[int(s.value) for s in p.shape]).to(dtype) for p in func.params[:len(func.params) - 1]]
    want, got = _both(func, f.out_idx, inputs, cfg)
    _close(mod, got, want)


def _prop_inputs(dtype, M, N, seed):
    rng = np.random.default_rng(seed)
    if dtype == "int32":
        return [torch.from_numpy(rng.integers(-5, 6, size=(M, N)).astype(np.int32)) for _ in range(2)]
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return [torch.from_numpy(rng.standard_normal((M, N)).astype(np.float32)).to(tdt) for _ in range(2)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prop.programs(), st.integers(0, 2**31 - 1))
def test_property_programs_thread_program_matches_tile_interp(prog, seed):
    """Random tile programs (odd sizes, partial tiles, four dtypes, reductions, cumsum, gemm on the tensor
    cores or CUDA cores), with the property test's tolerances (x10 with a gemm, as test_cuda uses)."""
    dtype, (M, N), source = prog
    func = prop._load(source)
    want, got = _both(func, [2], _prop_inputs(dtype, M, N, seed))
    tol = prop.TOL[dtype] * (10 if "gemm" in source else 1)
    np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), rtol=tol, atol=tol, equal_nan=True,
                               err_msg=f"program:\n{source}")


def _staged_copy(n=96, block=64):
    @T.prim_func
    def main(A: T.Tensor((n, n), "float16"), B: T.Tensor((n, n), "float16")):
        with T.Kernel(T.ceildiv(n, block), T.ceildiv(n, block), threads=128) as (bx, by):
            s = T.alloc_shared((block, block), "float16")
            T.copy(A[by * block, bx * block], s)
            T.copy(s, B[by * block, bx * block])

    return main


def _run_program(tf, arrays):
    flat = [a.reshape(-1) for a in arrays]
    ThreadInterpreter(tf).run(dict(zip(tf.params, flat)), {})


def test_thread_program_checks_the_lowering_waits_and_edges():
    """The cp.async copy of a tile (edge rows zero-filled by the predicate) lands at its wait: the thread
    program of the CUDA lowering moves the tile exactly, and without its wait it reads poison."""
    func = run_pipeline(_staged_copy(), "cuda")
    tf = lower_to_threads(func)
    assert any(isinstance(s, AsyncCopy) and s.pred is not None for s in walk_stmts(tf.body)), "edge tiles predicated"
    a = np.random.default_rng(0).standard_normal((96, 96)).astype(np.float16)
    b = np.zeros_like(a)
    _run_program(tf, [a, b])
    np.testing.assert_array_equal(b, a)
    no_wait = map_stmt(tf.body, lambda s: None if isinstance(s, AsyncWait) else s)
    tf2 = type(tf)(tf.name, tf.params, no_wait, tf.dynamic_vars)
    b2 = np.zeros_like(a)
    _run_program(tf2, [a, b2])
    assert np.isnan(b2.astype(np.float32)).all(), "a copy read before its wait must see the poison"


def test_rules_still_writing_text_are_refused_by_name():
    """The warp-specialized pipelines (opt-in cuda_warp_specialize) still write CUDA text (their named
    barriers, producer loop): a thread program holding text is not run silently; the thread interpreter
    names the text it cannot execute."""
    func = run_pipeline(tc._gemm_program(*tc.GEMM_VARIANTS["wg_nt_bf16_k128"]), "cuda")

    kernel = next(s for s in func.body.body if isinstance(s, Kernel))
    cg = KernelCodegen(func, kernel, "k", [], wgmma=True, tma=True)
    cg.generate()
    body = cg.thread_kernel()
    # what the warp-specialized path adds as text (a named barrier), in front of the lowered kernel body
    body.body = Seq([Verbatim("tilehal::named_barrier_sync(1, 256);"), body.body])
    prog = type(func)(func.name, [cg.tbuf(p) for p in func.params], body, [])
    a = np.zeros((128, 256), tilehal.to_numpy_dtype("bfloat16"))
    with pytest.raises(CompileError, match="not lowered to thread-level nodes yet: 'tilehal::named_barrier_sync"):
        _run_program(prog, [a, a.copy(), np.zeros((128, 128), np.float32)])


# the gemm variants of test_cuda.py on the mma.sync path (the thread interpreter has no wgmma rules yet):
# every dtype (fp16, bf16, fp8 e4m3 / e5m2, int8, fp32 on CUDA cores), transposes, warp policies, A in
# registers, partial edge tiles, 1-3 pipeline stages, a dynamic M
GEMM_VARIANTS = ["nn_f16_square_edges", "tn_f16", "tt_bf16_3stage", "nt_bf16_fullcol", "nt_e4m3", "nt_e5m2", "nt_int8",
                 "a_in_registers_square", "a_in_registers_fullrow", "f32_cuda_cores", "dynamic_m"]
# the wgmma forms (sm_90a): 128-byte-swizzled K-major operands in atom columns, M-major A, 64-byte swizzle, two
# m64 blocks per warpgroup, warpgroups along N, A in registers (rs), fp8 e4m3; each with TMA and with cp.async
WG_VARIANTS = ["wg_nt_f16_2wg", "wg_nn_bf16_natoms", "wg_tn_f16_mmajor", "wg_nt_bf16_k128", "wg_nt_f16_k32_sw64",
               "wg_nt_f16_n_split", "wg_a_regs_bf16", "wg_nt_e4m3_k128"]
WG_PATHS = {"wgmma_tma": {"cuda_tma": True}, "wgmma_cp_async": {"cuda_tma": True, "tl.disable_tma_lower": True},
            "wgmma_tma_one_barrier": {"cuda_tma": True, "cuda_wgmma_one_barrier": True}}
_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
          "float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name,path", [(n, "mma") for n in GEMM_VARIANTS] +
                         [(n, p) for n in WG_VARIANTS for p in sorted(WG_PATHS)])
def test_gemm_variant_thread_program_matches_tile_interp(name, path):
    """ldmatrix (.trans) + mma.sync m16n8k16 / m16n8k32 (or FMA), or wgmma on descriptor-addressed swizzled
    tiles (TMA- or cp.async-filled), as the thread interpreter runs them (PTX fragment and canonical smem
    layouts per lane / warpgroup) vs the tile interpreter's matmul: fp32 accumulators within 1e-5 relative
    (the products are exact, the sums in another order), int32 exact."""
    cfg = WG_PATHS.get(path)
    c = tc.GEMM_VARIANTS[name]
    M, N, K, _, _, _, dtype, _, ta, tb = c[:10]
    g = torch.Generator().manual_seed(0)
    shapes = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    if dtype == "int8":
        inputs = [torch.randint(-8, 8, sh, dtype=torch.int8, generator=g) for sh in shapes]
    else:
        inputs = [torch.randn(sh, generator=g).to(_TORCH[dtype]) for sh in shapes]
    func = tc._gemm_program(*c)
    if cfg is not None:
        src = tilelang.compile(func, out_idx=[2], target="cuda_threads", pass_configs=cfg).get_kernel_source()
        assert "Wgmma" in src and ("tma" in path or "tma_load_2d" not in src), (name, path)
    want, got = _both(func, [2], inputs, cfg)
    _close(name, got, want)


def _tma_row_sums(K=256, N=128, stages=3, swizzle=True):
    """A pipelined copy-and-accumulate (no gemm): on sm_90a its copies go through TMA + mbarriers."""

    @T.prim_func
    def main(A: T.Tensor((K, N), "float16"), B: T.Tensor((64, N), "float32")):
        with T.Kernel(T.ceildiv(N, 64), threads=128) as bx:
            s = T.alloc_shared((64, 64), "float16")
            acc = T.alloc_fragment((64, 64), "float32")
            if swizzle:
                T.annotate_layout({s: tilelang.layout.make_swizzled_layout(s)})
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, 64), num_stages=stages):
                T.copy(A[k * 64, bx * 64], s)
                for i, j in T.Parallel(64, 64):
                    acc[i, j] += s[i, j]
            T.copy(acc, B[0, bx * 64])

    return main


@pytest.mark.parametrize("swizzle", [True, False], ids=["swizzle128", "plain"])
def test_tma_pipeline_thread_program_matches_tile_interp(swizzle):
    """TMA loads (the hardware's 128-byte swizzle, zero fill past the edge of the tensor) landing on their
    stage's mbarrier phase, read through the lowering's swizzled shared addresses: == the tile interpreter."""
    func = _tma_row_sums(K=200, N=160, swizzle=swizzle)  # K and N not multiples of the tile: edge boxes
    src = tilelang.compile(func, out_idx=[1], target="cuda_threads", pass_configs={"cuda_tma": True}).get_kernel_source()
    assert "tma_load_2d" in src and "mbarrier_wait" in src
    torch.manual_seed(0)
    a = torch.randn(200, 160).half()
    outs = []
    for target, cfg in (("interp", None), ("cuda_threads", {"cuda_tma": True})):
        outs.append(tilelang.compile(func, out_idx=[1], target=target, pass_configs=cfg)(a.clone()))
    _close("tma row sums", outs[1], outs[0])


def test_tma_mbarrier_waits_and_bytes_are_checked():
    """Without its mbarrier wait a TMA stage reads poison; a phase expecting more bytes than were issued
    never completes (the interpreter reports the deadlock instead of hanging)."""
    from tilelang.backends.cuda.emit import MbarArriveExpectTx, MbarWait

    func = run_pipeline(_tma_row_sums(K=128, N=64), "cuda", {"cuda_tma": True})
    tf = lower_to_threads(func, wgmma=True, use_tma=True)
    a = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float16)

    def run(body):
        out = np.zeros((64, 64), np.float32)
        _run_program(type(tf)(tf.name, tf.params, body, tf.dynamic_vars), [a, out])
        return out

    want = np.asarray(a, np.float32).reshape(2, 64, 64).sum(0)
    np.testing.assert_allclose(run(tf.body), want, rtol=1e-5, atol=1e-5)
    assert np.isnan(run(map_stmt(tf.body, lambda s: None if isinstance(s, MbarWait) else s))).all()

    def more_bytes(s):
        return MbarArriveExpectTx(s.bar, s.nbytes + 16) if isinstance(s, MbarArriveExpectTx) else s

    with pytest.raises(tilehal.LaunchError, match="never returns"):
        run(map_stmt(tf.body, more_bytes))


def test_wgmma_in_flight_operands_and_accumulators_are_checked():
    """A pipelined wgmma GEMM keeps one wgmma group in flight across iterations; the stage it reads is
    refilled only after the group retires (wgmma_wait<1>). Without that wait the thread interpreter sees
    the refill overwrite an in-flight wgmma's operand tile, and an accumulator read before wgmma_wait<0>."""
    from tilelang.ir.thread import Intrinsic

    c = (128, 256, 384) + tc.GEMM_VARIANTS["wg_nt_f16_2wg"][3:]  # 6 k-steps of 64 through 3 stages: refills
    M, N, K = c[:3]
    func = run_pipeline(tc._gemm_program(*c), "cuda", {"cuda_tma": True})
    tf = lower_to_threads(func, wgmma=True, use_tma=True)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(sh).astype(np.float16) for sh in ((M, K), (N, K)))

    def run(body):
        out = np.zeros((M, N), np.float32)
        _run_program(type(tf)(tf.name, tf.params, body, tf.dynamic_vars), [a, b, out])
        return out

    want = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(run(tf.body), want, rtol=1e-4, atol=1e-3)

    def no_wait(n):
        return lambda s: None if isinstance(s, Intrinsic) and s.name == "wgmma_wait" and s.attrs["n"] == n else s

    with pytest.raises(tilehal.LaunchError, match="while a wgmma reading it is in flight"):
        run(map_stmt(tf.body, no_wait(1)))
    with pytest.raises(tilehal.LaunchError, match="accumulator .* while a wgmma on it is in flight"):
        run(map_stmt(tf.body, no_wait(0)))


@pytest.mark.parametrize("name,cfg,marks", [
    ("wg_nt_f16_2wg", {"wgmma": True, "use_tma": True}, ["T.tma_load(", "T.mbarrier_wait(", "T.wgmma_ss(", "T.smem_desc("]),
    ("wg_a_regs_bf16", {"wgmma": True}, ["T.wgmma_rs(", "T.cp_async("]),
    ("nt_e4m3", {}, ["T.intrinsic('ldmatrix_x4'", "T.intrinsic('mma_m16n8k32'"]),
    ("tn_f16", {}, ["T.intrinsic('ldmatrix_x4_trans'", "T.intrinsic('mma_m16n8k16'"]),
])
def test_lowered_program_prints(name, cfg, marks):
    """Item 2: the thread-level program the CUDA is printed from is also printed by the IR printer
    (`script()`), every node readable (no `<Node>` placeholder)."""
    text = lower_to_threads(run_pipeline(tc._gemm_program(*tc.GEMM_VARIANTS[name]), "cuda"), **cfg).script()
    assert "T.get_thread_binding()" in text and not re.findall(r"<[A-Z]\w*>", text), text
    for m in marks:
        assert m in text, (m, text)


def _bench_kernels():
    spec = importlib.util.spec_from_file_location("tilelang_bench_cuda_kernels",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the tile configurations bench_cuda.py measures on the H200 (docs/tilelang.md), at CPU-sized problems: 8-10
# k-steps through 4-5 stages (every refill path runs), two column tiles, T.use_swizzle's block remap
BENCH_GEMMS = [((128, 256, 64, 4, 256), "2b"), ((128, 192, 64, 5, 256, "c_shared"), "1b"),
               ((128, 176, 64, 4, 256), "1b")]


@pytest.mark.parametrize("cfg,variant", BENCH_GEMMS, ids=[f"{'x'.join(map(str, c[:5]))}{'-cs' if len(c) > 5 else ''}-{v}"
                                                          for c, v in BENCH_GEMMS])
def test_benchmark_gemm_configs_thread_program_matches_tile_interp(cfg, variant):
    """The benchmark's GEMM NT (bf16, wgmma + TMA, both refill schemes, epilogue direct or staged through
    shared memory) as the thread interpreter runs it == the tile interpreter; with the wgmma asynchrony
    and TMA phase checks on (a stage refilled under an in-flight wgmma would raise)."""
    bm, bn, bk, stages, threads = cfg[:5]
    M, N, K = 128, 2 * bn, 10 * bk
    func = _bench_kernels().gemm_nt(M, N, K, bm, bn, bk, stages, threads, "bfloat16", c_shared=len(cfg) > 5)
    pc = {"cuda_tma": True, **({"cuda_wgmma_one_barrier": True} if variant == "1b" else {})}
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(sh, generator=g).bfloat16() for sh in ((M, K), (N, K))]
    want, got = _both(func, [2], inputs, pc)
    _close(f"bench gemm {cfg} {variant}", got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_benchmark_flash_attention_config_thread_program_matches_tile_interp(causal):
    """The benchmark's flash attention (bhsd, d128, 128x128 tiles, 256 threads, wgmma + TMA) at one head of
    256 tokens on the thread interpreter == the tile interpreter (fp16 output, 1e-2)."""
    func = _bench_kernels().flashattn_bhsd(1, 1, 256, 128, causal)
    torch.manual_seed(0)
    inputs = [torch.randn(1, 1, 256, 128).half() for _ in range(3)]
    want, got = _both(func, [3], inputs, {"cuda_tma": True})
    _close("bench flash attention", got, want)


@st.composite
def _gemm_configs(draw):
    bm, bn, bk = draw(st.sampled_from([64, 128])), draw(st.sampled_from([64, 128, 256])), draw(st.sampled_from([32, 64]))
    M = bm * draw(st.integers(1, 2)) - draw(st.sampled_from([0, 0, 8]))
    N = bn * draw(st.integers(1, 2)) - draw(st.sampled_from([0, 8]))
    K = bk * draw(st.integers(1, 6)) - draw(st.sampled_from([0, 0, 8]))
    cfg = (M, N, K, bm, bn, bk, draw(st.sampled_from(["float16", "bfloat16"])), "float32", draw(st.booleans()),
           draw(st.booleans()), draw(st.integers(1, 4)), draw(st.sampled_from([128, 256])),
           draw(st.sampled_from(["Square", "FullRow", "FullCol"])))
    return cfg, draw(st.sampled_from(sorted(GEMM_PATHS)))


GEMM_PATHS = {"mma": None, "wgmma_tma": {"cuda_tma": True},
              "wgmma_tma_one_barrier": {"cuda_tma": True, "cuda_wgmma_one_barrier": True},
              "wgmma_cp_async": {"cuda_tma": True, "tl.disable_tma_lower": True}}


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_gemm_configs())
def test_random_pipelined_gemms_thread_program_matches_tile_interp(x):
    """Random pipelined GEMMs (tiles 64-128 x 64-256 x 32-64, 1-4 stages, 128 / 256 threads, fp16 / bf16,
    transposes, warp policies, edge tiles) on a random path (mma.sync + cp.async, wgmma + TMA with either
    refill scheme, wgmma + cp.async) == the tile interpreter. (200 examples ran clean on 2026-12-02.)"""
    cfg, path = x
    M, N, K, ta, tb = cfg[0], cfg[1], cfg[2], cfg[8], cfg[9]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(sh, generator=g).to(_TORCH[cfg[6]]) for sh in (((K, M) if ta else (M, K)),
                                                                         ((N, K) if tb else (K, N)))]
    want, got = _both(tc._gemm_program(*cfg), [2], inputs, GEMM_PATHS[path])
    _close(f"{cfg} {path}", got, want)


@pytest.mark.parametrize("name", ["cumsum", "gemm_nn_bias_relu", "gemv", "gemm_splitk_atomic"])
def test_missing_barrier_is_a_race(name):
    """Lock-step lanes hide races, so the thread interpreter tracks shared-memory accesses between barriers:
    with the lowering's barriers removed, an element written by one thread is read (or overwritten) by
    another with no __syncthreads() between, and that is reported (with them, nothing is)."""
    from tilelang.ir.thread import Barrier

    fac, args, make, _, _ = SMALL[name]
    torch.manual_seed(0)
    inputs = make("cpu")
    func = run_pipeline(fac.get_tir(*args), "cuda")
    tf = lower_to_threads(func)
    outs = [np.zeros([int(d.value) for d in p.shape], tilehal.to_numpy_dtype(p.dtype)) for p in func.params[len(inputs):]]
    arrays = [x.numpy() for x in inputs] + outs
    _run_program(tf, [a.copy() for a in arrays])
    no_sync = map_stmt(tf.body, lambda s: None if isinstance(s, Barrier) else s)
    with pytest.raises(tilehal.LaunchError, match="no __syncthreads"):
        _run_program(type(tf)(tf.name, tf.params, no_sync, tf.dynamic_vars), [a.copy() for a in arrays])


def test_shared_memory_starts_as_garbage_and_buffers_share_the_arena():
    """The thread program's shared buffers are views of one poisoned byte arena at the planner's offsets (as
    the GPU's dynamic shared memory: garbage until written): a buffer read before it is fully written is
    zero-initialized by the lowering (its zero loop removed, the read sees poison), and two buffers the
    planner places on the same bytes (disjoint live ranges) really share them."""
    from tilelang.ir.thread import StridedFor

    @T.prim_func
    def main(A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32"), C: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=64) as bx:
            s = T.alloc_shared((64,), "float32")
            T.copy(A[0:10], s[0:10])  # s[10:] is read below before any write: zero
            T.copy(s, B[0:64])
            t = T.alloc_shared((64,), "float32")  # live after s is dead: the planner may reuse s's bytes
            T.copy(A[0:64], t)
            T.copy(t, C[0:64])

    a = np.arange(64, dtype=np.float32)
    tf = lower_to_threads(run_pipeline(main, "cuda"))
    offsets = {x.buffer.name: x.options["arena_offset"] for x in walk_stmts(tf.body) if type(x).__name__ == "Alloc"}
    assert offsets["s"] == offsets["t"], offsets  # the planner reused s's bytes for t
    out = [np.zeros(64, np.float32), np.zeros(64, np.float32)]
    _run_program(tf, [a, *out])
    np.testing.assert_array_equal(out[0], np.r_[a[:10], np.zeros(54, np.float32)])
    np.testing.assert_array_equal(out[1], a)
    no_zero = map_stmt(tf.body, lambda s: None if isinstance(s, StridedFor) and s.one_line else s)
    out = [np.zeros(64, np.float32), np.zeros(64, np.float32)]
    _run_program(type(tf)(tf.name, tf.params, no_zero, tf.dynamic_vars), [a, *out])
    assert np.isnan(out[0][10:]).all() and (out[0][:10] == a[:10]).all()
