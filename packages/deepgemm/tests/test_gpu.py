"""The sm_90a kernels against the reference (same semantics, computed by torch on the GPU).

calc_diff < 1e-3 is the issue's bar; the kernels and the reference differ only in fp32 summation
order inside a 128-wide K block (and the final bf16 rounding), so the gap is usually ~1e-6.
"""

import dataclasses

import deepgemm
import deepgemm.heuristics
import pytest
import torch
from deepgemm import reference
from tilehal import calc_diff

pytestmark = pytest.mark.gpu

DENSE_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
ODD = [(1, 200, 272), (7, 129, 1040), (1000, 200, 272), (1000, 7168, 2048), (130, 24, 128)]


def _operands(m, n, k, groups=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((m, k), generator=g, device="cuda").bfloat16()
    b = torch.randn((n, k) if groups is None else (groups, n, k), generator=g, device="cuda").bfloat16()
    return a, b


@pytest.mark.parametrize("m", [64, 128, 4096])
@pytest.mark.parametrize("n,k", DENSE_NK)
def test_fp8_dense(m, n, k):
    a, b = _operands(m, n, k)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d)
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)
    assert calc_diff(d, ref) < 1e-3
    assert calc_diff(d.float(), a.float() @ b.float().T) < 2e-3  # fp8 quantization error vs the bf16 inputs


@pytest.mark.parametrize("m,n,k", ODD)
def test_fp8_odd_shapes_fp32_out_with_c(m, n, k):
    a, b = _operands(m, n, k, seed=1)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    c = torch.randn(m, n, device="cuda")
    d = torch.empty(m, n, dtype=torch.float32, device="cuda")
    deepgemm.fp8_gemm_nt((a8, deepgemm.get_mn_major_tma_aligned_tensor(sfa)), (b8, sfb), d, c=c)
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, c)
    assert calc_diff(d, ref) < 1e-5
    torch.testing.assert_close(d, ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("m", [64, 128, 4096])
@pytest.mark.parametrize("n,k", [(2112, 7168), (24576, 1536), (7168, 2048), (4096, 7168)])
def test_bf16_dense(m, n, k):
    a, b = _operands(m, n, k, seed=2)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    deepgemm.bf16_gemm_nt(a, b, d)
    assert calc_diff(d, reference.bf16_gemm_nt(a, b, None)) < 1e-5


@pytest.mark.parametrize("m,n,k", ODD)
@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
def test_bf16_odd_and_layouts(m, n, k, layout):
    a, b = _operands(m, n, k, seed=3)
    c = torch.randn(m, n, device="cuda")
    d = torch.empty(m, n, device="cuda")
    a_st = a.T.contiguous() if layout[0] == "t" else a
    b_st = b.T.contiguous() if layout[1] == "n" else b
    getattr(deepgemm, f"bf16_gemm_{layout}")(a_st, b_st, d, c=c)
    ref = reference.bf16_gemm_nt(a, b, c)
    torch.testing.assert_close(d, ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())


def _contiguous_layout(num_groups, rows_per_group, seed):
    align = deepgemm.get_m_alignment_for_contiguous_layout()
    g = torch.Generator().manual_seed(seed)
    counts = [int(rows_per_group * (0.7 + 0.3 * torch.rand(1, generator=g).item())) for _ in range(num_groups)]
    counts[-1] = 0  # one expert without tokens
    padded = [deepgemm.ceil_div(c, align) * align for c in counts]
    m_indices = torch.full((sum(padded),), -1, dtype=torch.int32)
    start = 0
    for e, (cnt, p) in enumerate(zip(counts, padded)):
        m_indices[start:start + cnt] = e
        start += p
    return m_indices.cuda()


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("groups,rows", [(4, 8192), (8, 4096)])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_grouped_contiguous(fp8, groups, rows, n, k):
    m_indices = _contiguous_layout(groups, rows, seed=groups + n)
    m = m_indices.numel()
    a, b = _operands(m, n, k, groups=groups, seed=4)
    d = torch.full((m, n), 7.0, dtype=torch.bfloat16, device="cuda")
    ref = torch.full_like(d, 7.0)
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        b8, sfb = deepgemm.per_block_cast_to_fp8(b)
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, m_indices)
        reference.grouped_contiguous(a8, b8, m_indices, ref, sfa, sfb)
    else:
        deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
        reference.grouped_contiguous(a, b, m_indices, ref)
    # The reference writes padding rows as the kernel does (a block's expert from its first row).
    assert calc_diff(d, ref) < 1e-3
    # blocks made only of padding are skipped: still the fill value
    blocks = (m_indices < 0).view(-1, 128)[:, 0]
    assert torch.all(d.view(-1, 128, n)[blocks] == 7.0)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("groups,m_max", [(1, 1024), (2, 512), (4, 256)])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_grouped_masked(fp8, groups, m_max, n, k):
    gen = torch.Generator().manual_seed(groups * 31 + n)
    masked_m = torch.randint(0, m_max + 1, (groups,), generator=gen, dtype=torch.int32)
    masked_m[0] = max(1, int(masked_m[0]))
    masked_m = masked_m.cuda()
    _check_masked(fp8, masked_m, m_max, n, k, max(1, int(masked_m.float().mean().item())), seed=5)


