"""FP4 (e2m1) weights: the cast, the reference against an independent numpy decoding, the API on CPU
tensors, argument errors, and (GPU) the sm_90 kernel against the reference."""

import itertools

import deepgemm
import ml_dtypes
import numpy as np
import pytest
import torch
from deepgemm import fp4
from deepgemm.utils import pack_ue8m0_to_int
from hypothesis import given, settings
from hypothesis import strategies as st
from tilehal import ShapeError


def np_weights(packed: torch.Tensor, sf: torch.Tensor, gran: int) -> np.ndarray:
    """Independent decoding: ml_dtypes' float4_e2m1fn of each nibble (low nibble = even k), times the scale."""
    u = packed.view(torch.uint8).numpy()
    codes = np.stack([u & 0xF, u >> 4], axis=-1).reshape(*u.shape[:-1], u.shape[-1] * 2)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return vals * np.repeat(sf.double().numpy(), gran, axis=-1)[..., : vals.shape[-1]]


def np_ref(a, sfa, packed, sf, gran, c=None) -> np.ndarray:
    af = a.float().double().numpy()
    if sfa is not None:
        af = af * np.repeat(sfa.double().numpy(), 128, axis=-1)[..., : af.shape[-1]]
    out = af @ np_weights(packed, sf, gran).swapaxes(-1, -2)
    return out if c is None else out + c.double().numpy()


def rel_err(x, ref) -> float:
    x = np.asarray(x.double().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def operands(m, n, k, gran=32, fp8=True, seed=0, groups=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lead = () if groups is None else (groups,)
    a = torch.randn((*lead, m, k), generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn((*lead, n, k), generator=g) * 0.05).to(device)  # cast where the data is (fast on a GPU)
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=gran)
    if fp8:
        if groups is None:
            a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        else:
            parts = [deepgemm.per_token_cast_to_fp8(a[i]) for i in range(groups)]
            a8, sfa = torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])
        act = (a8, sfa)
        a_ref, sfa_ref = a8, sfa
    else:
        act, a_ref, sfa_ref = a, a, None
    return act, (packed, sf), a_ref, sfa_ref, packed, sf


# ----------------------------------------------------------------------------- decoding and cast


def test_decode_matches_ml_dtypes_for_every_byte():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).reshape(1, 256)
    ours = fp4.decode_e2m1(packed)[0].numpy()
    assert np.array_equal(ours, np_weights(packed, torch.ones(1, 1), 512)[0].astype(np.float32))
    assert set(np.abs(ours).tolist()) == set(fp4.E2M1_VALUES)


@pytest.mark.parametrize("gran", [32, 128])
@pytest.mark.parametrize("ue8m0", [True, False])
def test_cast_round_trip(gran, ue8m0):
    w = torch.randn(64, 512) * 0.1
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=gran, use_ue8m0=ue8m0)
    assert packed.dtype == torch.int8 and packed.shape == (64, 256) and sf.shape == (64, 512 // gran)
    back = np_weights(packed, sf, gran)
    # nearest e2m1 value of w / sf: at most half the widest gap (6 - 4) / 2 = 1 unit of sf
    err = np.abs(back - w.double().numpy()) / np.repeat(sf.double().numpy(), gran, axis=-1)
    assert err.max() <= 1.0 + 1e-6
    if ue8m0:
        assert torch.equal(sf, torch.exp2(torch.round(torch.log2(sf))))


def test_cast_3d_is_per_group():
    w = torch.randn(3, 32, 256)
    packed, sf = deepgemm.cast_weights_to_fp4(w)
    for i in range(3):
        p, s = deepgemm.cast_weights_to_fp4(w[i])
        assert torch.equal(packed[i], p) and torch.equal(sf[i], s)


# ----------------------------------------------------------------------------- reference and API (CPU)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("gran", [32, 128])
def test_reference_matches_numpy(fp8, gran):
    act, b, a_ref, sfa_ref, packed, sf = operands(5, 48, 384, gran, fp8)
    ref = np_ref(a_ref, sfa_ref, packed, sf, gran)
    ours = fp4.reference(a_ref, sfa_ref, packed, sf, gran).numpy()
    assert np.abs(ours - ref).max() <= 1e-12 * np.abs(ref).max()


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_fp8_fp4_gemm_nt_cpu(out):
    act, b, a_ref, sfa_ref, packed, sf = operands(7, 64, 256)
    c = torch.randn(7, 64).to(out)
    d = torch.empty(7, 64, dtype=out)
    deepgemm.fp8_fp4_gemm_nt(act, b, d, c=c, recipe_a=(1, 128), recipe_b=(1, 32))
    tol = 1e-2 if out == torch.bfloat16 else 1e-6  # bf16 rounding of the result
    assert rel_err(d, np_ref(a_ref, sfa_ref, packed, sf, 32, c)) < tol


def test_bf16_fp4_and_scale_orientations_cpu():
    act, b, a_ref, _, packed, sf = operands(3, 32, 512, 128, fp8=False)
    d = torch.empty(3, 32, dtype=torch.float32)
    deepgemm.bf16_fp4_gemm_nt(act, b, d)  # gran_k from sfb's shape (K/128 columns)
    assert rel_err(d, np_ref(a_ref, None, packed, sf, 128)) < 1e-6


def test_packed_ue8m0_scales_cpu():
    act, (bp, sf), a_ref, sfa_ref, packed, _ = operands(4, 32, 256)
    d1, d2 = torch.empty(4, 32), torch.empty(4, 32)
    deepgemm.fp8_fp4_gemm_nt(act, (bp, sf), d1, recipe_b=(1, 32))
    deepgemm.fp8_fp4_gemm_nt(act, (bp, pack_ue8m0_to_int(sf)), d2, recipe_b=(1, 32))
    assert torch.equal(d1, d2)


def test_grouped_masked_cpu_leaves_rows_past_masked_m():
    act, b, a_ref, sfa_ref, packed, sf = operands(16, 32, 256, groups=3)
    masked = torch.tensor([16, 0, 5], dtype=torch.int32)
    d = torch.full((3, 16, 32), 7.0)
    deepgemm.m_grouped_fp8_fp4_gemm_nt_masked(act, b, d, masked, expected_m=8, recipe_a=(1, 128), recipe_b=(1, 32))
    for gi, r in enumerate(masked.tolist()):
        if r:
            assert rel_err(d[gi, :r], np_ref(a_ref[gi, :r], sfa_ref[gi, :r], packed[gi], sf[gi], 32)) < 1e-6
        assert bool((d[gi, r:] == 7.0).all())


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 9), n=st.sampled_from([8, 40, 72]), kb=st.integers(1, 3), gran=st.sampled_from([32, 128]),
       fp8=st.booleans(), seed=st.integers(0, 2**16))
