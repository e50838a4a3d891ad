"""The grouped kernels' schedule variants: the producer-fed tile schedule (-DDEEPGEMM_TILE_INFO=1), 2-CTA
multicast with the grid capped at the clusters resident at once, and (opt-in, s27) A multicast with the producer-fed
schedule and the expert-major raster (-DDEEPGEMM_EXPERT_RASTER=1). NVRTC (CI): they compile without spills; CPU:
the cap's fallback, the opt-in switches; GPU: each variant writes exactly what the default kernel writes (same
arithmetic, same order). The schedules' tile order itself: test_grouped_schedule.py."""

from __future__ import annotations

import dataclasses

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import cuda_gemm
from deepgemm.heuristics import epilogue_bytes, expert_raster_config, max_stages, pick_config
from tilehal import ArgumentError

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


def _s27_variant(cfg, variant):
    """The s27 opt-in contiguous schedules (bench_grouped.py VARIANTS of the same names)."""
    mcast = dataclasses.replace(cfg, multicast=2, multicast_on_a=True, tile_info=True)
    return {"mcast_info": mcast, "expert": expert_raster_config(cfg), "expert16": expert_raster_config(cfg, 16),
            "expert_mcast": expert_raster_config(mcast, 8)}[variant]


S27_VARIANTS = ("mcast_info", "expert", "expert16", "expert_mcast")


@nvrtc
def test_s27_schedule_kernels_compile_without_spills(h):
    cfg = _contiguous_cfg(32768, 4096, 7168, 4)
    keys = [cuda_gemm.kernel_key(_s27_variant(cfg, v), 4096, 7168, "contiguous", 4, torch.bfloat16, False)
            for v in S27_VARIANTS]
    assert all(k.tile_info for k in keys) and [k.expert_raster for k in keys] == [False, True, True, True]
    for key in keys:  # one module per variant: the -D switches differ
        mod = cuda_gemm.compile_kernel(key, ("--ptxas-options=-v",))
        h.check_compiled(mod, [key.expression])


def test_s27_schedules_are_opt_in(monkeypatch):
    cfg = _contiguous_cfg(32768, 4096, 7168, 4)
    assert not cfg.expert_raster and cfg.multicast == 1 and cfg.use_tile_info
    # multicast keeps the math warps' schedule unless tile_info=True is asked for (DEEPGEMM_MULTICAST=2 as before)
    assert not dataclasses.replace(cfg, multicast=2, multicast_on_a=True).use_tile_info
    assert not dataclasses.replace(cfg, multicast=2, multicast_on_a=False, tile_info=True).use_tile_info
    assert _s27_variant(cfg, "mcast_info").use_tile_info
    monkeypatch.delenv("DEEPGEMM_GROUPED_SCHEDULE", raising=False)
    assert cuda_gemm.grouped_schedule(cfg, 32768, 4096) == cfg
    monkeypatch.setenv("DEEPGEMM_GROUPED_SCHEDULE", "expert:16,mcast")
    got = cuda_gemm.grouped_schedule(cfg, 32768, 4096)
    assert (got.expert_raster, got.expert_band, got.multicast, got.multicast_on_a, got.use_tile_info) == (
        True, 16, 2, True, True)
    assert got.smem_bytes == cfg.smem_bytes + 4096 and got.stages == cfg.stages
    monkeypatch.setenv("DEEPGEMM_GROUPED_SCHEDULE", "mcast")  # 7 n-blocks of 128: no even pairs, left as is
    assert cuda_gemm.grouped_schedule(cfg, 32768, 896).multicast == 1
    monkeypatch.setenv("DEEPGEMM_GROUPED_SCHEDULE", "expert:x")
    with pytest.raises(ArgumentError, match="DEEPGEMM_GROUPED_SCHEDULE.*'expert:x'"):
        cuda_gemm.grouped_schedule(cfg, 32768, 4096)


