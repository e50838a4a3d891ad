"""The split-K bf16 path for small M: heuristic (CPU), NVRTC compile of every instantiation it picks
for DeepGEMM's test shapes (CPU, runs in CI), and the kernel against the reference (GPU)."""

import logging

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import gemv, reference, splitk
from deepgemm.splitk import SplitKConfig, effective_splits, pick_splitk, splitk_key

# DeepGEMM's test_bf16 forward shapes (N, K); the last two have fp32 outputs there.
UPSTREAM_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048),
               (256, 7168), (129280, 7168)]
FP32_OUT_NK = {(256, 7168), (129280, 7168)}


def test_effective_splits_never_leave_a_split_empty():
    for kb in range(2, 300):
        for s in range(2, 33):
            se = effective_splits(kb, s)
            per = -(-kb // se)
            assert 1 <= se <= s and (se - 1) * per < kb <= se * per


@pytest.mark.parametrize("m", [1, 7, 64, 128])
@pytest.mark.parametrize("n,k", UPSTREAM_NK)
def test_pick_splitk_fits_one_wave(m, n, k):
    cfg = pick_splitk(m, n, k, 132)
    if cfg is None:
        return
    gx, gy, gz = cfg.grid(m, n)
    assert gx * gy * gz <= 132 and cfg.splits >= 2
    assert cfg.block_m == 64 if m <= 64 else cfg.block_m in (64, 128)
    assert cfg.smem_bytes <= 232448
    assert effective_splits(-(-k // 64), cfg.splits) == cfg.splits


def test_pick_splitk_takes_the_shapes_that_cannot_fill_the_gpu():
    # M = 1 / 128 with N of a few thousand: the persistent kernel would need 16-wide tiles to fill 132 SMs.
    for m, n, k in ((1, 2112, 7168), (1, 576, 7168), (1, 4096, 7168), (1, 256, 7168), (1, 7168, 16384),
                    (128, 2112, 7168), (128, 576, 7168), (128, 256, 7168), (128, 4096, 7168)):
        assert pick_splitk(m, n, k, 132) is not None, (m, n, k)
    # every split reduces a slice from M = 65 on (H200: faster at M = 128, 3 % slower at M = 1)
    assert pick_splitk(128, 2112, 7168, 132).par_reduce and not pick_splitk(1, 2112, 7168, 132).par_reduce
    # Enough wide tiles already: 4096 rows, or N = 24576 / 32768 / 129280; and M = 128 shapes where the
    # persistent kernel measured as fast (H200: 128x7168x16384 split-K 79.2 us vs 76.2 us, 128x7168x2048 21.9 vs 15.8).
    for m, n, k in ((4096, 2112, 7168), (128, 24576, 1536), (1, 32768, 512), (1, 129280, 7168),
                    (128, 7168, 16384), (128, 7168, 2048)):
        assert pick_splitk(m, n, k, 132) is None, (m, n, k)
    assert pick_splitk(1, 4096, 64, 132) is None  # one K block: nothing to split


def test_pick_splitk_logs_why_not(caplog):
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        splitk._pick.cache_clear()
        assert pick_splitk(4096, 4096, 7168, 132) is None
    assert any("split-K not used" in r.getMessage() for r in caplog.records)


def upstream_keys():
    keys = set()
    for m in (1, 128):
        for n, k in UPSTREAM_NK:
            cfg = pick_splitk(m, n, k, 132)
            if cfg is None:
                continue
            out = torch.float32 if (n, k) in FP32_OUT_NK else torch.bfloat16
            keys.add(splitk_key(cfg, n, k, out, None))
            if out == torch.bfloat16:
                keys.add(splitk_key(cfg, n, k, out, torch.bfloat16))  # bf16 accumulation (c = bf16)
    # odd shapes of the GPU tests below
    for m, n, k in ODD:
        cfg = pick_splitk(m, n, k, 132) or SplitKConfig(64 if m <= 64 else 128, 64, 3, 4, 132)
        keys.add(splitk_key(cfg, n, k, torch.float32, torch.float32))
    return sorted(keys, key=lambda x: x.expression)


ODD = [(1, 200, 272), (5, 129, 1040), (70, 2112, 1536), (33, 1000, 4104)]
KEYS = None


def _keys():
    global KEYS
    if KEYS is None:
        KEYS = sorted(set(upstream_keys()) | mn_major_keys(), key=lambda x: x.expression)
    return KEYS


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_splitk_kernels_compile_without_spills(h):
    keys = _keys()
    assert len(keys) >= 12
    h.check_compiled_batches(splitk.compile_kernels, keys)


def test_cpu_path_unchanged_by_splitk():
    # The CPU reference never goes through the CUDA dispatch: same answer for a split-K-sized shape.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 256, generator=g).bfloat16()
    b = torch.randn(576, 256, generator=g).bfloat16()
    d = torch.empty(1, 576, dtype=torch.bfloat16)
    deepgemm.bf16_gemm_nt(a, b, d)
    torch.testing.assert_close(d.float(), (a.double() @ b.double().T).float(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- GPU


def _ab(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((m, k), generator=g, device="cuda").bfloat16()
    b = torch.randn((n, k), generator=g, device="cuda").bfloat16()
    return a, b


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 128])
@pytest.mark.parametrize("n,k", [(2112, 7168), (576, 7168), (4096, 7168), (256, 7168)])
@pytest.mark.parametrize("acc", [False, True])
def test_splitk_upstream_shapes(m, n, k, acc, caplog):
    a, b = _ab(m, n, k, seed=m + n)
    out = torch.float32 if (n, k) in FP32_OUT_NK else torch.bfloat16
    c = torch.randn(m, n, device="cuda").to(out) if acc else None
    d = torch.empty(m, n, dtype=out, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d, c=c)
    msgs = [r.getMessage() for r in caplog.records]
    if m == 1 and gemv.allowed():  # the GEMV kernel takes M = 1 (tests/test_gemv.py)
        assert any("GEMV kernel" in t for t in msgs), msgs
    elif pick_splitk(m, n, k, deepgemm.get_num_sms()) is not None:
        assert any("split-K kernel" in t for t in msgs)
    elif acc and out == torch.bfloat16:  # a bf16 C: the persistent kernel's staged epilogue reads it in place
        assert any("C read in place by the staged epilogue" in t for t in msgs), msgs
    ref = reference.bf16_gemm_nt(a, b, None if c is None else c.float())
    assert deepgemm.testing.calc_diff(d, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", ODD)
@pytest.mark.parametrize("bn,splits", [(64, 2), (128, 3), (256, 5)])
def test_splitk_forced_configs_odd_shapes(m, n, k, bn, splits):
    from deepgemm import cuda_gemm

    a, b = _ab(m, n, k, seed=7)
    kb = -(-k // 64)
    cfg = SplitKConfig(block_m=64 if m <= 64 else 128, block_n=bn, splits=effective_splits(kb, min(splits, kb)),
                       stages=splitk.max_stages(64 if m <= 64 else 128, bn), num_sms=132)
    c = torch.randn(m, n, device="cuda")
    d = torch.empty(m, n, device="cuda")
    cuda_gemm.dense(a, None, b, None, d, c, config=cfg)
    ref = reference.bf16_gemm_nt(a, b, c)
    torch.testing.assert_close(d, ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())


@pytest.mark.gpu
def test_splitk_deterministic_repeated_and_in_place():
    a, b = _ab(128, 2112, 7168, seed=3)
    d1 = torch.empty(128, 2112, dtype=torch.bfloat16, device="cuda")
    d2 = torch.empty_like(d1)
    deepgemm.bf16_gemm_nt(a, b, d1)
    for _ in range(3):  # the tile counters are reset by every launch
        deepgemm.bf16_gemm_nt(a, b, d2)
        deepgemm.testing.assert_bitwise_equal(d1, d2, "split-K repeated")
    c = torch.randn(128, 2112, device="cuda").bfloat16()
    want = reference.bf16_gemm_nt(a, b, c.float())
    deepgemm.bf16_gemm_nt(a, b, c, c=c)  # c is d
    assert deepgemm.testing.calc_diff(c, want) < 1e-5


@pytest.mark.gpu
def test_splitk_in_a_cuda_graph(h):
    a, b = _ab(2, 4096, 7168, seed=4)  # M = 2: split-K (M = 1 is the GEMV kernel's)
    assert pick_splitk(2, 4096, 7168, deepgemm.get_num_sms()) is not None
    d = torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda")
    h.check_graph_replay(lambda: deepgemm.bf16_gemm_nt(a, b, d), d, "graph replay")


@pytest.mark.gpu
def test_splitk_off_switch(monkeypatch, caplog):
    monkeypatch.setenv("DEEPGEMM_SPLITK", "0")
    a, b = _ab(2, 576, 7168, seed=5)
    d = torch.empty(2, 576, dtype=torch.bfloat16, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d)
    assert any("DEEPGEMM_SPLITK=0" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, reference.bf16_gemm_nt(a, b, None)) < 1e-5


# ----------------------------------------------------------------------------- MN-major bf16 operands in place


def test_mn_major_detection_and_alignment(caplog):
    k_major = torch.zeros(64, 256, dtype=torch.bfloat16)
    mn_major = torch.zeros(256, 64, dtype=torch.bfloat16).T  # [64, 256] stored [K, M]
    odd = torch.zeros(256, 63, dtype=torch.bfloat16).T  # K stride 63 elements: TMA cannot read it
    assert not splitk.is_mn_major(k_major) and splitk.is_mn_major(mn_major) and splitk.is_mn_major(odd)
    assert splitk.in_place_ok(k_major, "a") and splitk.in_place_ok(mn_major, "a")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        assert not splitk.in_place_ok(odd, "b")
    assert any("b: MN-major but not readable in place" in r.getMessage() for r in caplog.records)


def mn_major_keys():
    """Kernels of the MN-major GPU tests below (and DeepGEMM's backward rows at these sizes)."""
    keys = set()
    for (m, n, k), (a_mn, b_mn) in MN_CASES:
        cfg = splitk.pick_tiles(m, n, k, 132)
        for out, c in ((torch.bfloat16, None), (torch.float32, torch.float32)):
            keys.add(splitk_key(cfg, n, k, out, c, a_mn, b_mn))
    return keys


# (M, N, K), (A MN-major, B MN-major): DeepGEMM's dgrad (B MN-major) and wgrad (both) at test sizes,
# small M (split-K), and a K tail.
MN_CASES = [((1024, 2048, 1536), (False, True)), ((2112, 1024, 1024), (True, True)), ((128, 2112, 7168), (False, True)),
            ((256, 576, 1000), (True, False)), ((4096, 4096, 7168), (True, True))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MN_CASES, ids=[f"{m}x{n}x{k}-{int(x)}{int(y)}" for (m, n, k), (x, y) in MN_CASES])
@pytest.mark.parametrize("acc", [False, True])
def test_mn_major_read_in_place(case, acc, caplog):
    (m, n, k), (a_mn, b_mn) = case
    a, b = _ab(m, n, k, seed=11)
    a_st = a.T.contiguous() if a_mn else a  # stored [K, M]: the "t" layout
    b_st = b.T.contiguous() if b_mn else b  # stored [K, N]: the "n" layout
    layout = ("t" if a_mn else "n") + ("n" if b_mn else "t")
    out = torch.float32 if acc else torch.bfloat16
    c = torch.randn(m, n, device="cuda") if acc else None
    d = torch.empty(m, n, dtype=out, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        getattr(deepgemm, f"bf16_gemm_{layout}")(a_st, b_st, d, c=c)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("read in place" in x for x in msgs) and not any("copied K-major" in x for x in msgs), msgs
    assert deepgemm.testing.calc_diff(d, reference.bf16_gemm_nt(a, b, c)) < 1e-5


@pytest.mark.gpu
def test_mn_major_unaligned_stride_is_copied(caplog):
    a, b = _ab(100, 129, 512, seed=12)  # N = 129: B stored [K, N] has a 258-byte row, not TMA-readable
    d = torch.empty(100, 129, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nn(a, b.T.contiguous(), d)
    assert any("not readable in place" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(d, reference.bf16_gemm_nt(a, b, None), rtol=1e-4, atol=1e-2)


# ----------------------------------------------------------------------------- fp8 split-K (1x128 / 128x128 scales)

# DeepSeek's (N, K) shapes of issue 19 and DeepGEMM's test_fp8_fp4 forward rows.
FP8_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
FP8_M = (1, 16, 64, 128)
# Forced configs on odd shapes (K tails, N not a multiple of the tile, M across two m-blocks).
# Elementwise bound of an fp8 result against the float64 reference, relative to max |D|: Hopper's fp8 wgmma adds
# inside a 128-K block with reduced precision (docs/deepgemm.md: 3.8e-5 .. 1.3e-4 of max |D| on the FP4 e4m3
# kernels); on the H200 these fp32-C split-K cases reached 2.6e-4 (session 28), so 1e-3 (DeepGEMM's own bar).
FP8_ELEMENT_BOUND = 1e-3
FP8_ODD = [((1, 200, 272), (64, 64, 2)), ((5, 129, 1040), (64, 128, 3)), ((70, 2112, 1536), (64, 64, 4)),
           ((130, 1000, 4112), (128, 128, 5)), ((33, 1000, 4112), (64, 128, 33))]


def fp8_cfg(m, n, k, bm, bn, splits):
    kb = -(-k // 128)
    return SplitKConfig(block_m=bm, block_n=bn, splits=effective_splits(kb, min(splits, kb)),
                        stages=splitk.max_stages(bm, bn, fp8=True), num_sms=132, fp8=True)


def fp8_keys():
    keys = set()
    for m in FP8_M:
        for n, k in FP8_NK:
            cfg = pick_splitk(m, n, k, 132, "fp8")
            if cfg is not None:
                keys.add(splitk_key(cfg, n, k, torch.bfloat16, None, fp8=True))
    for (m, n, k), (bm, bn, s) in FP8_ODD:
        keys.add(splitk_key(fp8_cfg(m, n, k, bm, bn, s), n, k, torch.float32, torch.float32, fp8=True))
    # fp32 D with fp32 C (DeepGEMM's fp32-output rows) and a bf16 C into bf16 D at one upstream shape
    cfg = pick_splitk(1, 2112, 7168, 132, "fp8")
    keys.add(splitk_key(cfg, 2112, 7168, torch.float32, torch.float32, fp8=True))
    keys.add(splitk_key(cfg, 2112, 7168, torch.bfloat16, torch.bfloat16, fp8=True))
    return sorted(keys, key=lambda x: x.expression)


def test_fp8_pick_splitk_shapes():
    # Few output tiles (N of a few thousand, M <= 128): split-K with 64/128-wide tiles that fit one wave.
    for m, n, k in ((1, 2112, 7168), (1, 576, 7168), (1, 4096, 7168), (1, 7168, 16384), (16, 2112, 7168),
                    (64, 576, 7168), (128, 576, 7168)):
        cfg = pick_splitk(m, n, k, 132, "fp8")
        assert cfg is not None, (m, n, k)
        gx, gy, gz = cfg.grid(m, n)
        assert cfg.block_n in (64, 128) and gx * gy * gz <= 132 and gz >= 2
        assert effective_splits(-(-k // 128), cfg.splits) == cfg.splits
    # Enough tiles already (N = 24576 / 32768), M = 4096, or one K block: the persistent kernel; and where split-K
    # measured slower on the H200 (R2): 1 x 7168 x 2048 (model 0.93), 64 / 128 x 2112 / 4096 x 7168 (0.74-0.84),
    # 128 x 7168 x 16384 (0.93).
    for m, n, k in ((1, 24576, 1536), (128, 32768, 512), (4096, 2112, 7168), (1, 4096, 128), (1, 7168, 2048),
                    (64, 2112, 7168), (64, 4096, 7168), (128, 2112, 7168), (128, 4096, 7168), (128, 7168, 16384)):
        assert pick_splitk(m, n, k, 132, "fp8") is None, (m, n, k)


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_fp8_splitk_kernels_compile_without_spills(h):
    keys = fp8_keys()
    assert len(keys) >= 10 and all(k.fp8 for k in keys)
    h.check_compiled_batches(splitk.compile_kernels, keys)


def test_fp8_splitk_config_must_divide_128():
    a8, sfa, b8, sfb = deepgemm_fp8(1, 256, 256)
    with pytest.raises(tilehal.ArgumentError, match="block_n"):
        # checked before anything touches a device (the tensors here are on the CPU)
        splitk.dense_fp8(a8, sfa, b8, sfb, torch.empty(1, 256), None, SplitKConfig(64, 256, 2, 4, 132, fp8=True))
    with pytest.raises(tilehal.ArgumentError, match="config.fp8"):
        splitk.dense_fp8(a8, sfa, b8, sfb, torch.empty(1, 256), None, SplitKConfig(64, 128, 2, 8, 132))
    # fp8 stages hold the activation scales too: never more shared memory than a CTA has
    for bm in (64, 128):
        for bn in (64, 128):
            assert splitk.smem_bytes(bm, bn, splitk.max_stages(bm, bn, fp8=True), fp8=True) <= 232448


def deepgemm_fp8(m, n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((m, k), generator=g).bfloat16()
    b = torch.randn((n, k), generator=g).bfloat16()
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    return tuple(t.to(device) for t in (a8, sfa, b8, sfb))


@pytest.mark.gpu
@pytest.mark.parametrize("m", FP8_M)
@pytest.mark.parametrize("n,k", FP8_NK)
def test_fp8_splitk_upstream_shapes(m, n, k, caplog):
    a8, sfa, b8, sfb = deepgemm_fp8(m, n, k, "cuda", seed=m + n)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d)
    if pick_splitk(m, n, k, deepgemm.get_num_sms(), "fp8") is not None:
        assert any("fp8" in r.getMessage() and "split-K kernel" in r.getMessage() for r in caplog.records)
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)
    assert deepgemm.testing.calc_diff(d, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_ODD, ids=[f"{m}x{n}x{k}" for (m, n, k), _ in FP8_ODD])
def test_fp8_splitk_forced_odd_shapes_fp32_c(case):
    from deepgemm import cuda_gemm

    (m, n, k), (bm, bn, s) = case
    a8, sfa, b8, sfb = deepgemm_fp8(m, n, k, "cuda", seed=9)
    c = torch.randn(m, n, device="cuda")
    d = torch.empty(m, n, device="cuda")
    cuda_gemm.dense(a8, sfa, b8, sfb, d, c, config=fp8_cfg(m, n, k, bm, bn, s))
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, c)
    assert deepgemm.testing.calc_diff(d, ref) < 1e-5
    torch.testing.assert_close(d, ref, rtol=0, atol=FP8_ELEMENT_BOUND * ref.abs().max().item())


@pytest.mark.gpu
def test_fp8_splitk_deterministic_graph_and_in_place():
    m, n, k = 1, 2112, 7168
    a8, sfa, b8, sfb = deepgemm_fp8(m, n, k, "cuda", seed=2)
    assert pick_splitk(m, n, k, deepgemm.get_num_sms(), "fp8") is not None
    d1 = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    d2 = torch.empty_like(d1)
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d1)
    for _ in range(3):  # every launch leaves the tile counters zero
        deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d2)
        deepgemm.testing.assert_bitwise_equal(d1, d2, "fp8 split-K repeated")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d2)
    d2.zero_()
    graph.replay()
    torch.cuda.synchronize()
    deepgemm.testing.assert_bitwise_equal(d1, d2, "fp8 split-K graph replay")
    c = torch.randn(m, n, device="cuda")  # fp32 C that is D (fp32 out)
    want = reference.fp8_gemm_nt(a8, sfa, b8, sfb, c)
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), c, c=c)
    torch.testing.assert_close(c, want, rtol=0, atol=FP8_ELEMENT_BOUND * want.abs().max().item())


# ----------------------------------------------------------------------------- multicast A (2-CTA clusters)

# (fp8, (M, N, K), (block_m, block_n, splits), C / D dtype): odd n-block counts (a phantom CTA), M = 1 (the
# second A half is all outside the tensor), M across two m-blocks, K tails.
MCAST_CASES = [(False, (128, 2112, 7168), (128, 64, 4), torch.bfloat16), (False, (1, 576, 7168), (64, 64, 14), None),
               (False, (70, 1000, 4104), (64, 128, 5), torch.float32), (True, (128, 2112, 7168), (128, 64, 2), None),
               (True, (1, 4096, 7168), (64, 128, 4), torch.float32), (True, (130, 1000, 4112), (64, 64, 3), None),
               (True, (5, 129, 1040), (64, 128, 3), torch.float32)]


def mcast_cfg(fp8, m, n, k, bm, bn, splits):
    kb = -(-k // (128 if fp8 else 64))
    return SplitKConfig(block_m=bm, block_n=bn, splits=effective_splits(kb, min(splits, kb)),
                        stages=splitk.max_stages(bm, bn, fp8), num_sms=132, multicast=2, fp8=fp8)


def mcast_keys():
    keys = []
    for fp8, (m, n, k), (bm, bn, s), cd in MCAST_CASES:
        out = cd or torch.bfloat16
        keys.append(splitk_key(mcast_cfg(fp8, m, n, k, bm, bn, s), n, k, out, cd, fp8=fp8))
    return keys


def test_mcast_grid_pads_to_whole_clusters():
    cfg = mcast_cfg(False, 128, 2112, 7168, 128, 64, 4)
    assert cfg.grid(128, 2112) == (34, 1, 4)  # 33 n-blocks + one phantom
    assert splitk_key(cfg, 2112, 7168, torch.bfloat16, None).expression.endswith(", 2>")
    assert not splitk_key(dataclasses_replace(cfg, multicast=1), 2112, 7168, torch.bfloat16, None).expression.endswith(
        ", 2>")


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_mcast_splitk_kernels_compile_without_spills(h):
    keys = mcast_keys()
    h.check_compiled_batches(splitk.compile_kernels, keys)


@pytest.mark.gpu
@pytest.mark.parametrize("case", MCAST_CASES, ids=[f"{'fp8' if c[0] else 'bf16'}-{c[1][0]}x{c[1][1]}x{c[1][2]}"
                                                   for c in MCAST_CASES])
def test_mcast_splitk_matches_reference(case):
    from deepgemm import cuda_gemm

    fp8, (m, n, k), (bm, bn, s), cd = case
    cfg = mcast_cfg(fp8, m, n, k, bm, bn, s)
    if fp8:
        a8, sfa, b8, sfb = deepgemm_fp8(m, n, k, "cuda", seed=21)
        c = None if cd is None else torch.randn(m, n, device="cuda").to(cd)
        d = torch.empty(m, n, dtype=cd or torch.bfloat16, device="cuda")
        cuda_gemm.dense(a8, sfa, b8, sfb, d, c, config=cfg)
        ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None if c is None else c.float())
        again = torch.empty_like(d)
        cuda_gemm.dense(a8, sfa, b8, sfb, again, c, config=cfg)
    else:
        a, b = _ab(m, n, k, seed=21)
        c = None if cd is None else torch.randn(m, n, device="cuda").to(cd)
        d = torch.empty(m, n, dtype=cd or torch.bfloat16, device="cuda")
        cuda_gemm.dense(a, None, b, None, d, c, config=cfg)
        ref = reference.bf16_gemm_nt(a, b, None if c is None else c.float())
        again = torch.empty_like(d)
        cuda_gemm.dense(a, None, b, None, again, c, config=cfg)
    assert deepgemm.testing.calc_diff(d, ref) < 1e-5
    deepgemm.testing.assert_bitwise_equal(d, again, "multicast split-K repeated")


# par_reduce multicast plans whose grid (padded to whole clusters) is one wave: issue 18's 128 x 4096 x 7168 with a
# bf16 C, a phantom CTA (33 n-blocks), two m-blocks with fp32 C, fp8.
MCAST_PAR_CASES = [(False, (128, 4096, 7168), (128, 64, 2), torch.bfloat16), (False, (128, 2112, 7168), (128, 64, 3), None),
                   (False, (70, 1000, 4104), (64, 128, 5), torch.float32), (True, (128, 2112, 7168), (128, 64, 2), None),
                   (True, (1, 4096, 7168), (64, 128, 4), torch.float32)]


def test_mcast_par_cases_fit_one_wave():
    for fp8, (m, n, k), (bm, bn, s), _ in MCAST_PAR_CASES:
        gx, gy, gz = mcast_cfg(fp8, m, n, k, bm, bn, s).grid(m, n)
        assert gx * gy * gz <= 132 and gx % 2 == 0


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_mcast_par_reduce_kernels_compile_without_spills(h):
    keys = []
    for fp8, (m, n, k), (bm, bn, s), cd in MCAST_PAR_CASES:
        cfg = dataclasses_replace(mcast_cfg(fp8, m, n, k, bm, bn, s), par_reduce=True)
        keys.append(splitk_key(cfg, n, k, cd or torch.bfloat16, cd, fp8=fp8))
    assert all(key.reduce == 1 and key.multicast == 2 for key in keys)
    h.check_compiled_batches(splitk.compile_kernels, keys)


@pytest.mark.gpu
@pytest.mark.parametrize("case", MCAST_PAR_CASES, ids=[f"{'fp8' if c[0] else 'bf16'}-{c[1][0]}x{c[1][1]}x{c[1][2]}"
                                                       for c in MCAST_PAR_CASES])
def test_mcast_par_reduce_bitwise_as_without_multicast(case, caplog):
    # Multicast changes where A comes from, not the arithmetic: the par_reduce multicast plan (kept where the clusters
    # fit, else the last CTA reduces: either way the same split order) gives the bits of the plan without it.
    from deepgemm import cuda_gemm

    fp8, (m, n, k), (bm, bn, s), cd = case
    mc = dataclasses_replace(mcast_cfg(fp8, m, n, k, bm, bn, s), par_reduce=True)
    plain = dataclasses_replace(mc, multicast=1)
    c = None if cd is None else torch.randn(m, n, device="cuda").to(cd)
    outs = []
    for cfg in (mc, mc, plain):
        d = torch.empty(m, n, dtype=cd or torch.bfloat16, device="cuda")
        if fp8:
            a8, sfa, b8, sfb = deepgemm_fp8(m, n, k, "cuda", seed=25)
            with caplog.at_level(logging.DEBUG, logger="deepgemm"):
                cuda_gemm.dense(a8, sfa, b8, sfb, d, c, config=cfg)
            ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None if c is None else c.float())
        else:
            a, b = _ab(m, n, k, seed=25)
            with caplog.at_level(logging.DEBUG, logger="deepgemm"):
                cuda_gemm.dense(a, None, b, None, d, c, config=cfg)
            ref = reference.bf16_gemm_nt(a, b, None if c is None else c.float())
        assert deepgemm.testing.calc_diff(d, ref) < 1e-5
        outs.append(d)
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[1], "multicast par_reduce repeated")
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[2], "multicast par_reduce vs without multicast")


def test_mcast_heuristic_fits_one_wave_padded(monkeypatch):
    shapes = [(m, n, k) for m in (1, 64, 128) for n, k in UPSTREAM_NK + FP8_NK]
    try:
        monkeypatch.setattr(splitk, "MCAST_MIN_M", 64)
        monkeypatch.setattr(splitk, "MCAST_COST", 0.8)
        monkeypatch.setattr(splitk, "FP8_MIN_GAIN", 1.0)
        splitk._pick.cache_clear()
        seen = 0
        for m, n, k in shapes:
            for kind in ("bf16", "fp8"):
                cfg = pick_splitk(m, n, k, 132, kind)
                if cfg is None:
                    continue
                gx, gy, gz = cfg.grid(m, n)
                assert gx * gy * gz <= 132 and gx % cfg.multicast == 0
                assert cfg.multicast == 1 or (m >= 64 and -(-n // cfg.block_n) >= 2)
                assert cfg.fp8 == (kind == "fp8")
                seen += cfg.multicast > 1
        assert seen > 0
    finally:
        monkeypatch.undo()
        splitk._pick.cache_clear()
    # the default: no multicast anywhere
    assert all((c := pick_splitk(m, n, k, 132)) is None or c.multicast == 1 for m, n, k in shapes)


# ----------------------------------------------------------------------------- every split reduces a slice (par_reduce)

# (fp8, (m, n, k), (bm, bn, splits), C/D dtype or None for bf16 D without C): tiles with N and K not multiples of
# the block, C accumulation (fp32 and bf16), fp32 out, M = 1 .. 130
PAR_CASES = [(False, (128, 2112, 7168), (128, 128, 7), None), (False, (128, 576, 7168), (128, 64, 14), torch.bfloat16),
             (False, (130, 1000, 4104), (128, 128, 5), torch.float32), (False, (1, 200, 272), (64, 64, 3), torch.float32),
             (False, (33, 129, 1040), (64, 256, 16), torch.bfloat16), (True, (128, 2112, 7168), (128, 64, 4), None),
             (True, (64, 576, 7168), (64, 64, 7), torch.float32), (True, (5, 129, 1040), (64, 128, 3), torch.float32)]


def par_cfg(fp8, m, n, k, bm, bn, splits, par=True, cluster=False):
    kb = -(-k // (128 if fp8 else 64))
    return SplitKConfig(block_m=bm, block_n=bn, splits=effective_splits(kb, min(splits if not cluster else min(splits, 8),
                                                                                 kb)),
                        stages=splitk.max_stages(bm, bn, fp8), num_sms=132, fp8=fp8, par_reduce=par and not cluster,
                        cluster_reduce=cluster)


def par_keys():
    keys = []
    for fp8, (m, n, k), (bm, bn, s), cd in PAR_CASES:
        for cluster in (False, True):
            cfg = par_cfg(fp8, m, n, k, bm, bn, s, cluster=cluster)
            keys.append(splitk_key(cfg, n, k, cd or torch.bfloat16, cd, fp8=fp8))
    return keys


def test_par_reduce_key_and_one_split():
    cfg = par_cfg(False, 128, 2112, 7168, 128, 128, 7)
    assert splitk_key(cfg, 2112, 7168, torch.bfloat16, None).expression.endswith(", 1, 1>")
    one = dataclasses_replace(cfg, splits=1)  # one split: nothing to reduce, the plain kernel
    assert splitk_key(one, 2112, 7168, torch.bfloat16, None).reduce == 0
    clu = dataclasses_replace(cfg, par_reduce=False, cluster_reduce=True)
    assert splitk_key(clu, 2112, 7168, torch.bfloat16, None).expression.endswith(", 1, 2>")
    assert clu.smem_bytes >= 128 * 136 * 4


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_par_reduce_kernels_compile_without_spills(h):
    h.check_compiled_batches(splitk.compile_kernels, par_keys())


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAR_CASES, ids=[f"{'fp8' if c[0] else 'bf16'}-{c[1][0]}x{c[1][1]}x{c[1][2]}"
                                                 for c in PAR_CASES])
@pytest.mark.parametrize("cluster", [False, True], ids=["par", "cluster"])
def test_par_reduce_matches_reference_and_last_cta_bitwise(case, cluster):
    from deepgemm import cuda_gemm

    fp8, (m, n, k), (bm, bn, s), cd = case
    cfg = par_cfg(fp8, m, n, k, bm, bn, s, cluster=cluster)
    last = dataclasses_replace(cfg, par_reduce=False, cluster_reduce=False)
    c = None if cd is None else torch.randn(m, n, device="cuda").to(cd)
    d = torch.empty(m, n, dtype=cd or torch.bfloat16, device="cuda")
    outs = []
    if fp8:
        a8, sfa, b8, sfb = deepgemm_fp8(m, n, k, "cuda", seed=23)
        ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None if c is None else c.float())
        for conf in (cfg, cfg, last):  # twice: the counters are back to 0 after a launch
            cuda_gemm.dense(a8, sfa, b8, sfb, d, c, config=conf)
            outs.append(d.clone())
    else:
        a, b = _ab(m, n, k, seed=23)
        ref = reference.bf16_gemm_nt(a, b, None if c is None else c.float())
        for conf in (cfg, cfg, last):
            cuda_gemm.dense(a, None, b, None, d, c, config=conf)
            outs.append(d.clone())
    assert deepgemm.testing.calc_diff(outs[0], ref) < 1e-5
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[1], "reduction repeated")
    # the same partials summed in the same split order: the last-CTA reduction's bits
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[2], "par / cluster reduction vs last-CTA")


@pytest.mark.gpu
def test_par_reduce_refuses_a_grid_past_one_wave():
    from deepgemm import cuda_gemm

    a, b = _ab(128, 4096, 1024, seed=2)
    cfg = SplitKConfig(block_m=128, block_n=64, splits=4, stages=4, num_sms=132, par_reduce=True)  # 64 x 4 CTAs
    d = torch.empty(128, 4096, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(tilehal.ArgumentError, match="par_reduce"):
        cuda_gemm.dense(a, None, b, None, d, None, config=cfg)


def test_cluster_reduce_refuses_more_than_8_splits_before_any_launch():
    a = torch.zeros(128, 7168, dtype=torch.bfloat16)
    b = torch.zeros(256, 7168, dtype=torch.bfloat16)
    d = torch.empty(128, 256, dtype=torch.bfloat16)
    cfg = SplitKConfig(block_m=128, block_n=64, splits=14, stages=4, num_sms=132, cluster_reduce=True)
    with pytest.raises(tilehal.ArgumentError, match="cluster_reduce: expected multicast 1 and at most 8 splits"):
        splitk.dense_bf16(a, b, d, None, cfg)


class _FakeKernel:
    """Stands in for a compiled split-K kernel: answers the driver's cluster count, records launches."""

    def __init__(self, key, clusters):
        self.key, self.clusters, self.symbol, self.launches = key, clusters, key.expression, []

    def max_active_clusters(self, threads, smem, dims, device=None):
        if self.clusters is None:
            raise tilehal.LaunchError("cuOccupancyMaxActiveClusters: not supported")
        return self.clusters

    def launch(self, grid, threads, args, smem_bytes=0, cluster=None):
        self.launches.append((grid, cluster))


@pytest.mark.parametrize("have,par", [(64, True), (63, False), (None, False)], ids=["fit", "short", "unknown"])
def test_par_reduce_multicast_needs_every_cluster_resident(monkeypatch, caplog, have, par):
    # 128 x 4096 x 1024, 64-wide tiles, 2 splits, A multicast: 64 n-blocks x 2 splits = 64 clusters of 2. The waits
    # of par_reduce need them all resident at once: kept only where the driver says so, else the last CTA reduces.
    made = {}

    def fake(key):
        made.setdefault(key, _FakeKernel(key, have))
        return made[key]

    monkeypatch.setattr(splitk, "_kernel", fake)
    monkeypatch.setattr(splitk, "_device_sms", lambda device: 132)
    monkeypatch.setattr(splitk, "_workspace", lambda device, ws, cnt: (None, None))
    monkeypatch.setattr(splitk, "_operand_descriptor", lambda x, rows: bytes(128))
    splitk._CLUSTER_FIT.clear()
    a = torch.zeros(128, 1024, dtype=torch.bfloat16)
    b = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    d = torch.empty(128, 4096, dtype=torch.bfloat16)
    cfg = SplitKConfig(block_m=128, block_n=64, splits=2, stages=4, num_sms=132, multicast=2, par_reduce=True)
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        splitk.dense_bf16(a, b, d, None, cfg)
    launched = [k for k, kern in made.items() if kern.launches]
    assert len(launched) == 1 and launched[0].multicast == 2
    assert launched[0].reduce == (1 if par else 0)
    assert made[launched[0]].launches[0] == ((64, 1, 2), (2, 1, 1))
    assert par or any("not known to fit at once" in r.getMessage() for r in caplog.records)
    splitk._CLUSTER_FIT.clear()


def test_multicast_opt_in_switch(monkeypatch):
    monkeypatch.delenv("DEEPGEMM_SPLITK_MCAST", raising=False)
    assert splitk.mcast_setting() == (None, 1.0)
    monkeypatch.setenv("DEEPGEMM_SPLITK_MCAST", "1")
    assert splitk.mcast_setting() == (splitk.OPT_IN_MCAST_MIN_M, splitk.OPT_IN_MCAST_COST)
    cfg = pick_splitk(128, 4096, 7168, 132)  # 64 n-blocks x 2 splits: 64 clusters, one wave
    assert cfg is not None and cfg.multicast == 2 and cfg.par_reduce
    gx, gy, gz = cfg.grid(128, 4096)
    assert gx * gy * gz <= 132 and gx % 2 == 0
    monkeypatch.delenv("DEEPGEMM_SPLITK_MCAST")
    assert pick_splitk(128, 4096, 7168, 132).multicast == 1  # the default


@pytest.mark.gpu
def test_cluster_reduce_falls_back_when_the_clusters_do_not_fit(caplog):
    from deepgemm import cuda_gemm

    a, b = _ab(128, 2112, 1024, seed=9)
    # 33 clusters of 4 CTAs (132): more than an H200 holds at once (the driver's count decides)
    cfg = SplitKConfig(block_m=128, block_n=64, splits=4, stages=4, num_sms=132, cluster_reduce=True)
    kern = splitk._kernel(splitk_key(cfg, 2112, 1024, torch.bfloat16, None))
    fits = kern.max_active_clusters(cfg.num_threads, cfg.smem_bytes, (1, 1, 4)) >= 33
    d = torch.empty(128, 2112, dtype=torch.bfloat16, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        cuda_gemm.dense(a, None, b, None, d, None, config=cfg)
    assert fits or any("do not fit at once" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, reference.bf16_gemm_nt(a, b, None)) < 1e-5


# ----------------------------------------------------------------------------- the measured cluster-reduction rule


def test_cluster_rule_takes_only_the_measured_plan_class():
    # splitk.CLUSTER_REDUCE_PLANS: bf16 (128, 64, 2 splits), with or without C, reduces through the cluster (H200 s29:
    # 128 x 4096 x 7168 with C = D 29.0 -> 27.2 us (r1), without C 28.9 -> 27.0 (dg18 r1)); every other plan keeps the
    # reduction it had.
    assert splitk.CLUSTER_REDUCE_MIN_M is None
    assert splitk.CLUSTER_REDUCE_PLANS == frozenset({(128, 64, 2, True), (128, 64, 2, False)})
    with_c = pick_splitk(128, 4096, 7168, 132, has_c=True)
    assert (with_c.block_m, with_c.block_n, with_c.splits) == (128, 64, 2)
    assert with_c.cluster_reduce and with_c.reduce == 2
    assert pick_splitk(128, 4096, 7168, 132) == with_c
    changed = set()
    for kind in ("bf16", "fp8"):
        for m in (1, 7, 64, 65, 96, 128):
            for n in list(range(256, 8193, 256)) + [2112, 576, 24576, 32768]:
                for k in (512, 1536, 2048, 4096, 7168, 16384):
                    a = pick_splitk(m, n, k, 132, kind, has_c=True)
                    b = pick_splitk(m, n, k, 132, kind)
                    if a is None or b is None:
                        assert a == b, (kind, m, n, k)
                        continue
                    # C changes nothing but (per the listed classes) the reduction
                    assert dataclasses_replace(a, cluster_reduce=False) == dataclasses_replace(b, cluster_reduce=False)
                    for cfg, has_c in ((a, True), (b, False)):
                        if cfg.cluster_reduce:
                            assert kind == "bf16" and m >= splitk.PAR_REDUCE_MIN_M, (kind, m, n, k)
                            assert (cfg.block_m, cfg.block_n, cfg.splits, has_c) in splitk.CLUSTER_REDUCE_PLANS
                            changed.add((m, n))
    assert (128, 4096) in changed and all(3584 <= n <= 4096 for _, n in changed), changed
    # DeepGEMM's other split-K rows at M = 128 keep par_reduce
    for n in (2112, 576, 256):
        cfg = pick_splitk(128, n, 7168, 132, has_c=True)
        assert cfg.par_reduce and not cfg.cluster_reduce, n


def test_cluster_rule_kernel_compiles_without_spills(h):
    if tilehal.compiler_versions()["nvrtc"] is None:
        pytest.skip("NVRTC is not installed")
    cfg = splitk.with_c_early(pick_splitk(128, 4096, 7168, 132, has_c=True), True)
    keys = [splitk_key(cfg, 4096, 7168, torch.bfloat16, torch.bfloat16),
            splitk_key(cfg, 4096, 7168, torch.float32, torch.float32)]
    assert all(key.reduce == 2 and key.c_early for key in keys)
    h.check_compiled_batches(splitk.compile_kernels, keys)


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", [torch.bfloat16, torch.float32], ids=["c_bf16_is_d", "c_fp32"])
def test_cluster_rule_default_matches_reference_and_par_reduce_bitwise(c_dtype, caplog):
    # The default dispatch of 128 x 4096 x 7168 with C now reduces through the cluster: the same partials in the same
    # split order as par_reduce, so the same bits; and within DeepGEMM's bar of the float64 product.
    from deepgemm import cuda_gemm

    m, n, k = 128, 4096, 7168
    a, b = _ab(m, n, k, seed=31)
    c0 = torch.randn(m, n, device="cuda").to(c_dtype)
    want = reference.bf16_gemm_nt(a, b, c0.float())
    outs = []
    for forced in (None, dataclasses_replace(pick_splitk(m, n, k, 132, has_c=True), cluster_reduce=False)):
        d = c0.clone()  # C = D (DeepGEMM's accumulation)
        with caplog.at_level(logging.DEBUG, logger="deepgemm"):
            cuda_gemm.dense(a, None, b, None, d, d, config=forced)
        outs.append(d)
    assert deepgemm.testing.calc_diff(outs[0], want) < 1e-5
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[1], "cluster (default) vs par_reduce")
    assert not any("do not fit at once" in r.getMessage() for r in caplog.records)