def test_api_matches_numpy_property(m, n, kb, gran, fp8, seed):
    act, b, a_ref, sfa_ref, packed, sf = operands(m, n, 128 * kb, gran, fp8, seed)
    d = torch.empty(m, n)
    fn = deepgemm.fp8_fp4_gemm_nt if fp8 else deepgemm.bf16_fp4_gemm_nt
    fn(act, b, d)
    assert rel_err(d, np_ref(a_ref, sfa_ref, packed, sf, gran)) < 1e-6


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    act, (bp, sf), *_ = operands(4, 32, 256)
    d = torch.empty(4, 32)
    with pytest.raises(ShapeError, match="b: expected K/2"):
        deepgemm.fp8_fp4_gemm_nt(act, (bp[:, :64], sf), d)
    with pytest.raises(deepgemm.UnsupportedError, match="a: FP4 activations"):
        deepgemm.fp8_fp4_gemm_nt((bp, sf), (bp, sf), d)
    with pytest.raises(ValueError, match="recipe_b"):
        deepgemm.fp8_fp4_gemm_nt(act, (bp, sf), d, recipe_b=(128, 32))
    with pytest.raises(ShapeError, match="sfb"):
        deepgemm.fp8_fp4_gemm_nt(act, (bp, sf[:, :3]), d, recipe_b=(1, 32))
    with pytest.raises(deepgemm.UnsupportedError, match="nt layout"):
        deepgemm.fp8_fp4_gemm_nn(act, (bp, sf), d)
    a2 = torch.randn(4, 200).to(torch.bfloat16)
    with pytest.raises(ShapeError, match="multiple of 128"):
        deepgemm.bf16_fp4_gemm_nt(a2, (torch.zeros(32, 100, dtype=torch.int8), torch.ones(32, 7)), d)
    with pytest.raises(ShapeError, match="d: expected shape"):
        deepgemm.fp8_fp4_gemm_nt(act, (bp, sf), torch.empty(4, 31))


# ----------------------------------------------------------------------------- heuristic (CPU)


def test_plan_covers_k_and_fills_the_gpu():
    from deepgemm import cuda_fp4

    for m in (1, 16, 64, 128):
        for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
            p = cuda_fp4.plan(m, n, k, 1, True, True, False, False, num_sms=132)
            assert p.splits * p.chunks_per_split >= k // 128 > (p.splits - 1) * p.chunks_per_split
            assert p.row_blocks * p.key.rows >= n and p.m_blocks * p.key.tokens >= m
            ctas = p.row_blocks * p.splits * p.m_blocks
            resident = 132 * p.key.min_blocks  # the kernel's minimum blocks per SM
            assert p.key.min_blocks * (p.key.smem_bytes + 1024) <= cuda_fp4.SM_SMEM  # they fit
            assert 0.5 * 132 <= ctas <= resident  # one wave (wide token tiles: at most 4 splits, see plan)