def test_expert_raster_checks():
    cfg = _contiguous_cfg(32768, 4096, 7168, 4)
    with pytest.raises(ArgumentError, match="grouping='masked'"):
        expert_raster_config(_masked_cfg(256, 512, 512, 3))
    with pytest.raises(ArgumentError, match="band"):
        expert_raster_config(cfg, -1)
    with pytest.raises(ArgumentError, match="tile_info"):
        cuda_gemm.check_expert_raster(dataclasses.replace(expert_raster_config(cfg), tile_info=False), 32768)
    er = expert_raster_config(cfg)
    assert cuda_gemm.check_expert_raster(er, 2048 * 128) is er
    assert not cuda_gemm.check_expert_raster(er, 2048 * 128 + 1).expert_raster  # past the kernel's table
    assert cuda_gemm.kernel_key(er, 4096, 7168, "contiguous", 4, torch.bfloat16, False).expression == \
        cuda_gemm.kernel_key(cfg, 4096, 7168, "contiguous", 4, torch.bfloat16, False).expression  # -D only


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
@pytest.mark.parametrize("variant", S27_VARIANTS)
def test_s27_contiguous_schedules_write_what_the_default_writes(variant):
    # padding blocks between experts, an expert that comes back later (two segments), an empty expert, and an
    # m-block count that is not a multiple of the grid
    runs = [(0, 300), (2, 129), (-1, 256), (1, 640), (0, 100), (3, 77), (4, 1)]  # expert 0 comes back
    m_indices = torch.tensor([x for e, c in runs for x in [e] * c + [-1] * (-c % 128)], dtype=torch.int32).cuda()
    m, g, n, k = m_indices.numel(), 5, 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(5)
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, generator=gen, device="cuda"), tma_aligned_sf=True)
    b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k, generator=gen, device="cuda"))
    ref = torch.full((m, n), 7.0, dtype=torch.bfloat16, device="cuda")
    cuda_gemm.grouped_contiguous(a8, sfa, b8, sfb, ref, m_indices)
    d = torch.full_like(ref, 7.0)
    cuda_gemm.grouped_contiguous(a8, sfa, b8, sfb, d, m_indices, config=_s27_variant(_contiguous_cfg(m, n, k, g), variant))
    assert torch.equal(d, ref)
    padding_blocks = (m_indices.view(-1, 128)[:, 0] < 0).repeat_interleave(128)
    assert padding_blocks.sum() == 256 and (d[padding_blocks] == 7.0).all()  # whole padding blocks untouched


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


def _masked_operands(g, m_max, n, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a8 = torch.empty(g, m_max, k, device="cuda", dtype=torch.float8_e4m3fn)
    sfa = torch.empty(g, m_max, k // 128, device="cuda")
    for i in range(g):
        a8[i], sfa[i] = deepgemm.per_token_cast_to_fp8(torch.randn(m_max, k, generator=gen, device="cuda"))
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k, generator=gen, device="cuda"))
    return a8, sfa, b8, sfb


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["info", "mcast", "mcast_b"])
def test_masked_variants_write_what_the_default_writes(variant):
    g, m_max, n, k = 4, 384, 1024, 768
    a8, sfa, b8, sfb = _masked_operands(g, m_max, n, k, 4)
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


# ---------------------------------------------------------------- s27 masked variants (opt-in, not GPU-timed yet)
MASKED_S27 = ("tma", "tma_info", "bn96", "bn112", "cursor")
CURSOR = ("-DDEEPGEMM_MASKED_CURSOR=1",)


def _masked_s27(m, n, k, g, variant):
    """(config, extra options) of bench_grouped.py's masked variant of the same name."""
    tma = pick_config("fp8", m, n, k, num_groups=g, grouping="masked", num_sms=132, tma_store=True)
    base = _masked_cfg(m, n, k, g)
    if variant in ("bn96", "bn112"):
        bn = int(variant[2:])
        return dataclasses.replace(base, block_n=bn, stages=max_stages(
            "fp8", 128, bn, epilogue_bytes(128, bn, False, base.staged_store), grouped=True)), ()
    return {"tma": (tma, ()), "tma_info": (dataclasses.replace(tma, tile_info=True), ()),
            "cursor": (base, CURSOR)}[variant]


def _spill_bytes(log: str) -> list[int]:
    return [int(line.split("bytes spill stores")[0].rsplit(",", 1)[1]) for line in log.splitlines()
            if "spill stores" in line]


@nvrtc
def test_s27_masked_kernels_compile(h):
    """The cursor walk and the narrower tiles compile spill-free; the TMA-store epilogue with the overlapped
    promotion spills a few loop-invariant staging addresses (stored before the first tile, reloaded in each
    tile's epilogue, never inside the wgmma loop: nvdisasm of the 4-group kernel, s27): at most 40 bytes."""
    for g, m, n, k in ((4, 256, 4096, 7168), (1, 1024, 7168, 2048)):
        for v in MASKED_S27:
            cfg, opts = _masked_s27(m, n, k, g, v)
            key = cuda_gemm.kernel_key(cfg, n, k, "masked", g, torch.bfloat16, False)
            assert key.tma_store == v.startswith("tma")
            mod = cuda_gemm.compile_kernel(key, ("--ptxas-options=-v",) + opts)
            if v.startswith("tma"):
                assert key.expression in mod.lowered_names
                assert mod.cache_hit or (len(_spill_bytes(mod.log)) == 1 and _spill_bytes(mod.log)[0] <= 40), mod.log
            else:
                h.check_compiled(mod, [key.expression])