def _check_masked(fp8: bool, masked_m: torch.Tensor, m_max: int, n: int, k: int, expected_m: int, seed: int) -> None:
    """The masked grouped GEMM (fp8 or bf16) on random operands against the reference: rows below
    masked_m[g] within calc_diff 1e-3, the rows past it not written (they keep d's fill of 3)."""
    groups = masked_m.numel()
    a, b = _operands(groups * m_max, n, k, groups=groups, seed=seed)
    a = a.view(groups, m_max, k)
    d = torch.full((groups, m_max, n), 3.0, dtype=torch.bfloat16, device="cuda")
    ref = torch.full_like(d, 3.0)
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        b8, sfb = deepgemm.per_block_cast_to_fp8(b)
        deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked_m, expected_m)
        reference.grouped_masked(a8, b8, masked_m, ref, sfa, sfb)
    else:
        deepgemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)
        reference.grouped_masked(a, b, masked_m, ref)
    for g, rows in enumerate(masked_m.tolist()):
        if rows:
            assert calc_diff(d[g, :rows], ref[g, :rows]) < 1e-3
        assert torch.all(d[g, rows:] == 3.0)  # not written


def test_masked_is_cuda_graph_safe():
    groups, m_max, n, k = 2, 256, 512, 512
    a, b = _operands(groups * m_max, n, k, groups=groups, seed=6)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a.view(groups, m_max, k))
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    masked_m = torch.tensor([100, 200], dtype=torch.int32, device="cuda")
    d = torch.zeros(groups, m_max, n, dtype=torch.bfloat16, device="cuda")
    deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked_m, 128)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked_m, 128)
    d.zero_()
    masked_m.copy_(torch.tensor([256, 17], dtype=torch.int32))  # new counts, same graph
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.zeros_like(d)
    reference.grouped_masked(a8, b8, masked_m, ref, sfa, sfb)
    assert calc_diff(d[0], ref[0]) < 1e-3 and calc_diff(d[1, :17], ref[1, :17]) < 1e-3
    assert torch.all(d[1, 17:] == 0)


def test_cuda_alignment_is_checked_before_launch():
    from tilehal import ShapeError

    a8 = torch.zeros(16, 100, device="cuda").to(torch.float8_e4m3fn)  # K = 100: rows not 16-byte aligned
    b8 = torch.zeros(32, 100, device="cuda").to(torch.float8_e4m3fn)
    d = torch.empty(16, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ShapeError, match="a: expected K \\* 1 bytes to be a multiple of 16"):
        deepgemm.fp8_gemm_nt((a8, torch.ones(16, 1, device="cuda")), (b8, torch.ones(1, 1, device="cuda")), d)


def test_blas_gemm_on_gpu():
    a, b = _operands(300, 200, 256, seed=7)
    c = torch.randn(300, 200, device="cuda").bfloat16()
    out = deepgemm.gemm(a, b.T.contiguous(), alpha=2.0, beta=0.5, c=c)
    ref = 2.0 * (a.float() @ b.float().T) + 0.5 * c.float()
    assert calc_diff(out, ref) < 1e-4


