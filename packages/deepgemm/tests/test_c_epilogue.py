"""The two opt-in C paths of session 27 (issue 18's bf16 M = 128 rows with C): the persistent kernel's C_TMA
epilogue (DEEPGEMM_C_EPILOGUE=tma: a bf16 C TMA-loaded into the staging tile while the main loop runs, added in
registers, TMA-stored) and split-K's C_EARLY (DEEPGEMM_SPLITK_C=early: split 0 adds C to its partial sums).
CPU: keys, configs, switches, NVRTC compiles without spills (CI). GPU: against the reference and, for C_TMA, bit
for bit against the default staged epilogue (the same fp32 sum, one rounding)."""

import dataclasses
import logging

import deepgemm
import pytest
import tilehal
import torch
from deepgemm import cuda_gemm, reference, splitk
from deepgemm.heuristics import SMEM_CAPACITY, epilogue_bytes, epilogue_passes, pick_config, with_tile
from deepgemm.splitk import SplitKConfig, effective_splits, splitk_key

nvrtc = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")
bf16 = torch.bfloat16

# (M, N, K): issue 18's missing rows, a multi-wave grid (each CTA does several tiles: the C barrier's phases and
# the wait for the previous store's read), 64-row tiles, an N tail inside a tile, 256-wide tiles (one C box pass).
CTMA_SHAPES = [(128, 7168, 2048), (128, 32768, 512), (128, 24576, 1536), (1000, 4096, 512), (40, 2112, 1024),
               (200, 1000, 272), (300, 520, 4096)]


def ctma_cfg(m, n, k):
    return pick_config("bf16", m, n, k, num_sms=132, tma_store=True, c_tma=True)


def ctma_keys():
    return [cuda_gemm.kernel_key(ctma_cfg(m, n, k), n, k, "normal", 1, bf16, True) for m, n, k in CTMA_SHAPES]


def test_c_tma_key_spells_the_flag_and_leaves_other_names_alone():
    cfg = ctma_cfg(128, 7168, 2048)
    key = cuda_gemm.kernel_key(cfg, 7168, 2048, "normal", 1, bf16, True)
    assert key.c_tma and key.tma_store and key.expression.endswith(", false, false, false, true>")
    plain = cuda_gemm.kernel_key(dataclasses.replace(cfg, c_tma=False), 7168, 2048, "normal", 1, bf16, False)
    assert plain.expression.endswith(", false>") and ", true>" not in plain.expression  # no defaulted flag spelled


def test_c_tma_config_holds_the_whole_c_tile():
    # 128 x 256: one pass over a 64 KiB bf16 tile (the TMA store alone stages 128 columns at a time)
    cfg = ctma_cfg(128, 32768, 512)
    assert (cfg.block_m, cfg.block_n) == (128, 256) and cfg.num_waves == 1
    assert epilogue_passes(256, c_tma=True) == 1 and epilogue_passes(256) == 2
    assert cfg.epilogue_bytes == 128 * 256 * 2 + 8 and cfg.smem_bytes <= SMEM_CAPACITY and cfg.stages >= 3
    # the staged fp32 copy-out of the default takes 128 x 128 tiles in two waves there
    staged = pick_config("bf16", 128, 32768, 512, num_sms=132, staged_store=4)
    assert staged.num_waves == 2 and staged.block_n == 128
    for m, n, k in CTMA_SHAPES:
        c = ctma_cfg(m, n, k)
        assert c.smem_bytes <= SMEM_CAPACITY and c.epilogue_bytes == epilogue_bytes(c.block_m, c.block_n, True, 0, True)


def test_c_tma_refuses_what_it_cannot_serve():
    for kw in ({"kind": "fp8"}, {"grouping": "masked"}):
        args = {"kind": "bf16", "grouping": "normal", **kw}
        with pytest.raises(tilehal.ArgumentError, match="c_tma: expected a bf16 normal GEMM"):
            pick_config(args["kind"], 128, 1024, 1024, grouping=args["grouping"], num_sms=132, tma_store=True,
                        c_tma=True)
    with pytest.raises(tilehal.ArgumentError, match="c_tma"):
        pick_config("bf16", 128, 1024, 1024, num_sms=132, c_tma=True)  # no TMA store
    d = torch.empty(4, 64, dtype=bf16)
    assert cuda_gemm.c_tma_why_not(d, None, 64, False) == "no C"
    assert "fp8" in cuda_gemm.c_tma_why_not(d, d, 64, True)
    assert "float32" in cuda_gemm.c_tma_why_not(d, d.float(), 64, False)
    assert "multiple of 8" in cuda_gemm.c_tma_why_not(d, d, 60, False)
    assert cuda_gemm.c_tma_why_not(d, d, 64, False) is None