def test_masked_tma_store_is_opt_in(monkeypatch):
    d = torch.empty(1, 1, dtype=torch.bfloat16)
    monkeypatch.delenv("DEEPGEMM_MASKED_EPILOGUE", raising=False)
    assert cuda_gemm.epilogue(d, 4096, False, "masked") == {"tma_store": False, "staged_store": 2}
    monkeypatch.setenv("DEEPGEMM_MASKED_EPILOGUE", "tma")
    assert cuda_gemm.epilogue(d, 4096, False, "masked") == {"tma_store": True, "staged_store": 0}
    assert cuda_gemm.epilogue(d, 4100, False, "masked")["tma_store"] is False  # rows not 16-byte multiples


@pytest.mark.gpu
@pytest.mark.parametrize("variant", MASKED_S27)
def test_s27_masked_variants_write_what_the_default_writes(variant):
    # full blocks (TMA store), a group with one full and one 1-row block, an empty group, a 1-row group
    g, m_max, n, k = 4, 384, 1024, 768
    a8, sfa, b8, sfb = _masked_operands(g, m_max, n, k, 6)
    counts = [384, 0, 129, 1]
    masked_m = torch.tensor(counts, dtype=torch.int32, device="cuda")
    ref = torch.full((g, m_max, n), 7.0, dtype=torch.bfloat16, device="cuda")
    cuda_gemm.grouped_masked(a8, sfa, b8, sfb, ref, masked_m, 128)
    d = torch.full_like(ref, 7.0)
    cfg, opts = _masked_s27(128, n, k, g, variant)
    cuda_gemm.grouped_masked(a8, sfa, b8, sfb, d, masked_m, 128, config=cfg, extra_options=opts)
    assert all((d[i, c:] == 7.0).all() for i, c in enumerate(counts))  # no row past masked_m written
    if variant.startswith("bn"):
        # another tile width (bn112: the serial promotion) may round a few sums differently (the s26 bench saw
        # calc_diff ~1e-16 between promotion paths); the fp8 recipe's own error is ~1e-3
        rows = torch.cat([d[i, :c] for i, c in enumerate(counts)]).double()
        want = torch.cat([ref[i, :c] for i, c in enumerate(counts)]).double()
        assert tilehal.calc_diff(rows, want) < 1e-9
    else:  # same tile, same arithmetic: bit for bit
        assert torch.equal(d, ref)


@pytest.mark.gpu
def test_env_switches_reach_the_public_api(monkeypatch):
    """DEEPGEMM_GROUPED_SCHEDULE / DEEPGEMM_MASKED_EPILOGUE through the public entry points (host plans keyed on
    them): the same kernels as the expert_mcast / tma variants above, the default's outputs bit for bit."""
    runs = [(0, 300), (2, 129), (-1, 256), (1, 640), (0, 100), (3, 77), (4, 1)]
    m_indices = torch.tensor([x for e, c in runs for x in [e] * c + [-1] * (-c % 128)], dtype=torch.int32).cuda()
    m, g, n, k = m_indices.numel(), 5, 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(5)
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, generator=gen, device="cuda"), tma_aligned_sf=True)
    b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k, generator=gen, device="cuda"))
    outs = []
    for value in (None, "expert:8,mcast"):
        if value is None:
            monkeypatch.delenv("DEEPGEMM_GROUPED_SCHEDULE", raising=False)
        else:
            monkeypatch.setenv("DEEPGEMM_GROUPED_SCHEDULE", value)
        d = torch.full((m, n), 7.0, dtype=torch.bfloat16, device="cuda")
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, m_indices)
        outs.append(d)
    assert torch.equal(outs[0], outs[1])
    monkeypatch.delenv("DEEPGEMM_GROUPED_SCHEDULE")

    gm, m_max, n, k = 4, 384, 1024, 768
    a8, sfa, b8, sfb = _masked_operands(gm, m_max, n, k, 6)
    masked_m = torch.tensor([384, 0, 129, 1], dtype=torch.int32, device="cuda")
    outs = []
    for value in ("staged", "tma"):
        monkeypatch.setenv("DEEPGEMM_MASKED_EPILOGUE", value)
        d = torch.full((gm, m_max, n), 7.0, dtype=torch.bfloat16, device="cuda")
        deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked_m, 128)
        outs.append(d)
    assert torch.equal(outs[0], outs[1])
