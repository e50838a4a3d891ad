"""The showcase examples (issue 21): fp8 block-scaled GEMM, paged flash decoding, fused RMSNorm + fp8 quant,
GQA flash attention.

CPU (CI): each runs on the interpreter and the C target at small sizes against an independent torch
reference, and compiles to an sm_90a cubin with NVRTC at the benchmark's sizes; the paged decode and fp8 GEMM
also run their generated CUDA on CPU threads (cuda_emu). GPU (`gpu` marker): the same against torch on the
H200 at benchmark-like sizes.

Tolerances: fp8 GEMM calc_diff (1 - cosine-like similarity, DeepGEMM's measure) < 1e-4 against the
dequantized float32 product (bf16 output rounding is ~1e-6); paged decode max |O - ref| <= 2e-2 (bf16
output, float32 math in both); RMSNorm + fp8: scales within 1e-5 relative, and at most 0.1 % of the fp8
codes one e4m3 step off (a float32 sum order difference can flip a rounding tie), none more.
"""

import pytest
import tilehal
import tilelang
import torch

HAVE_NVRTC = tilehal.jit.cuda.compiler_versions()["nvrtc"] is not None or tilehal.jit.cuda.compiler_versions()["nvcc"]
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason="no NVRTC/nvcc to build cubins")