def test_c_epilogue_switch(monkeypatch):
    monkeypatch.delenv("DEEPGEMM_C_EPILOGUE", raising=False)
    assert cuda_gemm.c_epilogue_tma()  # the default
    monkeypatch.setenv("DEEPGEMM_C_EPILOGUE", "staged")
    assert not cuda_gemm.c_epilogue_tma()
    monkeypatch.setenv("DEEPGEMM_C_EPILOGUE", "TMA")
    with pytest.raises(tilehal.ArgumentError, match="DEEPGEMM_C_EPILOGUE: expected 'tma' or 'staged', got 'TMA'"):
        cuda_gemm.c_epilogue_tma()


@nvrtc
def test_c_tma_kernels_compile_without_spills(h):
    keys = ctma_keys()
    mc = ctma_cfg(128, 7168, 2048)
    keys.append(cuda_gemm.kernel_key(dataclasses.replace(mc, multicast=2, multicast_on_a=True), 7168, 2048, "normal", 1,
                                     bf16, True))  # with A multicast (the A/B's c_tma_mcast_a)
    for i in range(0, len(keys), 4):
        batch = [k.expression for k in keys[i:i + 4]]
        mod = tilehal.compile_cuda(cuda_gemm.kernel_source(), arch="sm_90a", name="deepgemm_ctma_check",
                                   options=cuda_gemm.OPTIONS + ("--ptxas-options=-v",), name_expressions=batch)
        h.check_compiled(mod, batch, ("serialized", "wait_group is injected"))


# 128 x 32768 x 512 with C (issue 18: 0.88x cuBLAS on its one-wave 128 x 256 tiles): the persistent tiles its sweep
# times (benchmarks/sweep_small_m.py --persistent-tiles), each CTA doing 2-4 tiles whose C loads and D stores overlap
# the next tile's main loop.
WIDE_N_TILES = [(128, 128), (128, 64), (128, 96), (64, 256)]


def wide_n_cfg(bm, bn, m=128, n=32768, k=512):
    return with_tile(ctma_cfg(m, n, k), m, n, bm, bn)


def test_wide_n_tiles_fit_and_count_their_waves():
    assert [(wide_n_cfg(bm, bn).stages, wide_n_cfg(bm, bn).num_waves) for bm, bn in WIDE_N_TILES] == [
        (6, 2), (8, 4), (7, 3), (4, 2)]
    for bm, bn in WIDE_N_TILES:
        cfg = wide_n_cfg(bm, bn)
        assert cfg.c_tma and cfg.smem_bytes <= SMEM_CAPACITY and cfg.epilogue_bytes == bm * bn * 2 + 8
    with pytest.raises(tilehal.ArgumentError, match="with_tile: expected BLOCK_M a multiple of 64"):
        wide_n_cfg(96, 128)