@pytest.mark.parametrize("fp8", [True, False])
def test_masked_with_multicast(fp8, monkeypatch):
    """With multicast allowed, expected_m = 1024 picks 2-CTA multicast on A; rows past masked_m stay untouched."""
    monkeypatch.setenv("DEEPGEMM_MULTICAST", "2")
    groups, m_max, n, k = 2, 1024, 4096, 1024
    cfg = deepgemm.heuristics.pick_config("fp8" if fp8 else "bf16", m_max, n, k, num_groups=groups,
                                          grouping="masked", max_multicast=2)
    masked_m = torch.tensor([1000, 333], dtype=torch.int32, device="cuda")
    assert cfg.multicast == 2 and cfg.multicast_on_a
    _check_masked(fp8, masked_m, m_max, n, k, m_max, seed=8)


@pytest.mark.parametrize("on_a", [True, False])
@pytest.mark.parametrize("fp8", [True, False])
def test_multicast_phantom_tiles(on_a, fp8):
    """A cluster pair whose second tile lies past M (B shared) or N (A shared) computes a phantom tile
    that must write nothing: force multicast on shapes with an odd number of blocks."""
    from deepgemm import cuda_gemm, heuristics

    # A shared: 3 n-blocks (the second pair's n-block 3 is a phantom); B shared: 5 m-blocks (likewise).
    m, n, k = (3 * 128 + 40, 3 * 128, 512) if on_a else (5 * 128 - 24, 2 * 128, 512)
    a, b = _operands(m, n, k, seed=9)
    base = heuristics.pick_config("fp8" if fp8 else "bf16", m, n, k, tma_store=True, max_multicast=1)
    cfg = dataclasses.replace(base, block_m=128, block_n=128, multicast=2, multicast_on_a=on_a,
                              stages=heuristics.max_stages(base.kind, 128, 128, 128 * 128 * 2))
    out = torch.full((m, n), 5.0, dtype=torch.bfloat16, device="cuda")
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        b8, sfb = deepgemm.per_block_cast_to_fp8(b)
        cuda_gemm.dense(a8, deepgemm.get_mn_major_tma_aligned_tensor(sfa), b8, sfb, out, None, config=cfg)
        ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)
    else:
        cuda_gemm.dense(a, None, b, None, out, None, config=cfg)
        ref = reference.bf16_gemm_nt(a, b, None)
    torch.cuda.synchronize()
    assert calc_diff(out, ref) < 1e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


# K blocks 11 (a full group of 8 + 3) and 20 (8 + 8 + 4, the last block partial); BLOCK_N 88 on N = 320
# puts the middle tile across two 128-wide weight-scale blocks.
OVERLAP_CASES = [(256, 384, 1408, None), (200, 320, 2496, 88)]


@pytest.mark.parametrize("m,n,k,block_n", OVERLAP_CASES)
def test_fp8_overlapped_promotion_matches_serial(m, n, k, block_n):
    """The overlapped promotion (two partial-sum sets, wait_group 1) does the same arithmetic in the
    same order as the serial one: both must match the reference and each other."""
    from deepgemm import cuda_gemm

    cfg = overlap_case_config(m, n, k, block_n)
    assert cfg.overlap_promotion
    a, b = _operands(m, n, k, seed=11)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    sfa_t = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    outs = []
    for c in (cfg, dataclasses.replace(cfg, allow_overlap=False)):
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        cuda_gemm.dense(a8, sfa_t, b8, sfb, out, None, config=c)
        outs.append(out)
    torch.cuda.synchronize()
    ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)
    assert calc_diff(outs[0], ref) < 1e-3 and calc_diff(outs[1], ref) < 1e-3
    assert calc_diff(outs[0], outs[1]) < 1e-5


def overlap_case_config(m, n, k, block_n):
    from deepgemm import heuristics

    base = heuristics.pick_config("fp8", m, n, k, tma_store=True)
    if block_n is None:
        return base
    return dataclasses.replace(base, block_n=block_n,
                               stages=heuristics.max_stages("fp8", base.block_m, block_n, base.block_m * block_n * 2))


