"""The grouped kernels' schedule variants: the producer-fed tile schedule (-DDEEPGEMM_TILE_INFO=1) and 2-CTA
multicast with the grid capped at the clusters resident at once. NVRTC (CI): they compile; CPU: the cap's
fallback; GPU: each variant writes exactly what the default kernel writes (same arithmetic, same order)."""

from __future__ import annotations

import dataclasses

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import cuda_gemm
from deepgemm.heuristics import pick_config

nvrtc = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
INFO = ("-DDEEPGEMM_TILE_INFO=1",)


def _contiguous_cfg(m, n, k, g, kind="fp8"):
    return pick_config(kind, m, n, k, num_groups=g, grouping="contiguous", num_sms=132, tma_store=True)


def _masked_cfg(m, n, k, g, kind="fp8"):
    return pick_config(kind, m, n, k, num_groups=g, grouping="masked", num_sms=132,
                       staged_store=cuda_gemm.staged_store(torch.bfloat16, n, False, False))


@nvrtc
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_tile_info_kernels_compile(kind, h):
    keys = [cuda_gemm.kernel_key(_contiguous_cfg(4096, 512, 512, 4, kind), 512, 512, "contiguous", 4,
                                 torch.bfloat16, False),
            cuda_gemm.kernel_key(_masked_cfg(256, 512, 512, 3, kind), 512, 512, "masked", 3, torch.bfloat16, False)]
    exprs = [k.expression for k in keys]
    mod = tilehal.compile_cuda(cuda_gemm.kernel_source(), arch="sm_90a", name="deepgemm_gemm_sm90",
                               options=cuda_gemm.OPTIONS + INFO, name_expressions=exprs)
    assert all(e in mod.lowered_names for e in exprs) and mod.cubin


def test_cluster_cap_falls_back_when_the_driver_cannot_say():
    class NoOccupancy:
        def max_active_clusters(self, *a, **k):
            raise tilehal.LaunchError("no driver here")

    cfg = dataclasses.replace(_contiguous_cfg(4096, 512, 512, 4), multicast=2, multicast_on_a=True)
    assert cuda_gemm.resident_cluster_ctas(NoOccupancy(), cfg) is None


def _layout(counts, align=128):
    rows = []
    for e, c in enumerate(counts):
        rows += [e] * c + [-1] * (-c % align)
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["info", "mcast"])
def test_contiguous_variants_write_what_the_default_writes(variant):
    m_indices = _layout([1000, 0, 77, 2000, 128, 5]).cuda()
    m, g, n, k = m_indices.numel(), 6, 1024, 768
    gen = torch.Generator(device="cuda").manual_seed(3)
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, generator=gen, device="cuda"), tma_aligned_sf=True)
    b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k, generator=gen, device="cuda"))
    ref = torch.full((m, n), 7.0, dtype=torch.bfloat16, device="cuda")
    cuda_gemm.grouped_contiguous(a8, sfa, b8, sfb, ref, m_indices)
    d = torch.full_like(ref, 7.0)
    cfg = _contiguous_cfg(m, n, k, g)
    if variant == "mcast":
        cuda_gemm.grouped_contiguous(a8, sfa, b8, sfb, d, m_indices,
                                     config=dataclasses.replace(cfg, multicast=2, multicast_on_a=True))
    else:
        cuda_gemm.grouped_contiguous(a8, sfa, b8, sfb, d, m_indices, config=cfg, extra_options=INFO)
    assert torch.equal(d, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["info", "mcast", "mcast_b"])
def test_masked_variants_write_what_the_default_writes(variant):
    g, m_max, n, k = 4, 384, 1024, 768
    gen = torch.Generator(device="cuda").manual_seed(4)
    a8 = torch.empty(g, m_max, k, device="cuda", dtype=torch.float8_e4m3fn)
    sfa = torch.empty(g, m_max, k // 128, device="cuda")
    for i in range(g):
        a8[i], sfa[i] = deepgemm.per_token_cast_to_fp8(torch.randn(m_max, k, generator=gen, device="cuda"))
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k, generator=gen, device="cuda"))
    masked_m = torch.tensor([384, 0, 129, 1], dtype=torch.int32, device="cuda")
    ref = torch.full((g, m_max, n), 7.0, dtype=torch.bfloat16, device="cuda")
    cuda_gemm.grouped_masked(a8, sfa, b8, sfb, ref, masked_m, 128)
    d = torch.full_like(ref, 7.0)
    cfg = _masked_cfg(128, n, k, g)
    if variant.startswith("mcast"):
        cuda_gemm.grouped_masked(a8, sfa, b8, sfb, d, masked_m, 128,
                                 config=dataclasses.replace(cfg, multicast=2, multicast_on_a=variant == "mcast"))
    else:
        cuda_gemm.grouped_masked(a8, sfa, b8, sfb, d, masked_m, 128, config=cfg, extra_options=INFO)
    assert torch.equal(d, ref)
