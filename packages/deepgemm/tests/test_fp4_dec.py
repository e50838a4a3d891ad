"""The decode-to-shared FP4 kernel (cuda_fp4 fp4_dec_sm90, DEEPGEMM_FP4_KERNEL=dec): its plans (CPU), its host
launch (stubbed kernel, CPU), every planned and A/B configuration compiled with NVRTC sm_90a (CI: 0 spills, no
serialized wgmma), and (GPU) both activation kinds against the float64 reference."""

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import cuda_fp4, fp4

ISSUE_NK = ((7168, 2048), (2112, 7168), (4096, 7168))
SMS = 132
# A/B variants the GPU rounds time (gpu_job.sh): (BN, splits, multicast, CTAs per SM, warp-specialized slots) forced
# (BN None: the planner's; splits None: as many as fill the SMs with those slices; multicast 2 / 4: clusters share the
# activation tile; slots: fp4_decws_sm90 with that many decoded-tile slots)
VARIANTS = (("64", None, None, None, None), ("128", None, None, None, None), ("32", "2", None, None, None),
            (None, None, "2", None, None), ("64", None, "2", None, None), (None, None, "4", None, None),
            ("64", None, "4", None, None), (None, "2", None, "2", None), (None, "4", None, "2", None),
            (None, None, None, None, "2"), (None, None, None, None, "4"), ("32", "2", None, None, "3"))
WS = "3"  # the warp-specialized kernel's slots in the reference tests


def fits(fp8, bn, ws=None) -> bool:
    top = cuda_fp4.DEC_FP8_MAX_BN if fp8 else cuda_fp4.DEC_WS_MAX_BN if ws else 256
    return bn is None or int(bn) <= top


def dec_keys() -> list:
    keys = set()
    for m in (17, 64, 100, 128):
        for n, k in ISSUE_NK:
            for fp8 in (False, True):
                keys.add(cuda_fp4._plan_dec(m, n, k, True, False, fp8, SMS, None, None).key)
                if m in (64, 128):
                    for bn, sp, mc, bl, ws in VARIANTS:
                        if fits(fp8, bn, ws):
                            keys.add(cuda_fp4._plan_dec(m, n, k, True, False, fp8, SMS, bn, sp, mc, bl, ws).key)
                keys.add(cuda_fp4._plan_dec(m, n, k, True, False, fp8, SMS, None, None, None, None, WS).key)
    for fp8 in (False, True):
        for ws in (None, WS):
            keys.add(cuda_fp4._plan_dec(37, 136, 1152, False, True, fp8, SMS, None, None, None, None, ws).key)  # + C
            keys.add(cuda_fp4._plan_dec(200, 200, 256, True, False, fp8, SMS, None, None, None, None, ws).key)
    return sorted(keys, key=lambda k: k.expression)


DEC_KEYS = dec_keys()


def test_dec_plan_fills_one_wave_and_covers_k():
    for m in (1, 64, 65, 128, 300):
        for n, k in (*ISSUE_NK, (136, 1152), (200, 256)):
            for fp8 in (False, True):
                p = cuda_fp4._plan_dec(m, n, k, True, False, fp8, SMS, None, None)
                assert p.key.nwg == (1 if m <= 64 else 2) and p.m_blocks * p.key.tokens >= m
                assert p.row_blocks * p.key.bn >= n and p.key.bn % 8 == 0 and 8 <= p.key.bn <= 256
                assert not fp8 or p.key.bn <= cuda_fp4.DEC_FP8_MAX_BN
                pw = cuda_fp4._plan_dec(m, n, k, True, False, fp8, SMS, None, None, None, None, "3")
                assert pw.key.bn <= (cuda_fp4.DEC_FP8_MAX_BN if fp8 else cuda_fp4.DEC_WS_MAX_BN)
                assert pw.key.smem_bytes <= 227 * 1024 and pw.key.stages >= 2
                assert p.splits * p.chunks_per_split >= k // 128 > (p.splits - 1) * p.chunks_per_split
                assert p.key.smem_bytes <= 227 * 1024 and 2 <= p.key.stages <= cuda_fp4.DEC_MAX_STAGES
                if n * p.m_blocks >= 8 * SMS and p.key.bn < (64 if fp8 else 256):  # one wave of thin slices
                    assert p.row_blocks * p.m_blocks <= SMS
    # the issue's M = 128 rows: DeepGEMM fp8's slices (no split, 128-132 CTAs)
    got = {n: cuda_fp4._plan_dec(128, n, k, True, False, True, SMS, None, None) for n, k in ISSUE_NK}
    assert {n: (p.key.bn, p.row_blocks, p.splits) for n, p in got.items()} == {
        7168: (56, 128, 1), 2112: (16, 132, 1), 4096: (32, 128, 1)}