def test_wgmma_plan_covers_k_in_one_wave_of_clusters():
    from deepgemm import cuda_fp4

    shapes = ((7168, 2048), (2112, 7168), (4096, 7168), (200, 256))
    for m, (n, k), fp8 in itertools.product((1, 5, 16, 37, 64, 128, 300), shapes, (False, True)):
        p = cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=132, act_fp8=fp8)
        assert p.key.act_fp8 == fp8 and p.key.nt <= (8 if fp8 else 16)
        assert p.splits * p.chunks_per_split >= k // 128 > (p.splits - 1) * p.chunks_per_split
        assert p.row_blocks * p.key.rows >= n and p.m_blocks * p.key.tokens >= m
        assert 1 <= p.splits <= cuda_fp4.MAX_CLUSTER_SPLITS and p.grid[1] == p.splits
        assert p.cluster == ((1, p.splits, 1) if p.splits > 1 else None)
        assert p.blocks >= p.key.min_blocks and p.blocks * (p.key.smem_bytes + 1024) <= cuda_fp4.SM_SMEM  # they fit
        clusters = p.row_blocks * p.m_blocks  # one wave of clusters (by the GPC model) where one wave can hold them
        if p.splits > 1 and m <= 128:  # decode sizes: every cluster resident at once
            assert clusters <= cuda_fp4.cluster_capacity(132, p.blocks, p.splits)
        if m in (64, 128) and n == 2112 and not fp8:  # few 128-row tiles: 64-row CTAs, two per SM (R1)
            assert (p.key.nwg, p.blocks) == (1, 2)


def test_cluster_capacity_model():
    from deepgemm import cuda_fp4

    # 132 SMs = 66 TPCs over 8 GPCs: two of 18 SMs, six of 16
    assert [cuda_fp4.cluster_capacity(132, 1, s) for s in (2, 3, 4, 7, 8)] == [66, 42, 32, 16, 16]
    assert cuda_fp4.cluster_capacity(132, 3, 8) == 48


def test_kernel_choice_env(monkeypatch):
    from deepgemm import cuda_fp4

    assert cuda_fp4.kernel_choice() == "auto"
    assert [cuda_fp4.use_wgmma(False, m) for m in (1, 16, 17, 128)] == [False, False, True, True]
    assert not any(cuda_fp4.use_wgmma(True, m) for m in (1, 128))  # e4m3: opt-in
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "mma")
    assert cuda_fp4.kernel_choice() == "mma"
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "tensor")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_KERNEL"):
        cuda_fp4.kernel_choice()
    assert cuda_fp4.plan_wgmma(128, 4096, 7168, 1, True, False, False, num_sms=132).key.nwg == 2
    monkeypatch.setenv("DEEPGEMM_FP4_WG_NWG", "1")
    assert cuda_fp4.plan_wgmma(128, 4096, 7168, 1, True, False, False, num_sms=132).key.nwg == 1
    monkeypatch.setenv("DEEPGEMM_FP4_WG_NWG", "3")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_WG_NWG"):
        cuda_fp4.plan_wgmma(128, 4096, 7168, 1, True, False, False, num_sms=132)
    monkeypatch.delenv("DEEPGEMM_FP4_WG_NWG")
    monkeypatch.setenv("DEEPGEMM_FP4_WG_MAX_SPLITS", "2")
    assert cuda_fp4.plan_wgmma(1, 4096, 7168, 1, True, False, False, num_sms=132).splits == 2
    monkeypatch.setenv("DEEPGEMM_FP4_WG_MAX_SPLITS", "9")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_WG_MAX_SPLITS"):
        cuda_fp4.plan_wgmma(1, 4096, 7168, 1, True, False, False, num_sms=132)


# ----------------------------------------------------------------------------- GPU


def cuda(*xs):
    return tuple(None if x is None else x.cuda() for x in xs)