# ----------------------------------------------------------------------------- DeepGEMM drop-in points (issue 18)


def test_fp8_nn_stored_scales_on_gpu():
    m, n, k = 256, 384, 384  # square weight-scale matrix: orientation matters
    a, b = _operands(m, n, k, seed=40)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    sfb = sfb * torch.arange(1, 10, device="cuda", dtype=torch.float32).view(3, 3)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    deepgemm.fp8_fp4_gemm_nn((a8, sfa), (b8.T.contiguous(), sfb.T.contiguous()), d)
    assert calc_diff(d, reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)) < 1e-5


@pytest.mark.parametrize("m,n,k", [(128, 2112, 7168), (4096, 576, 7168), (1000, 200, 272), (4096, 32768, 512),
                                   (300, 129, 256)])
def test_bf16_accumulate_into_bf16_on_gpu(m, n, k):
    """bf16 C into bf16 D (DeepGEMM's acc=1 rows): read in place by the persistent kernel's staged epilogue
    (N % 8 == 0), else by the tile kernel; in place (c is d) as DeepGEMM's test calls it."""
    a, b = _operands(m, n, k, seed=41)
    d = (torch.randn(m, n, device="cuda") * 32).bfloat16()
    ref = d.float() + a.float() @ b.float().T
    deepgemm.bf16_gemm_nt(a, b, d, c=d)
    assert calc_diff(d, ref) < 1e-5


def test_psum_layout_on_gpu():
    counts = [300, 0, 1000, 77]
    ends, start = [], 0
    for cnt in counts:
        ends.append(start + cnt)
        start += deepgemm.ceil_div(cnt, 128) * 128
    m = start
    a, b = _operands(m, 4096, 2048, groups=len(counts), seed=42)
    layout = torch.tensor(ends, dtype=torch.int32, device="cuda")
    d = torch.full((m, 4096), 9.0, dtype=torch.bfloat16, device="cuda")
    deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout, use_psum_layout=True)
    m_idx = deepgemm.psum_to_m_indices(layout, m)
    ref = torch.zeros_like(d)
    reference.grouped_contiguous(a, b, m_idx, ref)
    ref[m_idx < 0] = 0
    assert calc_diff(d, ref) < 1e-5 and torch.all(d[m_idx < 0] == 0)


def test_k_grouped_bf16_on_gpu():
    ks = [1024, 0, 2048]
    a = torch.randn(sum(ks), 512, device="cuda").bfloat16()
    b = torch.randn(sum(ks), 768, device="cuda").bfloat16()
    c = torch.randn(3, 512, 768, device="cuda")
    d = torch.empty_like(c)
    deepgemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, torch.tensor(ks, dtype=torch.int32, device="cuda"), c)
    off = 0
    for i, kg in enumerate(ks):
        assert calc_diff(d[i], c[i] + a[off:off + kg].float().T @ b[off:off + kg].float()) < 1e-5
        off += kg


def test_bench_kineto_sees_our_kernels():
    from deepgemm import testing

    a, b = _operands(4096, 4096, 4096, seed=43)
    d = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
    t = testing.bench_kineto(lambda: deepgemm.bf16_gemm_nt(a, b, d), "bf16_gemm", suppress_kineto_output=True)
    assert 0 < t < 0.01


def test_bf16_grouped_contiguous_mn_major_b_on_gpu():
    """DeepGEMM's SM90 bf16 m-grouped test passes an MN-major B ([G, K, N] storage seen as [G, N, K]) to the
    nt entry point: accepted (copied K-major once), same result as the K-major B."""
    g, n, k, rows = 4, 576, 384, 256
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(g * rows, k, generator=gen, device="cuda").bfloat16()
    b = torch.randn(g, n, k, generator=gen, device="cuda").bfloat16()
    b_mn = b.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (K*N, 1, N)
    m_idx = torch.arange(g, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    d_k, d_mn = (torch.empty(g * rows, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d_k, m_idx)
    deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b_mn, d_mn, m_idx)
    ref = torch.cat([a[i * rows:(i + 1) * rows].float() @ b[i].float().T for i in range(g)])
    assert calc_diff(d_k, ref) < 1e-5 and torch.equal(d_k, d_mn)