def test_dec_env_knobs(monkeypatch):
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_BN", "64")
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_SPLITS", "4")
    p = cuda_fp4.plan_dec(128, 4096, 7168, True, False, False, num_sms=SMS)
    assert (p.key.bn, p.splits, p.chunks_per_split, p.cluster) == (64, 4, 14, (1, 4, 1))
    for name, bad, fp8 in (("DEEPGEMM_FP4_DEC_BN", "12", False), ("DEEPGEMM_FP4_DEC_BN", "264", False),
                           ("DEEPGEMM_FP4_DEC_BN", "128", True), ("DEEPGEMM_FP4_DEC_MCAST", "2", False),
                           ("DEEPGEMM_FP4_DEC_SPLITS", "9", False)):
        monkeypatch.setenv(name, bad)
        with pytest.raises(deepgemm.validate.ArgumentError, match=name):
            cuda_fp4.plan_dec(128, 4096, 7168, True, False, fp8, num_sms=SMS)
        monkeypatch.delenv(name)
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_BN", "128")  # splits: as many as fill the SMs with 128-row slices
    assert [(p.row_blocks, p.splits) for p in (cuda_fp4.plan_dec(128, n, k, True, False, False, num_sms=SMS)
                                               for n, k in ISSUE_NK)] == [(56, 2), (17, 7), (32, 4)]
    monkeypatch.delenv("DEEPGEMM_FP4_DEC_BN")
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_BLOCKS", "2")  # two CTAs per SM: half the slice, half the ring
    one, two = (cuda_fp4._plan_dec(64, 4096, 7168, True, False, False, SMS, None, None, None, b) for b in ("1", "2"))
    assert (one.key.bn, two.key.bn) == (32, 16) and 2 * two.key.smem_bytes <= cuda_fp4.SM_SMEM
    assert cuda_fp4.plan_dec(64, 4096, 7168, True, False, False, num_sms=SMS) == two
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_BLOCKS", "3")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_DEC_BLOCKS"):
        cuda_fp4.plan_dec(64, 4096, 7168, True, False, False, num_sms=SMS)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "dec")
    assert cuda_fp4.kernel_choice() == "dec" and not cuda_fp4.use_small(False, 1)