def test_tile_rule_takes_128x128_only_for_short_k_one_wave_128x256_plans(monkeypatch):
    # heuristics.TILE_RULES: M <= 128, K <= 512, the model's 128 x 256 tiles in one wave -> 128 x 128 (H200 s29 dg18 r1,
    # 128 x 32768 x 512: with C 22.1 -> 20.5 us, without 18.7 -> 17.6; cuBLAS 20.1 / 18.1 in the same run)
    from deepgemm import heuristics

    assert heuristics.TILE_RULES == ((128, 512, (128, 256), 1, (128, 128)),)
    shapes = [(m, n, k) for m in (1, 64, 65, 128, 129, 256, 4096) for n in (2112, 7168, 16384, 24576, 28672, 32768, 65536)
              for k in (256, 512, 1536, 7168)]
    changed = set()
    for m, n, k in shapes:
        for c_tma in (True, False):
            base = pick_config("bf16", m, n, k, num_sms=132, tma_store=True, c_tma=c_tma)
            got = heuristics.tile_rule(base, m, n, k)
            if m <= 128 and k <= 512 and (base.block_m, base.block_n) == (128, 256) and base.num_waves == 1:
                assert got == with_tile(base, m, n, 128, 128) and got.stages == 6, (m, n, k, c_tma)
                changed.add((m, n, k))
            else:
                assert got == base, (m, n, k, c_tma)
    assert (128, 32768, 512) in changed and all(m > 64 and k <= 512 for m, _, k in changed), changed
    # not for fp8, staged / direct epilogues (no TMA store), grouped kernels
    for cfg in (pick_config("fp8", 128, 32768, 512, num_sms=132, tma_store=True),
                pick_config("bf16", 128, 32768, 512, num_sms=132, staged_store=4),
                pick_config("bf16", 128, 32768, 512, num_sms=132, grouping="masked", tma_store=True)):
        assert heuristics.tile_rule(cfg, 128, 32768, 512) == cfg


@nvrtc
def test_wide_n_tile_kernels_compile_without_spills(h):
    batch = [cuda_gemm.kernel_key(wide_n_cfg(bm, bn), 32768, 512, "normal", 1, bf16, True).expression
             for bm, bn in WIDE_N_TILES]
    mod = tilehal.compile_cuda(cuda_gemm.kernel_source(), arch="sm_90a", name="deepgemm_ctma_check",
                               options=cuda_gemm.OPTIONS + ("--ptxas-options=-v",), name_expressions=batch)
    h.check_compiled(mod, batch, ("serialized", "wait_group is injected"))


# ----------------------------------------------------------------------------- split-K C_EARLY

# (fp8, (M, N, K), (block_m, block_n, splits), C dtype = D dtype): issue 18's 128 x 4096 x 7168 plan, fp32 C, odd N
# (scalar C loads), M past one m-block, 256-wide tiles (register budget), fp8 with bf16 and fp32 C.
EARLY_CASES = [(False, (128, 4096, 7168), (128, 64, 2), bf16), (False, (128, 2112, 7168), (128, 64, 4), torch.float32),
               (False, (33, 129, 1040), (64, 128, 5), bf16), (False, (130, 1000, 4104), (128, 128, 5), torch.float32),
               (False, (128, 576, 7168), (128, 256, 8), bf16), (True, (128, 2112, 7168), (128, 64, 4), bf16),
               (True, (5, 129, 1040), (64, 128, 3), torch.float32)]