GPU_SHAPES = [(1, 7168, 2048), (16, 2112, 7168), (64, 4096, 7168), (128, 4096, 7168), (5, 200, 256), (37, 136, 1152)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("gran", [32, 128])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_dense_matches_reference(m, n, k, gran, fp8):
    act, b, a_ref, sfa_ref, packed, sf = operands(m, n, k, gran, fp8, device="cuda")
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fn = deepgemm.fp8_fp4_gemm_nt if fp8 else deepgemm.bf16_fp4_gemm_nt
    fn(act, b, d)
    ref = fp4.reference(*cuda(a_ref, sfa_ref, packed, sf), gran).cpu()  # float64 on the GPU
    assert deepgemm.testing.calc_diff(d.float().cpu(), ref.float()) < 1e-4
    d32 = torch.empty(m, n, device="cuda")
    fn(act, b, d32)
    assert rel_err(d32, ref.numpy()) < 1e-4  # fp32 summation order only


def assert_graph_replays(fn, d, ref: np.ndarray, tol: float = 1e-4) -> None:
    """fn captured in a CUDA graph and replayed 3 times into a zeroed d: each replay gives ref again (split-K
    launches must leave their counters / cluster state ready for the next)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        d.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(d, ref) < tol


@pytest.mark.gpu
def test_gpu_c_and_graph_replay():
    m, n, k = 16, 2112, 7168  # split-K: the per-tile counters must be reset by each launch
    act, b, a_ref, sfa_ref, packed, sf = operands(m, n, k, device="cuda")
    c = torch.randn(m, n, device="cuda")
    d = torch.empty(m, n, device="cuda")
    deepgemm.fp8_fp4_gemm_nt(act, b, d, c=c)
    ref = fp4.reference(*cuda(a_ref, sfa_ref, packed, sf), 32, c).cpu()
    assert rel_err(d, ref.numpy()) < 1e-4
    assert_graph_replays(lambda: deepgemm.fp8_fp4_gemm_nt(act, b, d, c=c), d, ref.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "mma", "wgmma", "stream", "small"])
@pytest.mark.parametrize("fp8", [True, False])
def test_gpu_grouped_masked(fp8, kernel, monkeypatch):
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", kernel)
    g, m_max, n, k = 4, 64, 2112, 2048
    act, b, a_ref, sfa_ref, packed, sf = operands(m_max, n, k, 32, fp8, groups=g, device="cuda")
    masked = torch.tensor([64, 0, 17, 1], dtype=torch.int32, device="cuda")
    d = torch.full((g, m_max, n), 3.0, device="cuda", dtype=torch.bfloat16)
    if fp8:
        deepgemm.m_grouped_fp8_fp4_gemm_nt_masked(act, b, d, masked, expected_m=16)
    else:
        deepgemm.m_grouped_bf16_fp4_gemm_nt_masked(act, b, d, masked, expected_m=16)
    for gi, r in enumerate(masked.tolist()):
        if r:
            ref = fp4.reference(*cuda(a_ref[gi, :r], None if sfa_ref is None else sfa_ref[gi, :r], packed[gi], sf[gi]),
                                32).cpu()
            assert deepgemm.testing.calc_diff(d[gi, :r].float().cpu(), ref.float()) < 1e-4
        assert bool((d[gi, r:] == 3.0).all())


WGMMA_SHAPES = [(1, 4096, 7168), (8, 64, 256), (33, 2112, 2048), (64, 7168, 2048), (100, 200, 1024), (128, 2112, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("m,n,k", WGMMA_SHAPES)
def test_gpu_wgmma_kernel_matches_reference(m, n, k, ue8m0, monkeypatch):
    """bf16 activations (the wgmma kernel): power-of-two scales take the folded path, fp32 ones (ue8m0=False)
    the exact slow path; both must give the reference up to fp32 summation order."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "wgmma")
    check_bf16_activations(m, n, k, ue8m0, seed=m + n)


def check_bf16_activations(m: int, n: int, k: int, ue8m0: bool, seed: int) -> None:
    """bf16_fp4_gemm_nt on the GPU (the kernel DEEPGEMM_FP4_KERNEL picks) against the float64 reference: fp32
    output within 1e-4 of max |D| (fp32 summation order only), bf16 output calc_diff < 1e-4."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16).cuda()
    w = torch.randn((n, k), generator=g).cuda() * 0.05
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32, use_ue8m0=ue8m0)
    if not ue8m0:
        assert not torch.equal(sf, torch.exp2(torch.round(torch.log2(sf))))  # the slow path really runs
    ref = fp4.reference(a, None, packed, sf, 32).cpu()
    d32 = torch.empty(m, n, device="cuda")
    deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d32)
    assert rel_err(d32, ref.numpy()) < 1e-4
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)
    assert deepgemm.testing.calc_diff(d.float().cpu(), ref.float()) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,m", [("wgmma", 16), ("stream", 16), ("stream", 64), ("small", 1), ("small", 16),
                                      ("small", 32), ("small", 64)])
def test_gpu_mixed_scales_c_and_graph_replay(kernel, m, monkeypatch):
    """Half the rows with fp32 scales (slow-path chunks next to folded ones in one CTA), C, a cluster
    split-K launch replayed from a CUDA graph: the wgmma and the streaming kernel (bf16 activations; M = 64:
    its activation ring)."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", kernel)
    n, k = 2112, 7168
    g = torch.Generator().manual_seed(7)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16).cuda()
    w = torch.randn((n, k), generator=g).cuda() * 0.05
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32)
    _, sf_fp32 = deepgemm.cast_weights_to_fp4(w, gran_k=32, use_ue8m0=False)
    sf[::2] = sf_fp32[::2] * 1.0  # fp32 scales on even rows: their codes were cast for ue8m0, still valid
    c = torch.randn(m, n, device="cuda")
    ref = fp4.reference(a, None, packed, sf, 32, c).cpu()
    d = torch.empty(m, n, device="cuda")
    deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d, c=c)
    assert rel_err(d, ref.numpy()) < 1e-4
    assert_graph_replays(lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d, c=c), d, ref.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 7168, 2048), (64, 2112, 7168)])