@pytest.mark.parametrize("fp8", [False, True])
def test_dec_launch_arguments_cpu(fp8, monkeypatch):
    """The host launch without a GPU (descriptors and kernel stubbed): the argument list matches the kernel's
    parameters, the grid / cluster / shared memory are the plan's, the TMA boxes the kernel's tiles."""
    from deepgemm import cuda_gemm

    boxes = []
    monkeypatch.setattr(cuda_gemm, "_encode", lambda ptr, dt, shape, strides, box, swz: boxes.append((box, swz)) or
                        bytes(128))
    launches = []

    class Stub:
        def launch(self, grid, threads, args, smem_bytes=0, cluster=None):
            launches.append((grid, threads, args, smem_bytes, cluster))

    monkeypatch.setattr(cuda_fp4, "_kernel", lambda key: Stub())
    m, n, k = 128, 4096, 7168
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    sfa = torch.ones(m, k // 128) if fp8 else None
    packed = torch.zeros(n, k // 2, dtype=torch.int8)
    sf = torch.ones(n, k // 32)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_SPLITS", "2")
    p = cuda_fp4.plan_dec(m, n, k, True, False, fp8, num_sms=SMS)
    cuda_fp4._launch_dec(p, a, sfa, packed, sf, d, None, m, n, k)
    (grid, threads, args, smem, cluster), = launches
    assert grid == (p.row_blocks, 2, 1) and threads == 288 and smem == p.key.smem_bytes and cluster == (1, 2, 1)
    assert len(args) == 11 and args[-5:] == [m, n, k, p.m_blocks, p.chunks_per_split] and args[5] is None
    assert ((p.key.bn, 64), "64B") in boxes and ((p.key.bn, 4), "none") in boxes
    assert ((128, 128), "128B") in boxes and ((1, 128), "none") in boxes if fp8 else ((128, 64), "128B") in boxes
    monkeypatch.delenv("DEEPGEMM_FP4_DEC_SPLITS")
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_MCAST", "2")
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_BN", "64")  # 33 slices of 2112
    p = cuda_fp4.plan_dec(m, 2112, k, True, False, fp8, num_sms=SMS)
    cuda_fp4._launch_dec(p, a, sfa, packed[:2112], sf[:2112], d[:, :2112], None, m, 2112, k)
    grid, _, _, _, cluster = launches[-1]
    assert p.row_blocks % 2 == 1 and grid == (p.row_blocks + 1, 1, 1) and cluster == (2, 1, 1)  # a phantom CTA
    assert ((64, 128 if fp8 else 64), "128B") in boxes  # each CTA loads half of the token rows
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_MCAST", "4")
    p = cuda_fp4.plan_dec(m, 2112, k, True, False, fp8, num_sms=SMS)
    cuda_fp4._launch_dec(p, a, sfa, packed[:2112], sf[:2112], d[:, :2112], None, m, 2112, k)
    grid, _, _, _, cluster = launches[-1]
    assert grid == (36, 1, 1) and cluster == (4, 1, 1) and ((32, 128 if fp8 else 64), "128B") in boxes


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
@pytest.mark.parametrize("part", [0, 1, 2])
def test_dec_configs_compile(part, h):
    """NVRTC sm_90a: every planned / A/B configuration, no spills, no serialized wgmma (ptxas C7510-C7518)."""
    batch = DEC_KEYS[part::3]
    exprs = [k.expression for k in batch]
    mod = tilehal.compile_cuda(cuda_fp4.kernel_source(), arch="sm_90a", name="deepgemm_fp4_dec_compile_check",
                               options=cuda_fp4.OPTIONS + ("--ptxas-options=-v",), name_expressions=exprs)
    assert len(mod.cubin) > 1000
    h.check_compiled(mod, exprs, forbidden=("serialized",))


def test_dec_configs_cover_kinds_tiles_and_c():
    assert {k.act_fp8 for k in DEC_KEYS} == {True, False} and {k.nwg for k in DEC_KEYS} == {1, 2}
    assert {(k.mcast, k.act_fp8, k.nwg) for k in DEC_KEYS} >= {(mc, fp8, nwg) for mc in (2, 4) for fp8 in (False, True)
                                                                for nwg in (1, 2)}
    assert any(k.has_c for k in DEC_KEYS) and {k.out_bf16 for k in DEC_KEYS} == {True, False}
    assert {k.bn for k in DEC_KEYS} >= {16, 32, 56, 64, 128}
    assert {(k.ws > 0, k.act_fp8, k.nwg, k.has_c) for k in DEC_KEYS} >= {(True, f, w, False) for f in (0, 1) for w in (1, 2)}


# ----------------------------------------------------------------------------- GPU

GPU_SHAPES = [(128, 4096, 7168), (64, 2112, 7168), (128, 7168, 2048), (16, 4096, 7168), (37, 136, 1152),
              (200, 200, 256), (1, 64, 128)]


def operands(m, n, k, scales, fp8, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16).cuda()
    w = torch.randn((n, k), generator=g).cuda() * 0.05
    if scales == "spread":
        w[:, 32:64] *= 2.0 ** -9  # group 1 of chunk 0: 9 binades below the rest of its row (e4m3: the slow path)
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32, use_ue8m0=scales != "fp32")
    if scales == "mixed":
        _, sf32 = deepgemm.cast_weights_to_fp4(w, gran_k=32, use_ue8m0=False)
        sf[::2] = sf32[::2] * 1.0  # fp32 scales on even rows: slow-path chunks next to folded ones
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        return (a8, sfa), (packed, sf), fp4.reference(a8, sfa, packed, sf, 32)
    return a, (packed, sf), fp4.reference(a, None, packed, sf, 32)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [None, WS])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("scales", ["ue8m0", "fp32", "spread"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_dec_kernel_matches_reference(m, n, k, scales, fp8, ws, monkeypatch):
    """Folded chunks (ue8m0), the exact slow paths (fp32 scales; e4m3: a row spread over 9 binades), N % BN != 0,
    M past the token tile, several m-blocks: fp32 out within 1e-4 (bf16: fp32 summation order) / 1e-3 (e4m3:
    Hopper's fp8 wgmma sums 32 products inside the tensor core) of max |D|, bf16 out calc_diff < 1e-4."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "dec")
    if ws:  # the warp-specialized kernel (a decoder warpgroup feeding decoded-tile slots)
        monkeypatch.setenv("DEEPGEMM_FP4_DEC_WS", ws)
    act, b, ref = operands(m, n, k, scales, fp8, seed=m + n + k)
    fn = deepgemm.fp8_fp4_gemm_nt if fp8 else deepgemm.bf16_fp4_gemm_nt
    d32 = torch.full((m, n), 7.0, device="cuda")
    fn(act, b, d32)
    err = rel(d32, ref)
    assert err < (1e-3 if fp8 else 1e-4), err
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fn(act, b, d)
    assert deepgemm.testing.calc_diff(d.float(), ref.float()) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("bn,splits,mcast,blocks,ws,fp8", [(*v, fp8) for v in VARIANTS for fp8 in (False, True)
                                                           if fits(fp8, v[0], v[4])])
@pytest.mark.parametrize("m", [128, 64])
def test_gpu_dec_variants_mixed_scales_c_and_graph_replay(m, bn, splits, mcast, blocks, ws, fp8, monkeypatch):
    """The rounds' A/B variants (BN, cluster split-K, multicast, two CTAs per SM; N = 2112: an odd number of 64-row
    slices, so multicast has a phantom CTA) with C and mixed scales, replayed from a CUDA graph."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "dec")
    for name, v in (("BN", bn), ("SPLITS", splits), ("MCAST", mcast), ("BLOCKS", blocks), ("WS", ws)):
        if v:
            monkeypatch.setenv(f"DEEPGEMM_FP4_DEC_{name}", v)
    n, k = 2112, 7168
    act, b, ref = operands(m, n, k, "mixed", fp8, seed=11)
    c = torch.randn(m, n, device="cuda")
    ref = ref + c.double()
    fn = deepgemm.fp8_fp4_gemm_nt if fp8 else deepgemm.bf16_fp4_gemm_nt
    d = torch.empty(m, n, device="cuda")
    fn(act, b, d, c=c)
    tol = 1e-3 if fp8 else 1e-4
    assert rel(d, ref) < tol
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(act, b, d, c=c)
    for _ in range(3):
        d.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert rel(d, ref) < tol


def test_auto_dec_policy_env(monkeypatch):
    """DEEPGEMM_FP4_AUTO_DEC_MIN_M overrides AUTO_DEC_MIN_M under auto only; DEEPGEMM_FP4_KERNEL=dec takes it always."""
    monkeypatch.setattr(cuda_fp4, "AUTO_DEC_MIN_M", {"bf16": None, "e4m3": 33})
    assert not cuda_fp4.use_dec(False, 128) and cuda_fp4.use_dec(True, 33) and not cuda_fp4.use_dec(True, 32)
    monkeypatch.setenv("DEEPGEMM_FP4_AUTO_DEC_MIN_M", "bf16=17,e4m3=none")
    assert cuda_fp4.use_dec(False, 17) and not cuda_fp4.use_dec(False, 16) and not cuda_fp4.use_dec(True, 128)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "wgmma")
    assert not cuda_fp4.use_dec(False, 128)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "dec")
    assert cuda_fp4.use_dec(False, 1) and cuda_fp4.use_dec(True, 1)
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "auto")
    for bad in ("bf16=x", "fp8=3", "bf16"):
        monkeypatch.setenv("DEEPGEMM_FP4_AUTO_DEC_MIN_M", bad)
        with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_AUTO_DEC_MIN_M"):
            cuda_fp4.use_dec(False, 64)


