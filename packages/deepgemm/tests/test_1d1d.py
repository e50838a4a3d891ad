"""The (1, 1, 128) fp8 recipe on sm_90a (kernels/gemm_1d1d_sm90.cuh): dense weight-gradient GEMMs and
k-grouped contiguous GEMMs. Config picks and NVRTC compiles run on the CPU (CI); the kernels are
checked against the reference on the GPU."""

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import gemm_1d1d, reference
from deepgemm.gemm_1d1d import key_1d1d, pick_1d1d

# DeepGEMM test_fp8_fp4's SM90 weight-gradient rows: M = N_fwd, N = 4096, K = K_fwd, fp32 D += A @ B^T.
WGRAD_MK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
K_GROUPED_MN = [(4096, 7168), (7168, 2048)]
ODD = [(1, 200, 256), (70, 136, 384), (130, 1000, 1152), (256, 96, 128)]


def kernel_keys():
    keys = set()
    for m, k in WGRAD_MK:
        keys.add(key_1d1d(pick_1d1d(m, 4096, 132), 4096, torch.float32, True))
    for m, n in K_GROUPED_MN:
        keys.add(key_1d1d(pick_1d1d(m, n, 132), n, torch.float32, True))
    for m, n, _ in ODD:
        for out, has_c in ((torch.float32, True), (torch.bfloat16, False)):
            keys.add(key_1d1d(pick_1d1d(m, n, 132), n, out, has_c))
    for bn in gemm_1d1d.BLOCK_N_CANDIDATES:  # every tile width, one and two math warpgroups
        for bm in (64, 128):
            cfg = gemm_1d1d.Config1D1D(bm, bn, gemm_1d1d.max_stages(bm, bn), 132)
            keys.add(key_1d1d(cfg, 4096, torch.float32, True))
    return sorted(keys, key=lambda k: k.expression)


def test_pick_1d1d_fits_shared_memory_and_aligns_scale_tiles():
    for m in (1, 64, 65, 576, 4096, 32768):
        for n in (96, 2048, 4096, 7168):
            cfg = pick_1d1d(m, n, 132)
            assert cfg.block_m == (64 if m <= 64 else 128)
            assert cfg.block_n in gemm_1d1d.BLOCK_N_CANDIDATES and cfg.block_n % 32 == 0
            assert cfg.smem_bytes <= 232448 and cfg.stages >= 3


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
def test_1d1d_kernels_compile_without_spills(h):
    keys = kernel_keys()
    assert len(keys) >= 12
    h.check_compiled_batches(gemm_1d1d.compile_kernels, keys)


def test_packed_ue8m0_scales_name_the_sm100_format_on_cuda_only():
    # On the CPU packed scales run (reference); the CUDA error is checked in the GPU test below.
    a = torch.randn(64, 512)  # packing takes K / 128 in multiples of 4
    b = torch.randn(96, 512)
    a8, pa = deepgemm.per_token_cast_to_fp8(a, use_ue8m0=True, use_packed_ue8m0=True)
    b8, pb = deepgemm.per_token_cast_to_fp8(b, use_ue8m0=True, use_packed_ue8m0=True)
    d = torch.zeros(64, 96)
    deepgemm.fp8_fp4_gemm_nt((a8, pa), (b8, pb), d, c=d)
    assert torch.isfinite(d).all() and d.abs().sum() > 0


# ----------------------------------------------------------------------------- GPU


def _pair_1d(x):
    return deepgemm.per_token_cast_to_fp8(x)  # 1x128 scales [rows, SK]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", WGRAD_MK[:3] + WGRAD_MK[-2:])