def early_cfg(fp8, m, n, k, bm, bn, splits, reduce=1):
    kb = -(-k // (128 if fp8 else 64))
    s = effective_splits(kb, min(splits if reduce != 2 else min(splits, 8), kb))
    return SplitKConfig(block_m=bm, block_n=bn, splits=s, stages=splitk.max_stages(bm, bn, fp8), num_sms=132, fp8=fp8,
                        par_reduce=reduce == 1, cluster_reduce=reduce == 2, c_early=True)


def early_keys():
    """Every case with par_reduce; the last-CTA and cluster reductions for one bf16 and one fp8 case (the C_EARLY code
    is shared: what differs between reductions is only which path adds no C)."""
    keys = []
    for i, (fp8, (m, n, k), (bm, bn, s), cd) in enumerate(EARLY_CASES):
        for reduce in (1, 0, 2) if i in (0, len(EARLY_CASES) - 1) else (1,):
            keys.append(splitk_key(early_cfg(fp8, m, n, k, bm, bn, s, reduce), n, k, cd, cd, fp8=fp8))
    return keys


def test_c_early_key_and_when_it_applies(monkeypatch):
    cfg = early_cfg(False, 128, 4096, 7168, 128, 64, 2)
    key = splitk_key(cfg, 4096, 7168, bf16, bf16)
    assert key.c_early and key.expression.endswith(", 1, 1, true>")
    last = splitk_key(dataclasses.replace(cfg, par_reduce=False), 4096, 7168, bf16, bf16)
    assert last.expression.endswith(", 1, 0, true>")  # MCAST and REDUCE spelled before the flag
    assert not splitk_key(cfg, 4096, 7168, bf16, None).c_early  # no C: nothing to add early
    assert not splitk_key(dataclasses.replace(cfg, splits=1), 4096, 7168, bf16, bf16).c_early  # one split
    plain = splitk_key(dataclasses.replace(cfg, c_early=False), 4096, 7168, bf16, bf16)
    assert plain.expression.endswith(", 1, 1>")  # the default kernel keeps its name
    base = dataclasses.replace(cfg, c_early=False)
    monkeypatch.setenv("DEEPGEMM_SPLITK_C", "reduce")
    assert splitk.with_c_early(base, True) == base
    monkeypatch.setenv("DEEPGEMM_SPLITK_C", "late")
    with pytest.raises(tilehal.ArgumentError, match="DEEPGEMM_SPLITK_C: expected 'auto', 'early' or 'reduce', got"):
        splitk.with_c_early(base, True)
    monkeypatch.delenv("DEEPGEMM_SPLITK_C", raising=False)  # the default: bf16 only (fp8 keeps the reduction's C)
    fp8_base = dataclasses.replace(base, fp8=True)
    assert splitk.with_c_early(fp8_base, True) == fp8_base
    assert splitk.with_c_early(base, True).c_early
    monkeypatch.setenv("DEEPGEMM_SPLITK_C", "early")
    assert splitk.with_c_early(fp8_base, True).c_early
    assert splitk.with_c_early(base, True).c_early
    assert splitk.with_c_early(base, False) == base
    assert splitk.with_c_early(dataclasses.replace(base, splits=1), True).splits == 1


@nvrtc
def test_c_early_kernels_compile_without_spills(h):
    h.check_compiled_batches(splitk.compile_kernels, early_keys())


# ----------------------------------------------------------------------------- GPU


def _ab(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn((m, k), generator=g, device="cuda").bfloat16(),
            torch.randn((n, k), generator=g, device="cuda").bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", CTMA_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in CTMA_SHAPES])
@pytest.mark.parametrize("in_place", [False, True], ids=["c", "c_is_d"])
def test_c_tma_matches_reference_and_staged_bitwise(shape, in_place):
    m, n, k = shape
    a, b = _ab(m, n, k, seed=31)
    c = torch.randn(m, n, device="cuda").to(bf16)
    ref = reference.bf16_gemm_nt(a, b, c.float())
    staged_cfg = pick_config("bf16", m, n, k, num_sms=132, staged_store=4)
    outs = []
    for cfg in (ctma_cfg(m, n, k), ctma_cfg(m, n, k), staged_cfg):  # twice: the barrier phases start over
        d = c.clone() if in_place else torch.empty(m, n, dtype=bf16, device="cuda")
        cuda_gemm.dense(a, None, b, None, d, d if in_place else c, config=cfg)
        outs.append(d)
    assert deepgemm.testing.calc_diff(outs[0], ref) < 1e-5
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[1], "C_TMA repeated")
    deepgemm.testing.assert_bitwise_equal(outs[0], outs[2], "C_TMA vs the staged copy-out")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", WIDE_N_TILES, ids=[f"{bm}x{bn}" for bm, bn in WIDE_N_TILES])
def test_wide_n_tiles_match_reference(tile):
    m, n, k = 128, 32768, 512
    a, b = _ab(m, n, k, seed=37)
    c = torch.randn(m, n, device="cuda").to(bf16)
    ref = reference.bf16_gemm_nt(a, b, c.float())
    for _ in range(2):  # twice: the C barrier's phases start over
        d = c.clone()
        cuda_gemm.dense(a, None, b, None, d, d, config=wide_n_cfg(*tile))
        assert deepgemm.testing.calc_diff(d, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("acc", [True, False], ids=["c_is_d", "no_c"])
def test_tile_rule_default_dispatch_matches_reference(acc, caplog):
    # 128 x 32768 x 512 takes TILE_RULES' 128 x 128 tiles by default, with C (C_TMA) and without (TMA store)
    from deepgemm import heuristics

    heuristics._tile_rule.cache_clear()  # its DEBUG line is logged once per plan
    m, n, k = 128, 32768, 512
    a, b = _ab(m, n, k, seed=41)
    c = torch.randn(m, n, device="cuda").to(bf16)
    d = c.clone() if acc else torch.empty(m, n, dtype=bf16, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d, c=d if acc else None)
    assert any("128x128 tiles (measured rule" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, reference.bf16_gemm_nt(a, b, c.float() if acc else None)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tma", None], ids=["tma", "default"])
def test_c_tma_through_the_switch_in_a_graph(mode, monkeypatch, caplog, h):
    if mode is None:
        monkeypatch.delenv("DEEPGEMM_C_EPILOGUE", raising=False)  # C_TMA by default
    else:
        monkeypatch.setenv("DEEPGEMM_C_EPILOGUE", mode)
    m, n, k = 128, 7168, 2048
    a, b = _ab(m, n, k, seed=5)
    c = torch.randn(m, n, device="cuda").to(bf16)
    d = torch.empty(m, n, dtype=bf16, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d, c=c)
    assert any("C_TMA epilogue" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, reference.bf16_gemm_nt(a, b, c.float())) < 1e-5
    h.check_graph_replay(lambda: deepgemm.bf16_gemm_nt(a, b, d, c=c), d, "C_TMA graph replay")


@pytest.mark.gpu
def test_c_tma_config_with_fp32_c_is_refused_before_launch():
    m, n, k = 128, 1024, 512
    a, b = _ab(m, n, k, seed=1)
    d = torch.empty(m, n, dtype=bf16, device="cuda")
    with pytest.raises(tilehal.ShapeError, match="config.c_tma"):
        cuda_gemm.dense(a, None, b, None, d, torch.zeros(m, n, device="cuda"), config=ctma_cfg(m, n, k))


@pytest.mark.gpu
@pytest.mark.parametrize("case", EARLY_CASES, ids=[f"{'fp8' if c[0] else 'bf16'}-{c[1][0]}x{c[1][1]}x{c[1][2]}"
                                                   for c in EARLY_CASES])
def test_c_early_matches_reference_in_every_reduction(case):
    fp8, (m, n, k), (bm, bn, s), cd = case
    c = torch.randn(m, n, device="cuda").to(cd)
    if fp8:
        a8, sfa, b8, sfb = _fp8(m, n, k)
        ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, c.float())
    else:
        a, b = _ab(m, n, k, seed=41)
        ref = reference.bf16_gemm_nt(a, b, c.float())
    par = early_cfg(fp8, m, n, k, bm, bn, s, 1)
    plans = [par, par, dataclasses.replace(par, par_reduce=False)]  # par twice (the counters reset), last CTA
    if par.splits <= 8:  # the cluster reduction, same splits: the same sum order
        plans.append(dataclasses.replace(par, par_reduce=False, cluster_reduce=True))
    outs = []
    for cfg in plans:
        d = torch.empty(m, n, dtype=cd, device="cuda")
        if fp8:
            cuda_gemm.dense(a8, sfa, b8, sfb, d, c, config=cfg)
        else:
            cuda_gemm.dense(a, None, b, None, d, c, config=cfg)
        assert deepgemm.testing.calc_diff(d, ref) < 1e-5, cfg
        outs.append(d)
    for o in outs[1:]:
        deepgemm.testing.assert_bitwise_equal(outs[0], o, "C_EARLY: every reduction, one sum order")


def _fp8(m, n, k):
    g = torch.Generator().manual_seed(43)
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn((m, k), generator=g).bfloat16())
    b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn((n, k), generator=g).bfloat16())
    return tuple(t.cuda() for t in (a8, sfa, b8, sfb))


@pytest.mark.gpu
def test_c_early_in_place_and_through_the_switch(monkeypatch, caplog):
    monkeypatch.setenv("DEEPGEMM_SPLITK_C", "early")
    m, n, k = 128, 4096, 7168  # the default plan there is split-K (par_reduce): C = D read before the main loop
    a, b = _ab(m, n, k, seed=7)
    d = torch.randn(m, n, device="cuda").to(bf16)
    ref = reference.bf16_gemm_nt(a, b, d.float())
    with caplog.at_level(logging.DEBUG, logger="deepgemm"):
        deepgemm.bf16_gemm_nt(a, b, d, c=d)
    assert any("split-K kernel" in r.getMessage() for r in caplog.records)
    assert deepgemm.testing.calc_diff(d, ref) < 1e-5