@pytest.mark.parametrize("fp8", [False, True])
def test_dec_multicast_plan_fits_the_drivers_cluster_count(fp8, monkeypatch):
    """Multicast plans size the slices for the GPC model's cluster count; when the driver holds fewer clusters the
    launch widens the slice (8 rows at a time) until they all fit."""
    for mc, n, want in (("2", 4096, 32), ("2", 2112, 16), ("4", 4096, 32), ("4", 2112, 24), ("4", 7168, 56)):
        p = cuda_fp4._plan_dec(128, n, 7168, True, False, fp8, SMS, None, None, mc)
        assert p.key.bn == want and p.grid[0] // p.key.mcast <= cuda_fp4.cluster_capacity(SMS, 1, int(mc))
    launches = []

    class Stub:
        def launch(self, grid, threads, args, smem_bytes=0, cluster=None):
            launches.append((grid, cluster))

    monkeypatch.setattr(cuda_fp4, "_kernel", lambda key: Stub())
    monkeypatch.setattr(cuda_fp4, "get_num_sms", lambda: SMS)
    monkeypatch.setattr(cuda_fp4, "_max_active_clusters_x", lambda key, size, dev, smem: 30)  # the model says 32
    monkeypatch.setattr(cuda_fp4, "_launch_dec", lambda p, *args: launches.append(p))
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "dec")
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_MCAST", "4")
    m, n, k = 128, 4096, 7168
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    sfa = torch.ones(m, k // 128) if fp8 else None
    d = torch.empty(m, n, dtype=torch.bfloat16)
    assert cuda_fp4._try_dec(a, sfa, torch.zeros(n, k // 2, dtype=torch.int8), torch.ones(n, k // 32), d, None, m, n, k)
    p, = launches
    assert p.key.bn == 40 and p.grid == (104, 1, 1) and p.cluster == (4, 1, 1)  # 26 clusters of 4 <= 30


def test_ws_plan_and_key(monkeypatch):
    """DEEPGEMM_FP4_DEC_WS: the warp-specialized kernel (a decoder warpgroup: 160 more threads than the math ones), its
    slots in the shared memory budget; no multicast with it; bad counts refused."""
    p = cuda_fp4._plan_dec(128, 4096, 7168, True, False, False, SMS, None, None, None, None, "3")
    assert p.key.ws == 3 and p.key.KERNEL == "fp4_decws_sm90" and p.key.threads == 416
    assert p.key.expression.endswith(f"<32, 2, false, __nv_bfloat16, false, {p.key.stages}, 3>")
    assert p.key.smem_bytes <= 227 * 1024 and p.grid == (128, 1, 1)
    assert cuda_fp4._plan_dec(128, 4096, 7168, True, False, False, SMS, None, None).key.KERNEL == "fp4_dec_sm90"
    for bad, mc in (("5", None), ("1", None), ("3", "2")):
        with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_DEC"):
            cuda_fp4._plan_dec(128, 4096, 7168, True, False, False, SMS, None, None, mc, None, bad)
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_WS", "4")
    assert cuda_fp4.plan_dec(64, 2112, 7168, True, False, True, num_sms=SMS).key.ws == 4


def test_dec_default_ws_table(monkeypatch):
    """DEC_DEFAULT_WS (per activation kind) picks the warp-specialized kernel where DEEPGEMM_FP4_DEC_WS is unset; the
    variable wins (0: the first kernel)."""
    assert cuda_fp4.DEC_DEFAULT_WS == {"bf16": None, "e4m3": None}  # no GPU figure has flipped it yet
    monkeypatch.setattr(cuda_fp4, "DEC_DEFAULT_WS", {"bf16": "3", "e4m3": None})
    assert cuda_fp4.plan_dec(128, 4096, 7168, True, False, False, num_sms=SMS).key.ws == 3
    assert cuda_fp4.plan_dec(128, 4096, 7168, True, False, True, num_sms=SMS).key.ws == 0
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_WS", "0")
    assert cuda_fp4.plan_dec(128, 4096, 7168, True, False, False, num_sms=SMS).key.ws == 0
    monkeypatch.setenv("DEEPGEMM_FP4_DEC_WS", "4")
    assert cuda_fp4.plan_dec(128, 4096, 7168, True, False, True, num_sms=SMS).key.ws == 4