def test_1d1d_wgrad_upstream_shapes(m, k):
    n = 4096
    g = torch.Generator(device="cuda").manual_seed(m + k)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(n, k, generator=g, device="cuda").bfloat16()
    a8, sfa = _pair_1d(a)
    b8, sfb = _pair_1d(b)
    c = torch.randn(m, n, generator=g, device="cuda") * 32
    want = reference.fp8_gemm_nt(a8, sfa, b8, sfb, c, 128, 1)
    d = c.clone()
    deepgemm.fp8_fp4_gemm_nt((a8, sfa), (b8, sfb), d, c=d, recipe=(1, 1, 128))
    assert deepgemm.testing.calc_diff(d, want) < 1e-6
    assert deepgemm.testing.calc_diff(d, c + a.float() @ b.float().T) < 1e-3  # DeepGEMM's bar vs bf16 inputs


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", ODD)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_1d1d_odd_shapes(m, n, k, out):
    g = torch.Generator(device="cuda").manual_seed(n)
    a8, sfa = _pair_1d(torch.randn(m, k, generator=g, device="cuda"))
    b8, sfb = _pair_1d(torch.randn(n, k, generator=g, device="cuda"))
    c = torch.randn(m, n, generator=g, device="cuda") if out == torch.float32 else None
    d = torch.empty(m, n, dtype=out, device="cuda")
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d, c=c, recipe_a=(1, 128), recipe_b=(1, 128))
    want = reference.fp8_gemm_nt(a8, sfa, b8, sfb, c, 128, 1)
    torch.testing.assert_close(d.float(), want, rtol=1e-2 if out == torch.bfloat16 else 1e-4,
                               atol=1e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", K_GROUPED_MN)
def test_k_grouped_fp8_nt_on_gpu(m, n):
    ks = [1024, 0, 2048, 384]
    g = torch.Generator(device="cuda").manual_seed(m)
    blocks_a, blocks_b, sa, sb = [], [], [], []
    for kg in ks:
        qa, s_a = _pair_1d(torch.randn(m, kg, generator=g, device="cuda"))
        qb, s_b = _pair_1d(torch.randn(n, kg, generator=g, device="cuda"))
        blocks_a.append(qa.reshape(-1))
        blocks_b.append(qb.reshape(-1))
        sa.append(s_a)
        sb.append(s_b)
    fa, fb = torch.cat(blocks_a), torch.cat(blocks_b)
    sfa, sfb = torch.cat(sa, dim=1), torch.cat(sb, dim=1)
    c = torch.randn(len(ks), m, n, generator=g, device="cuda")
    layout = torch.tensor(ks, dtype=torch.int32, device="cuda")
    d = torch.empty_like(c)
    deepgemm.k_grouped_fp8_gemm_nt_contiguous((fa, sfa), (fb, sfb), d, ks, layout, c)
    ref = torch.empty_like(c.cpu())  # the CPU reference of the same call
    deepgemm.k_grouped_fp8_gemm_nt_contiguous((fa.cpu(), sfa.cpu()), (fb.cpu(), sfb.cpu()), ref, ks, layout.cpu(),
                                              c.cpu())
    assert torch.equal(d[1].cpu(), c[1].cpu())  # empty group keeps C
    assert deepgemm.testing.calc_diff(d.cpu(), ref) < 1e-6
    d2 = c.clone()  # in place (c is d), DeepGEMM's usage
    deepgemm.k_grouped_fp8_gemm_nt_contiguous((fa, sfa), (fb, sfb), d2, ks, layout, d2)
    assert deepgemm.testing.calc_diff(d2.cpu(), ref) < 1e-6


@pytest.mark.gpu
def test_sm100_only_features_are_named_on_gpu():
    a = torch.randn(128, 512, device="cuda")
    a8, pa = deepgemm.per_token_cast_to_fp8(a, use_ue8m0=True, use_packed_ue8m0=True)
    d = torch.zeros(128, 128, device="cuda")
    with pytest.raises(deepgemm.UnsupportedError, match="sfa: expected float32 scales on CUDA, got packed UE8M0"):
        deepgemm.fp8_fp4_gemm_nt((a8, pa), (a8[:128], pa[:128]), d, c=d)
    a8f, sfa = deepgemm.per_token_cast_to_fp8(a, gran_k=64)
    with pytest.raises(deepgemm.UnsupportedError, match="gran_k = 64"):
        deepgemm.fp8_fp4_gemm_nt((a8f, sfa), (a8f[:128], sfa[:128]), d, c=d, recipe=(1, 1, 64))
    ks = [256]
    lay = torch.tensor(ks, dtype=torch.int32, device="cuda")
    q, s = deepgemm.per_token_cast_to_fp8(torch.randn(128, 256, device="cuda"))  # M = 128, sum K = 256
    a_tn, sfa_tn = q.T.contiguous(), s.T.contiguous()  # stored [sum K, M] / [sum K / 128, M]
    with pytest.raises(deepgemm.UnsupportedError, match="k_grouped_fp8_gemm_tn_contiguous"):
        deepgemm.k_grouped_fp8_gemm_tn_contiguous((a_tn, sfa_tn), (a_tn, sfa_tn), torch.zeros(1, 128, 128, device="cuda"),
                                                  ks, lay, torch.zeros(1, 128, 128, device="cuda"))