def _fp8_case(m, M, N, K, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a, sfa = m.per_token_cast_to_fp8(torch.randn(M, K, generator=g) * 3)
    b, sfb = m.per_block_cast_to_fp8(torch.randn(N, K, generator=g))
    return [x.to(device) for x in (a, sfa, b, sfb)]


# ---------------------------------------------------------------- fp8 block-scaled GEMM


@pytest.mark.parametrize("shape,cfg", [((200, 256, 320), (128, 128, 2, 128)), ((128, 192, 384), (64, 64, 3, 128))])
def test_fp8_gemm(example, target, shape, cfg):
    m = example("fp8_gemm")
    M, N, K = shape
    k = tilelang.compile(m.fp8_gemm_program(M, N, K, *cfg), out_idx=[-1], target=target)
    a, sfa, b, sfb = _fp8_case(m, M, N, K)
    d = k(a, b, sfa.T.contiguous(), sfb)
    assert d.dtype == torch.bfloat16 and d.shape == (M, N)
    assert m.calc_diff(d.float(), m.reference(a, sfa, b, sfb)) < 1e-4


@pytest.mark.parametrize("shape,staged", [((200, 256, 384), True), ((128, 64, 512), True), ((200, 256, 384), False)])
def test_fp8_gemm_overlap(example, target, shape, staged):
    """Two K blocks per stage (an odd block count leaves the second one past K: zero-filled, scale index clamped);
    the epilogue staged in shared memory or stored from registers."""
    m = example("fp8_gemm")
    M, N, K = shape
    k = tilelang.compile(m.fp8_gemm_overlap_program(M, N, K, 128, min(N, 128), 2, 128, 8, "bfloat16", staged),
                         out_idx=[-1], target=target)
    a, sfa, b, sfb = _fp8_case(m, M, N, K)
    assert m.calc_diff(k(a, b, sfa.T.contiguous(), sfb).float(), m.reference(a, sfa, b, sfb)) < 1e-4


def test_fp8_gemm_default_table(example):
    """The DeepSeek shapes get their measured configs without tuning; any other shape the "*" entry; every
    default is one of the tuning candidates and builds (k_pair selects the overlapped program)."""
    m = example("fp8_gemm")
    t = m.fp8_gemm_tuned
    for shape in ((4096, 7168, 2048), (4096, 2112, 7168), (4096, 24576, 1536), (512, 512, 512)):
        cfg = t.default_config(shape, {}, m.TUNE_CONFIGS)
        assert cfg in m.TUNE_CONFIGS and cfg == m.DEFAULTS.get(shape, m.DEFAULTS["*"])
    cfg = dict(m.DEFAULTS["*"])
    cfg.pop("pass_configs", None)
    k = tilelang.compile(m.fp8_gemm_program(200, 256, 384, **{**cfg, "threads": 128}), out_idx=[-1], target="interp")
    a, sfa, b, sfb = _fp8_case(m, 200, 256, 384)
    assert m.calc_diff(k(a, b, sfa.T.contiguous(), sfb).float(), m.reference(a, sfa, b, sfb)) < 1e-4


def test_fp8_gemm_promotion_per_k_block(example):
    """Scales that differ by 2^12 between K blocks: only a per-block promotion gets this right."""
    m = example("fp8_gemm")
    M = N = 128
    K = 256
    a, sfa, b, sfb = _fp8_case(m, M, N, K)
    sfa[:, 1] *= 4096.0
    sfb[:, 0] /= 4096.0
    k = tilelang.compile(m.fp8_gemm_program(M, N, K, 128, 128, 2, 128), out_idx=[-1], target="interp")
    assert m.calc_diff(k(a, b, sfa.T.contiguous(), sfb).float(), m.reference(a, sfa, b, sfb)) < 1e-4


def test_fp8_gemm_emulated(example):
    m = example("fp8_gemm")
    k = tilelang.compile(m.fp8_gemm_program(128, 128, 256, 128, 128, 2, 128), out_idx=[-1], target="cuda_emu")
    a, sfa, b, sfb = _fp8_case(m, 128, 128, 256)
    assert m.calc_diff(k(a, b, sfa.T.contiguous(), sfb).float(), m.reference(a, sfa, b, sfb)) < 1e-4


def test_fp8_gemm_main(example):
    example("fp8_gemm").main(128, 128, 256)


# ---------------------------------------------------------------- paged decode


LENS = [100, 37, 256, 0]  # partial last block, short, full, empty


@pytest.mark.parametrize("num_split,block_N,stages,threads", [(1, 32, 2, 128), (3, 64, 3, 128), (5, 16, 2, 32)])
def test_paged_decode(example, target, num_split, block_N, stages, threads):
    m = example("paged_decode")
    q, k, v, table, lens = m.random_cache(4, 8, 2, 64, 16, LENS)
    kern = tilelang.compile(m.paged_decode_program(4, 8, 2, 64, k.shape[0], 16, table.shape[1], num_split, block_N,
                                                   16, stages, threads), out_idx=[-1], target=target)
    out = kern(q, k, v, table, lens, torch.empty(4, 8, num_split), torch.empty(4, 8, num_split, 64))
    ref = m.reference(q, k, v, table, lens)
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2
    assert out[3].abs().max().item() == 0  # nothing to attend to: zeros


def test_paged_decode_emulated(example):
    m = example("paged_decode")
    q, k, v, table, lens = m.random_cache(3, 8, 2, 64, 16, LENS[:3], dtype="float16")
    kern = tilelang.compile(m.paged_decode_program(3, 8, 2, 64, k.shape[0], 16, table.shape[1], 2, 64, 16, 2, 128,
                                                   "float16"), out_idx=[-1], target="cuda_emu")
    out = kern(q, k, v, table, lens, torch.empty(3, 8, 2), torch.empty(3, 8, 2, 64))
    assert (out.float() - m.reference(q, k, v, table, lens).float()).abs().max().item() <= 2e-2


def test_paged_decode_wrapper_and_main(example):
    m = example("paged_decode")
    m.main()
    q, k, v, table, lens = m.random_cache(2, 4, 1, 32, 8, [9, 70])
    out = m.paged_decode(q, k, v, table, lens, num_split=2, block_N=16, scale=0.3)
    ref = m.reference(q, k, v, table, lens, scale=0.3)
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2


# ---------------------------------------------------------------- RMSNorm + fp8


def _check_rmsnorm_fp8(m, q, s, x, w):
    rq, rs = m.reference(x.cpu(), w.cpu())
    q, s = q.cpu(), s.cpu()
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    step = (q.float() - rq.float()).abs() / rq.float().abs().clamp(min=2**-9)
    assert (step > 0).float().mean().item() <= 1e-3 and step.max().item() <= 0.126  # one e4m3 step: 2^-3


@pytest.mark.parametrize("M,N,block_M", [(8, 512, 2), (5, 384, 1)])
def test_rmsnorm_fp8(example, target, M, N, block_M):
    m = example("rmsnorm_fp8")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(M, N, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    k = tilelang.compile(m.rmsnorm_fp8_program(M, N, block_M), out_idx=[-2, -1], target=target)
    q, s = k(x, w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (M, N // 128)
    _check_rmsnorm_fp8(m, q, s, x, w)


def test_rmsnorm_fp8_main(example):
    example("rmsnorm_fp8").main()


# ---------------------------------------------------------------- GQA flash attention (examples/flash_attention.py)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_flash_attention(example, target, layout):
    m = example("flash_attention")
    b, hq, hk, s, d = 1, 4, 2, 96, 32
    shape = (lambda h: (b, s, h, d)) if layout == "bshd" else (lambda h: (b, h, s, d))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*shape(h), generator=g).half() for h in (hq, hk, hk))
    kern = tilelang.compile(m.flash_attention_fwd(b, hq, s, d, True, 32, 32, 1, 128, "float16", hq // hk, layout),
                            out_idx=[3], target=target)
    o = kern(q, k, v)
    t = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    ref = torch.nn.functional.scaled_dot_product_attention(t(q).float(), t(k).float(), t(v).float(), is_causal=True,
                                                           enable_gqa=True)
    assert (o.float() - t(ref)).abs().max().item() <= 2e-2


# ---------------------------------------------------------------- NVRTC sm_90a at the benchmark's sizes


COMPILES = [
    ("fp8_gemm", "fp8_gemm_program", (4096, 7168, 2048, 128, 128, 4, 256), "WgmmaE4M3"),
    ("fp8_gemm", "fp8_gemm_program", (4096, 2112, 7168, 128, 64, 6, 256), "WgmmaE4M3"),
    ("fp8_gemm", "fp8_gemm_overlap_program", (4096, 7168, 2048, 128, 128, 2, 256), "wgmma_wait<1>"),
    ("paged_decode", "paged_decode_program", (64, 32, 8, 128, 16384, 16, 256, 2, 64, 16, 2, 128), "cp_async"),
    ("rmsnorm_fp8", "rmsnorm_fp8_program", (4096, 7168), "__nv_fp8_e4m3"),
]


@needs_nvrtc
@pytest.mark.parametrize("mod,fn,args,marker", COMPILES, ids=[f"{c[0]}-{i}" for i, c in enumerate(COMPILES)])
def test_showcase_compiles(example, mod, fn, args, marker):
    func = getattr(example(mod), fn)(*args)
    k = tilelang.compile(func, out_idx=[-2, -1] if mod == "rmsnorm_fp8" else [-1], target="cuda")
    src = k.get_kernel_source()
    assert "__global__" in src and marker in src and k._impl.module.cubin[:4] == b"\x7fELF"
    if mod == "fp8_gemm":  # A, B and the activation scales ride one TMA pipeline fed by a producer warpgroup
        assert src.count("tma_load_2d") >= 3 and "warp-specialized" in src


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 7168, 2048), (300, 2112, 640)])
def test_fp8_gemm_gpu(example, shape):
    m = example("fp8_gemm")
    M, N, K = shape
    k = tilelang.compile(m.fp8_gemm_program(M, N, K, 128, 128, 4, 256), out_idx=[-1], target="cuda")
    a, sfa, b, sfb = _fp8_case(m, M, N, K, "cuda")
    d = k(a, b, sfa.T.contiguous(), sfb)
    assert m.calc_diff(d.float(), m.reference(a, sfa, b, sfb)) < 1e-4