def test_gpu_bf16_mma_kernel_still_matches(m, n, k, monkeypatch):
    """DEEPGEMM_FP4_KERNEL=mma keeps bf16 activations on the mma.sync kernel (A/B timing)."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "mma")
    act, b, a_ref, sfa_ref, packed, sf = operands(m, n, k, 32, False, device="cuda")
    d = torch.empty(m, n, device="cuda")
    deepgemm.bf16_fp4_gemm_nt(act, b, d)
    ref = fp4.reference(*cuda(a_ref, sfa_ref, packed, sf), 32).cpu()
    assert rel_err(d, ref.numpy()) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["ue8m0", "fp32", "spread"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 7168), (16, 2112, 7168), (64, 7168, 2048), (128, 4096, 7168),
                                   (37, 136, 1152)])
def test_gpu_fp8_wgmma_kernel_matches_reference(m, n, k, scales, monkeypatch):
    """e4m3 activations on the wgmma kernel (DEEPGEMM_FP4_KERNEL=wgmma): folded chunks (ue8m0), the slow path
    (fp32 scales; a row whose scales spread over more than 5 binades inside a chunk)."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "wgmma")
    g = torch.Generator().manual_seed(m * 3 + k)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16).cuda()
    w = torch.randn((n, k), generator=g).cuda() * 0.05
    if scales == "spread":
        w[:, 32:64] *= 2.0 ** -9  # group 1 of chunk 0: 9 binades below the rest of its row
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32, use_ue8m0=scales != "fp32")
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    ref = fp4.reference(a8, sfa, packed, sf, 32).cpu()
    d32 = torch.empty(m, n, device="cuda")
    deepgemm.fp8_fp4_gemm_nt((a8, sfa), (packed, sf), d32)
    err = rel_err(d32, ref.numpy())
    # fp32 sums, but Hopper's e4m3 wgmma adds 4 x 32 products inside the tensor core before the promotion
    assert err < 1e-3, err
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    deepgemm.fp8_fp4_gemm_nt((a8, sfa), (packed, sf), d)
    assert deepgemm.testing.calc_diff(d.float().cpu(), ref.float()) < 1e-4


def stub_launches(monkeypatch) -> list:
    """cuda_fp4's kernels replaced by a stub: the list of (grid, threads, args, smem_bytes, cluster) launched."""
    from deepgemm import cuda_fp4

    launches = []

    class Stub:
        def launch(self, grid, threads, args, smem_bytes=0, cluster=None):
            launches.append((grid, threads, args, smem_bytes, cluster))

    monkeypatch.setattr(cuda_fp4, "_kernel", lambda key: Stub())
    return launches


@pytest.mark.parametrize("fp8", [False, True])
def test_wgmma_launch_arguments_cpu(fp8, monkeypatch):
    """The wgmma kernels' host launch without a GPU (descriptors and the kernel stubbed): the argument list
    matches the kernel's parameters, the grid and cluster are the plan's, and the boxes are the kernel's tiles."""
    from deepgemm import cuda_fp4, cuda_gemm

    boxes = []
    monkeypatch.setattr(cuda_gemm, "_encode", lambda ptr, dt, shape, strides, box, swz: boxes.append((box, swz)) or
                        bytes(128))
    launches = stub_launches(monkeypatch)
    m, n, k = 16, 2112, 7168
    act, (packed, sf), *_ = operands(m, n, k, 32, fp8)
    a, sfa = act if fp8 else (act, None)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    p = cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=132, act_fp8=fp8)
    cuda_fp4._launch_wgmma(p, a, sfa, packed, sf, d, None, None, m, n, k)
    (grid, threads, args, smem, cluster), = launches
    assert grid == p.grid and threads == p.key.threads and smem == p.key.smem_bytes and cluster == p.cluster
    assert len(args) == (12 if fp8 else 11) and args[-5:] == [m, n, k, p.m_blocks, p.chunks_per_split]
    assert (p.key.rows, 64) in [b for b, _ in boxes] and (p.key.rows, 4) in [b for b, _ in boxes]
    assert ((p.key.tokens, 128), "128B") in boxes if fp8 else ((p.key.tokens, 64), "128B") in boxes


