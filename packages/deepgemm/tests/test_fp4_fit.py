"""The small FP4 kernel's planner with the driver's cluster counts (DEEPGEMM_FP4_SMALL_FIT=driver): on the CPU with
the count mocked (every plan fits it; the plan is the cost model's best among the candidates that fit; the launch
path takes it), and (GPU) the kernel it plans against the float64 reference."""

import itertools
import types

import deepgemm
import pytest
import torch
from deepgemm import cuda_fp4, fp4
from hypothesis import given, settings
from hypothesis import strategies as st

# An H200-like GPC layout (132 SMs) under which "a cluster takes `size` distinct SMs of one GPC, `per` CTAs deep"
# gives the driver figure session 28's ncu round read: 69 five-CTA clusters at 3 CTAs per SM (the GPC model: 74).
H200_LIKE = (18, 18, 18, 16, 16, 16, 16, 14)


def layered_count(gpcs, per_size=None):
    """A mocked driver: clusters of `size` CTAs resident at once = CTAs per SM x sum over GPCs of SMs // size, the
    CTAs per SM the build's and its shared memory's; per_size[size] (if given) scales it or says None (unknown)."""
    def count(key, size, smem):
        per = min(key.minb, cuda_fp4.SM_SMEM // (smem + 1024))
        have = per * sum(g // size for g in gpcs)
        if per_size is not None:
            f = per_size[size - 1]
            return None if f is None else int(have * f)
        return have
    return count


def ceil_div(a, b):
    return -(-a // b)


def best_fitting(m, n, k, count, sms=132, minb=None, groups=1, masked=False, expected_m=None):
    """Brute force, written from the planner's documented cost: (rw, splits, chunks per split) of the cheapest
    candidate whose clusters are all resident at once by `count` (a 1-CTA plan runs in waves; an unknown count:
    the GPC model's), ties to more row warps, then fewer splits."""
    mm = expected_m or m
    nt = 1
    while nt < 8 and 8 * nt < mm:
        nt *= 2
    build_minb = minb or cuda_fp4.SMALL_BUILD[nt][0]
    chunks = k // 128
    tiles_m = groups * ceil_div(mm if masked and expected_m else m, 8 * nt)
    best = None
    for rw in (1, 2, 4, 8):
        kw = 8 // rw
        tiles = ceil_div(n, 16 * rw) * tiles_m
        for s0 in range(1, min(8, max(1, chunks // kw)) + 1):
            cps = ceil_div(chunks, s0)
            sp = ceil_div(chunks, cps)
            smem = max(8 * nt * cps * 256, (kw - 1) * rw * 32 * nt * 16, 8 * nt * 16 * rw * 4)
            fit = min(build_minb, cuda_fp4.SM_SMEM // (smem + 1024))
            if fit == 0:
                continue
            have = count(types.SimpleNamespace(minb=build_minb), sp, smem)  # what the mocked count reads
            if have is None:
                cap = cuda_fp4.cluster_capacity(sms, fit, sp) if sp > 1 else fit * sms
            elif sp > 1 and have < tiles:
                continue
            else:
                cap = max(1, have)
            rank = (ceil_div(tiles, cap) * (ceil_div(cps, kw) + cuda_fp4.SMALL_FIXED_CHUNKS), -rw, sp)
            if best is None or rank < best[0]:
                best = (rank, (rw, sp, cps))
    return None if best is None else best[1]


def assert_fits(p, count):
    assert p.splits == 1 or count(p.key, p.splits, p.smem_bytes) is None or \
        count(p.key, p.splits, p.smem_bytes) >= p.tiles_all, p


factors = st.lists(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 0.8, 0.93, 1.0, 1.5])), min_size=8, max_size=8)


@settings(max_examples=150, deadline=None)
@given(m=st.integers(1, 128), n=st.integers(1, 600).map(lambda x: 8 * x), k=st.integers(1, 160).map(lambda x: 128 * x),
       gpcs=st.lists(st.integers(2, 20), min_size=1, max_size=9), per_size=factors)
def test_driver_plan_fits_the_count_and_is_the_models_best_among_fitting(m, n, k, gpcs, per_size):
    count = layered_count(gpcs, per_size)
    p = cuda_fp4.plan_small_fitted(m, n, k, 1, True, False, False, count, num_sms=132, forced=(None,) * 5)
    want = best_fitting(m, n, k, count)
    if p is None:
        assert want is None
        return
    assert_fits(p, count)
    assert (p.key.rw, p.splits, p.chunks_per_split) == want
    assert p.splits * p.chunks_per_split >= k // 128 > (p.splits - 1) * p.chunks_per_split
    assert p.row_blocks * p.key.rows >= n and p.m_blocks * p.key.tokens >= m
    # the key is the one the model planner would build for that (rw, splits): same slots / build
    assert p.key == cuda_fp4._plan_small(m, n, k, 1, True, False, False, 132, None, 8,
                                         (p.key.rw, p.splits, None, None, None)).key


def test_driver_plan_with_the_models_own_counts_is_the_model_plan_where_that_fits():
    """Where the driver agrees with the GPC model (and the model's plan is one wave), the two plans agree."""
    def model_count(key, size, smem):
        fit = min(key.minb, cuda_fp4.SM_SMEM // (smem + 1024))
        return cuda_fp4.cluster_capacity(132, fit, size) if size > 1 else fit * 132

    for m, (n, k) in itertools.product((1, 8, 16, 64), ((7168, 2048), (2112, 7168), (4096, 7168))):
        a = cuda_fp4.plan_small(m, n, k, 1, True, False, False, num_sms=132)
        b = cuda_fp4.plan_small_fitted(m, n, k, 1, True, False, False, model_count, num_sms=132, forced=(None,) * 5)
        if a is not None and (a.splits == 1 or model_count(a.key, a.splits, a.smem_bytes) >= a.tiles_all):
            assert a == b, (m, n, k)


def test_driver_plan_beats_stepping_down_on_the_round_s_layout(monkeypatch):
    """Session 28's ncu case (24-warp build, M = 1, 4096 x 7168): with a driver that holds 69 five-CTA clusters
    the launch's step-down ends at 2 splits of 2 x 4 warps (256 CTAs, as the round measured); the driver-count
    plan keeps more splits and CTAs, fits, and costs less by the same model."""
    count = layered_count(H200_LIKE)
    assert 3 * sum(g // 5 for g in H200_LIKE) == 69
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_MINB", "3")
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_SLOTS", "3")

    def replan(most=None):
        return cuda_fp4.plan_small(1, 4096, 7168, 1, True, False, False, num_sms=132, max_splits=most)

    model = replan()
    monkeypatch.setattr(cuda_fp4, "_max_active_clusters", lambda key, size, dev, smem: count(key, size, smem))
    stepped = cuda_fp4._fit_clusters(model, torch.device("cpu"), replan)
    fitted = cuda_fp4.plan_small_fitted(1, 4096, 7168, 1, True, False, False, count, num_sms=132)
    assert (model.splits, stepped.splits, stepped.key.rw, stepped.row_blocks * stepped.splits) == (6, 2, 2, 256)
    assert_fits(fitted, count)

    def cost(p):
        cap = count(p.key, p.splits, p.smem_bytes)
        return ceil_div(p.tiles_all, cap) * (ceil_div(p.chunks_per_split, p.key.kw) + cuda_fp4.SMALL_FIXED_CHUNKS)

    assert cost(fitted) < cost(stepped) and fitted.row_blocks * fitted.splits > 256
    assert fitted.splits > 2


def test_small_fit_knob(monkeypatch):
    assert cuda_fp4.small_fit() == "model"
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_FIT", "driver")
    assert cuda_fp4.small_fit() == "driver"
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_FIT", "gpc")
    with pytest.raises(deepgemm.validate.ArgumentError, match="DEEPGEMM_FP4_SMALL_FIT.*'gpc'"):
        cuda_fp4.small_fit()


def test_candidate_keys_cover_every_driver_plan():
    """The kernels the warm-up and the compile-only tests build (small_candidate_keys) include whatever key the
    driver planner can pick, whatever the counts."""
    for m, (n, k) in itertools.product((1, 16, 64, 128), ((7168, 2048), (2112, 7168), (4096, 7168))):
        keys = cuda_fp4.small_candidate_keys(m, n, k, 1, True, False, False)
        for per_size in ([1.0] * 8, [1.0, 1.0, 0.5, 0.5, 0.3, 0.3, 0.2, 0.1], [None] * 8, [1.0] + [0.0] * 7):
            p = cuda_fp4.plan_small_fitted(m, n, k, 1, True, False, False, layered_count(H200_LIKE, per_size),
                                           num_sms=132, forced=(None,) * 5)
            assert p is None or p.key in keys


def test_driver_path_launches_the_fitted_plan_cpu(monkeypatch):
    """bf16_fp4_gemm_nt under DEEPGEMM_FP4_SMALL_FIT=driver (kernel and GPU check stubbed, the count mocked): the
    launch is the driver-count plan, asked once per (shape, device) and not stepped down."""
    launches = []

    class Stub:
        def launch(self, grid, threads, args, smem_bytes=0, cluster=None):
            launches.append((grid, threads, args, smem_bytes, cluster))

    monkeypatch.setattr(cuda_fp4, "_kernel", lambda key: Stub())
    count = layered_count(H200_LIKE, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    asked = []
    monkeypatch.setattr(cuda_fp4, "_max_active_clusters",
                        lambda key, size, dev, smem: asked.append(size) or count(key, size, smem))
    monkeypatch.setattr(cuda_fp4, "_check", lambda *args: None)
    monkeypatch.setattr(cuda_fp4, "get_num_sms", lambda: 132)
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_FIT", "driver")
    cuda_fp4._plan_small_driver.cache_clear()
    m, n, k = 1, 2112, 7168
    g = torch.Generator().manual_seed(0)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16)
    packed, sf = deepgemm.cast_weights_to_fp4(torch.randn((n, k), generator=g) * 0.05, gran_k=32)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    cuda_fp4.dense(a, None, packed, sf, 32, d, None)
    want = cuda_fp4.plan_small_fitted(m, n, k, 1, True, False, False, count, num_sms=132)
    (grid, threads, args, smem, cluster), = launches
    assert (grid, threads, smem, cluster) == (want.grid, want.key.threads, want.smem_bytes, want.cluster)
    assert args[-2:] == [want.m_blocks, want.chunks_per_split]
    n_asked = len(asked)
    cuda_fp4.dense(a, None, packed, sf, 32, d, None)
    assert len(launches) == 2 and launches[1][0] == want.grid
    assert len(asked) <= n_asked + 1  # the plan is memoized (the launch's own residency check may ask once)
    cuda_fp4._plan_small_driver.cache_clear()


def test_max_active_clusters_asks_tilehal_and_says_none_on_failure(monkeypatch):
    """The count comes from tilehal's Kernel.max_active_clusters (threads, dynamic shared memory, a (1, size, 1)
    cluster on that device); a driver error leaves None (the GPC model's figure stands)."""
    calls = []

    class Kern:
        def max_active_clusters(self, block, smem_bytes, cluster, device_index=None):
            calls.append((block, smem_bytes, cluster, device_index))
            if smem_bytes > 200 * 1024:
                raise deepgemm.validate.ArgumentError("no")
            return 42

    monkeypatch.setattr(cuda_fp4, "_kernel", lambda key: Kern())
    cuda_fp4._max_active_clusters_from.cache_clear()
    key = cuda_fp4.plan_small(1, 4096, 7168, 1, True, False, False, num_sms=132).key
    assert cuda_fp4._max_active_clusters(key, 5, 0, 4096) == 42
    assert calls == [(key.threads, 4096, (1, 5, 1), 0)]
    assert cuda_fp4._max_active_clusters(key, 5, 0, 4096) == 42 and len(calls) == 1  # memoized
    assert cuda_fp4._max_active_clusters(key, 3, 0, 210 * 1024) is None
    cuda_fp4._max_active_clusters_from.cache_clear()


# ----------------------------------------------------------------------------- GPU (next session's round)
FIT_SHAPES = [(1, 4096, 7168), (1, 2112, 7168), (1, 7168, 2048), (8, 4096, 7168), (16, 4096, 7168), (64, 2112, 7168),
              (3, 200, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", FIT_SHAPES)
def test_gpu_small_driver_fit_matches_reference(m, n, k, monkeypatch):
    """DEEPGEMM_FP4_SMALL_FIT=driver: the plan fits the real driver's count, and its kernel gives the float64
    reference (computed on the GPU): fp32 out within 1e-4 of max |D|, bf16 out calc_diff < 1e-4."""
    monkeypatch.setenv("DEEPGEMM_FP4_KERNEL", "small")
    monkeypatch.setenv("DEEPGEMM_FP4_SMALL_FIT", "driver")
    dev = torch.cuda.current_device()
    for out_bf16 in (False, True):
        p = cuda_fp4._plan_small_driver(m, n, k, 1, out_bf16, False, False, None, dev, cuda_fp4._small_forced(), None)
        if p is not None:
            have = cuda_fp4._max_active_clusters(p.key, p.splits, dev, p.smem_bytes)
            assert p.splits == 1 or have is None or have >= p.tiles_all, (p, have)
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16).cuda()
    w = torch.randn((n, k), generator=g).cuda() * 0.05
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32)
    ref = fp4.reference(a, None, packed, sf, 32).double()
    d32 = torch.empty(m, n, device="cuda")
    deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d32)
    assert float((d32.double() - ref).abs().max() / ref.abs().max()) < 1e-4
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)
    assert deepgemm.testing.calc_diff(d.float(), ref.float()) < 1e-4