@pytest.mark.gpu
def test_paged_decode_gpu(example):
    m = example("paged_decode")
    lens = [4096, 1000, 17, 0, 2048, 4095]
    q, k, v, table, sl = m.random_cache(6, 32, 8, 128, 16, lens, device="cuda")
    for ns, bn, st, th in ((1, 64, 2, 128), (8, 32, 3, 32)):
        kern = tilelang.compile(m.paged_decode_program(6, 32, 8, 128, k.shape[0], 16, table.shape[1], ns, bn, 16, st,
                                                       th), out_idx=[-1], target="cuda")
        out = kern(q, k, v, table, sl, torch.empty(6, 32, ns, device="cuda"),
                   torch.empty(6, 32, ns, 128, device="cuda"))
        assert (out.float() - m.reference(q, k, v, table, sl).float()).abs().max().item() <= 2e-2


@pytest.mark.gpu
def test_rmsnorm_fp8_gpu(example):
    m = example("rmsnorm_fp8")
    x = torch.randn(1000, 7168, device="cuda").bfloat16()
    w = torch.randn(7168, device="cuda").bfloat16()
    k = tilelang.compile(m.rmsnorm_fp8_program(1000, 7168), out_idx=[-2, -1], target="cuda")
    q, s = k(x, w)
    _check_rmsnorm_fp8(m, q, s, x, w)


@pytest.mark.gpu
def test_fp8_gemm_autotune_gpu(example, tmp_path, monkeypatch):
    """The example's autotuned entry: a first call builds the default config (no timing); .tune times the
    candidates on the GPU, checks each against the dequantized reference and caches the winner."""
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(tmp_path))
    m = example("fp8_gemm")
    k = m.fp8_gemm_tuned(1024, 1024, 1024)
    assert m.fp8_gemm_tuned.last_result.source == "default" and k.config == m.DEFAULTS["*"]
    k = m.fp8_gemm_tuned.tune(1024, 1024, 1024)
    res = m.fp8_gemm_tuned.last_result
    assert res.source == "tuned" and k.config in m.TUNE_CONFIGS and len(res.timings) >= 1
    assert len(list((tmp_path / "tilelang_autotune").glob("*.json"))) == 1
    a, sfa, b, sfb = _fp8_case(m, 1024, 1024, 1024, "cuda")
    assert m.calc_diff(k(a, b, sfa.T.contiguous(), sfb).float(), m.reference(a, sfa, b, sfb)) < 1e-4


def test_fp8_gemm_overlap_thread_program(example):
    """The wgmma + TMA thread program of the overlapped GEMM runs on the thread interpreter, which refuses any
    read of an accumulator whose wgmma is still in flight: the deferred waits (T.gemm(wg_wait=-1)) sit where
    each partial is first read, and the result matches."""
    m = example("fp8_gemm")
    M, N, K = 128, 128, 512
    k = tilelang.compile(m.fp8_gemm_overlap_program(M, N, K, 128, 128, 2, 256, 0), out_idx=[-1],
                         target="cuda_threads", pass_configs={"cuda_tma": True})
    src = k.get_kernel_source()
    assert "wgmma_wait<1>" in src and "wgmma_wait<0>" in src
    a, sfa, b, sfb = _fp8_case(m, M, N, K)
    assert m.calc_diff(k(a, b, sfa.T.contiguous(), sfb).float(), m.reference(a, sfa, b, sfb)) < 1e-4