def test_fit_clusters_takes_fewer_splits_when_the_driver_holds_fewer(monkeypatch):
    from deepgemm import cuda_fp4

    def replan(most=None):
        return cuda_fp4.plan_wgmma(64, 4096, 7168, 1, True, False, False, num_sms=132, max_splits=most)

    p = replan()
    assert p.splits == 4 and p.tiles_all == 32
    monkeypatch.setattr(cuda_fp4, "_max_active_clusters", lambda key, size, dev, smem: {4: 30, 3: 40}.get(size, 99))
    q = cuda_fp4._fit_clusters(p, torch.device("cpu"), replan)
    assert q.splits == 3 and q.splits * q.chunks_per_split >= 56
    monkeypatch.setattr(cuda_fp4, "_max_active_clusters", lambda key, size, dev, smem: None)  # no driver figure
    assert cuda_fp4._fit_clusters(p, torch.device("cpu"), replan) is p


# ----------------------------------------------------------------------------- the streaming kernel (bf16, M <= 16)


def test_stream_plan_covers_k_and_fits(monkeypatch):
    from deepgemm import cuda_fp4

    shapes = ((7168, 2048), (2112, 7168), (4096, 7168), (200, 256), (136, 16384), (64, 1024))
    for m, (n, k) in itertools.product((1, 5, 8, 9, 16, 33, 64, 128), shapes):
        p = cuda_fp4.plan_stream(m, n, k, 1, True, False, False, num_sms=132)
        assert p.key.nt == min(8, max(1, 1 << (m - 1).bit_length() >> 3)) if m > 8 else p.key.nt == 1
        assert p.key.slots == cuda_fp4.STREAM_SLOTS[p.key.nt]
        assert p.key.ring == (p.key.nt > 2 or p.chunks_per_split > cuda_fp4.STREAM_MAX_CHUNKS
                              or p.key.tokens * p.chunks_per_split * 256 > cuda_fp4.STREAM_WHOLE_BYTES)
        assert p.splits * p.chunks_per_split >= k // 128 > (p.splits - 1) * p.chunks_per_split
        assert p.row_blocks * p.key.rows >= n and p.m_blocks * p.key.tokens >= m
        assert 1 <= p.splits <= cuda_fp4.MAX_CLUSTER_SPLITS and p.cluster == ((1, p.splits, 1) if p.splits > 1 else None)
        assert p.smem_bytes >= max(p.key.tokens * (3 if p.key.ring else p.chunks_per_split) * 256,
                                   p.key.tokens * p.key.rows * 4)
        assert cuda_fp4.stream_min_blocks(p.key.wn) * p.smem_bytes <= cuda_fp4.SM_SMEM
    p = cuda_fp4.plan_stream(1, 4096, 128 * 8 * 25, 1, True, False, False, num_sms=132)  # K: 25 chunks per CTA
    assert p.key.ring and p.smem_bytes == max(8 * 3 * 256, 8 * 128 * 4)  # the ring, not the whole range
    assert cuda_fp4.plan_stream(128, 4096, 7168, 1, True, False, False, num_sms=132).m_blocks == 2
    assert [cuda_fp4.use_stream(False, m) for m in (1, 16, 17)] == [m <= cuda_fp4.STREAM_MAX_M for m in (1, 16, 17)]
    assert not cuda_fp4.use_stream(True, 1)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "mma")
    assert not cuda_fp4.use_stream(False, 1)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "stream")
    assert cuda_fp4.use_stream(False, 128) and not cuda_fp4.use_stream(True, 1) and not cuda_fp4.use_wgmma(True, 64)
    monkeypatch.setenv("DEEPGEMM_FP4_STREAM_WN", "4")
    assert cuda_fp4.plan_stream(1, 4096, 7168, 1, True, False, False, num_sms=132).key.wn == 4
    monkeypatch.setenv("DEEPGEMM_FP4_STREAM_WN", "5")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_STREAM_WN"):
        cuda_fp4.plan_stream(1, 4096, 7168, 1, True, False, False, num_sms=132)


def test_stream_launch_arguments_cpu(monkeypatch):
    """The streaming kernel's host launch without a GPU (kernel stubbed): the argument list matches the
    kernel's parameters (b, sfb, a, d, c, masked_m, M, N, K, lda, m_blocks, chunks per split)."""
    from deepgemm import cuda_fp4

    launches = stub_launches(monkeypatch)
    m, n, k = 16, 2112, 7168
    a, (packed, sf), *_ = operands(m, n, k, 32, False)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    p = cuda_fp4.plan_stream(m, n, k, 1, True, False, False, num_sms=132)
    cuda_fp4._launch_stream(p, a, packed, sf, d, None, None, m, n, k)
    (grid, threads, args, smem, cluster), = launches
    assert grid == p.grid and threads == p.key.threads and smem == p.smem_bytes and cluster == p.cluster
    assert args[0] is packed and args[1] is sf and args[3] is d and args[4] is None and args[5] is None
    assert args[6:] == [m, n, k, k, p.m_blocks, p.chunks_per_split]


STREAM_SHAPES = [(1, 7168, 2048), (16, 2112, 7168), (3, 4096, 7168), (9, 200, 256), (2, 136, 16384), (16, 72, 1152),
                 (25, 4096, 2048), (33, 2112, 2048), (64, 200, 1024), (128, 4096, 7168)]  # the ring: NT = 4, 8, 2 m-blocks


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("m,n,k", STREAM_SHAPES)
def test_gpu_stream_kernel_matches_reference(m, n, k, ue8m0, monkeypatch):
    """bf16 activations at M <= 16 (the streaming kernel): power-of-two scales folded, fp32 ones through the
    4-piece slow path; N % 64 != 0 (200, 136, 72: partial row blocks), K = 16384 (slots refilled),
    fp32 and bf16 outputs: the float64 reference up to fp32 summation order."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "stream")
    check_bf16_activations(m, n, k, ue8m0, seed=m * 7 + n + k)


# ----------------------------------------------------------------------------- the small-M kernel (bf16, M <= 128)


def test_small_plan_covers_k_fits_and_fills_the_gpu(monkeypatch):
    from deepgemm import cuda_fp4

    shapes = ((7168, 2048), (2112, 7168), (4096, 7168), (200, 256), (136, 16384), (64, 1024), (72, 1152))
    for m, (n, k) in itertools.product((1, 5, 8, 9, 16, 17, 32, 33, 64, 128), shapes):
        p = cuda_fp4.plan_small(m, n, k, 1, True, False, False, num_sms=132)
        nt = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8
        if p is None:  # only when even 8 splits leave a CTA's activation tile too large for an SM
            assert 8 * nt * -(-(k // 128) // cuda_fp4.MAX_CLUSTER_SPLITS) * 256 + 1024 > cuda_fp4.SM_SMEM, (m, n, k)
            continue
        key = p.key
        assert key.nt == nt
        assert key.rw * key.kw == cuda_fp4.SMALL_WARPS and p.m_blocks == -(-m // key.tokens)
        assert (key.minb, key.slots) == (cuda_fp4.SMALL_BUILD[key.nt][0],
                                         min(cuda_fp4.SMALL_BUILD[key.nt][1], -(-p.chunks_per_split // key.kw)))
        assert p.splits * p.chunks_per_split >= k // 128 > (p.splits - 1) * p.chunks_per_split
        assert p.chunks_per_split >= key.kw or p.splits == 1  # every k-warp has a chunk (but K's last split)
        assert p.row_blocks * key.rows >= n > (p.row_blocks - 1) * key.rows and p.m_blocks * key.tokens >= m
        assert 1 <= p.splits <= cuda_fp4.MAX_CLUSTER_SPLITS and p.cluster == ((1, p.splits, 1) if p.splits > 1 else None)
        assert p.smem_bytes == max(key.tokens * p.chunks_per_split * 256, (key.kw - 1) * key.rw * 32 * key.nt * 16,
                                   key.tokens * key.rows * 4)
        assert p.smem_bytes + 1024 <= cuda_fp4.SM_SMEM
        if (n, k) in shapes[:3] and m <= 64:  # the decode shapes: one wave of clusters, enough warps
            ctas = p.row_blocks * p.splits * p.m_blocks
            assert p.row_blocks * p.m_blocks <= cuda_fp4.cluster_capacity(132, key.minb, p.splits)
            assert ctas * cuda_fp4.SMALL_WARPS >= 0.4 * 132 * key.minb * cuda_fp4.SMALL_WARPS, (m, n, k, p)
    # cost ties go to more rows per CTA (one activation tile serves them), then to fewer splits
    p = cuda_fp4.plan_small(1, 4096, 7168, 1, True, False, False, num_sms=132)
    assert (p.key.rw, p.key.kw, p.splits) == (4, 2, 7)
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_RW", "1")
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_SPLITS", "3")
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_SLOTS", "1")
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_PF", "256")
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_MINB", "3")
    p = cuda_fp4.plan_small(1, 4096, 7168, 1, True, False, False, num_sms=132)
    assert (p.key.rw, p.key.kw, p.splits, p.key.slots, p.key.pf, p.key.minb) == (1, 8, 3, 1, 256, 3)
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_MINB", "5")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_SMALL_MINB"):
        cuda_fp4.plan_small(1, 4096, 7168, 1, True, False, False, num_sms=132)


def test_small_kernel_choice(monkeypatch):
    from deepgemm import cuda_fp4

    assert [cuda_fp4.use_small(False, m) for m in (1, 16, 17)] == [m <= cuda_fp4.AUTO_SMALL_MAX_M for m in (1, 16, 17)]
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "small")
    assert [cuda_fp4.use_small(False, m) for m in (1, 16, 32, 128, 129)] == [True, True, True, True, False]
    assert not cuda_fp4.use_small(True, 1)  # e4m3 activations: the other kernels, as auto
    assert [cuda_fp4.use_wgmma(False, m) for m in (1, 33)] == [False, True] and not cuda_fp4.use_stream(False, 1)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "mma")
    assert not cuda_fp4.use_small(False, 1)


def test_small_launch_arguments_cpu(monkeypatch):
    """The small kernel's host launch without a GPU (kernel stubbed): the argument list matches the kernel's
    parameters (b, sfb, a, d, c, masked_m, M, N, K, lda, m_blocks, chunks per split), grid and cluster the plan's;
    bf16_fp4_gemm_nt under DEEPGEMM_FP4_KERNEL=small launches it (the GPU check is stubbed)."""
    from deepgemm import cuda_fp4

    launches = stub_launches(monkeypatch)
    m, n, k = 16, 2112, 7168
    a, (packed, sf), *_ = operands(m, n, k, 32, False)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    p = cuda_fp4.plan_small(m, n, k, 1, True, False, False, num_sms=132)
    cuda_fp4._launch_small(p, a, packed, sf, d, None, None, m, n, k)
    (grid, threads, args, smem, cluster), = launches
    assert grid == p.grid == (p.row_blocks, p.splits, p.m_blocks) and threads == 32 * cuda_fp4.SMALL_WARPS
    assert smem == p.smem_bytes and cluster == p.cluster
    assert args[0] is packed and args[1] is sf and args[3] is d and args[4] is None and args[5] is None
    assert args[6:] == [m, n, k, k, p.m_blocks, p.chunks_per_split]
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "small")
    monkeypatch.setattr(cuda_fp4, "_check", lambda *args: None)
    monkeypatch.setattr(cuda_fp4, "_fit_clusters", lambda p, device, replan: p)
    monkeypatch.setattr(cuda_fp4, "get_num_sms", lambda: 132)
    cuda_fp4.dense(a, None, packed, sf, 32, d, None)
    assert len(launches) == 2 and launches[1][:2] == (p.grid, p.key.threads)


SMALL_SHAPES = [(1, 7168, 2048), (16, 2112, 7168), (1, 4096, 7168), (3, 4096, 7168), (9, 200, 256), (2, 136, 16384),
                (16, 72, 1152), (32, 4096, 2048), (17, 2112, 7168), (5, 64, 128), (64, 4096, 7168), (100, 200, 1024),
                (128, 2112, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("m,n,k", SMALL_SHAPES)
def test_gpu_small_kernel_matches_reference(m, n, k, ue8m0, monkeypatch):
    """bf16 activations (the small kernel; 8 token tiles and m-blocks at M > 32): power-of-two scales folded, fp32
    ones through the 4-piece slow path; N % 64 != 0 (200, 136, 72: partial row warps), K = 16384, one chunk
    (K = 128), fp32 and bf16 outputs: the float64 reference up to fp32 summation order."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "small")
    check_bf16_activations(m, n, k, ue8m0, seed=m * 5 + n + k)


# the A/B variants gpu_job.sh times (scripts/gpu/fp4_warm.py JOB_VARIANTS): environment, token counts
SMALL_VARIANTS = [({"DEEPGEMM_FP4_SMALL_PF": "256"}, (1, 16)),
                  ({"DEEPGEMM_FP4_SMALL_SLOTS": "4", "DEEPGEMM_FP4_SMALL_MINB": "2"}, (1, 16)),
                  ({"DEEPGEMM_FP4_SMALL_SLOTS": "1", "DEEPGEMM_FP4_SMALL_MINB": "4"}, (1,)),
                  ({"DEEPGEMM_FP4_SMALL_RW": "1"}, (1, 16))]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,ms", SMALL_VARIANTS)
def test_gpu_small_kernel_variants_match(variant, ms, monkeypatch):
    """The A/B variants the benchmark times (L2 prefetch, slots, CTAs per SM, row warps) give the reference too."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "small")
    for name, v in variant.items():
        monkeypatch.setenv(name, v)
    for m, n, k in ((1, 4096, 7168), (16, 2112, 7168)):
        if m in ms:
            check_bf16_activations(m, n, k, True, seed=m + k)
