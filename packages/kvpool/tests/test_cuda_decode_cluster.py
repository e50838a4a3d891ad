"""The split merge over distributed shared memory (KVPOOL_DECODE_COMBINE=cluster): compile-only checks and the
host's choice here (CI); on a GPU the combine launch's output bit for bit, dense and sparse, and the reference."""

import kvpool
import pytest
import tilehal
import torch
from kvpool import cuda_decode as cd

MMA3, MMA2 = cd.KernelConfig("mma", 64, 3), cd.KernelConfig("mma", 64, 2)


def _have_nvrtc() -> bool:
    return tilehal.compiler_versions()["nvrtc"] is not None


def test_cluster_combine_env(monkeypatch):
    monkeypatch.delenv("KVPOOL_DECODE_COMBINE", raising=False)
    assert cd.combine_variant() == cd.DEFAULT_COMBINE
    monkeypatch.setattr(cd, "SPARSE_COMBINE", "cluster")  # sparse calls only
    assert cd.combine_variant(sparse=True) == "cluster" and cd.combine_variant() == cd.DEFAULT_COMBINE
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "ticket")  # the variable wins for both
    assert cd.combine_variant(sparse=True) == "ticket" == cd.combine_variant()
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "cluster")
    assert cd.combine_variant() == "cluster"
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "clusters")
    with pytest.raises(ValueError, match="KVPOOL_DECODE_COMBINE"):
        cd.combine_variant()


@pytest.mark.skipif(not _have_nvrtc(), reason="needs NVRTC")
@pytest.mark.parametrize("cfg", [MMA3, MMA2], ids=["mma_x3", "mma_x2"])
@pytest.mark.parametrize("dtype,head_dim,group", [(torch.bfloat16, 128, 4), (torch.float16, 64, 1),
                                                  (torch.bfloat16, 256, 2), (torch.bfloat16, 128, 8)])
def test_cluster_build_compiles(cfg, dtype, head_dim, group):
    """The -DKVPOOL_CLUSTER_MERGE build has the same kernels (its merge buffers fit the stages: a static_assert)
    and is another binary than the default build."""
    plain = cd.compile_decode(dtype, head_dim, group, cfg=cfg)
    cm = cd.compile_decode(dtype, head_dim, group, cfg=cfg, cluster_merge=True)
    assert set(cm.lowered_names) == set(plain.lowered_names) and cm.cubin != plain.cubin
    assert cm.name.endswith("_cm") and len(cm.cubin) > 1000


class _FakeModule:
    def __init__(self, cm):
        self.cm = cm

    def get_kernel(self, name):
        return name


@pytest.mark.parametrize("cfg,block_size,splits,want", [(MMA3, 16, 4, True), (MMA3, 16, 2, True), (MMA3, 16, 8, True),
                                                        (MMA3, 16, 1, False), (MMA3, 16, 9, False),
                                                        (cd.KernelConfig(), 16, 4, False), (MMA3, 12, 4, False)])
def test_cluster_merge_only_where_it_applies(cfg, block_size, splits, want, monkeypatch):
    """Clusters of 2..8 split CTAs of the mma kernel (simt, one split or more than the portable cluster size: the
    combine launch, said at DEBUG)."""
    seen = []
    monkeypatch.setattr(cd, "compile_decode", lambda *a, **k: seen.append(k.get("cluster_merge")) or _FakeModule(0))
    cd._launch_plan.cache_clear()
    try:
        plan = cd._launch_plan(torch.bfloat16, 128, 4, cfg, block_size, 8, 8, 64, 0, splits, 4, False, True)
    finally:
        cd._launch_plan.cache_clear()
    assert plan[6] is want and seen == [want] and plan[3] == splits


# ----------------------------------------------------------------------------- GPU
def _case(lens, kv_heads, q_heads, head_dim, dtype, seed, gpu_pool):
    pool = gpu_pool(lens, heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=seed)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(len(lens), q_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    bi = torch.full((len(lens), kv_heads, 64), -1, dtype=torch.int32, device="cuda")
    for i, L in enumerate(lens):
        nb = -(-L // 16)
        for h in range(kv_heads):
            k = min(nb, 64)
            bi[i, h, :k] = torch.randperm(nb, device="cuda", generator=g)[:k].int()
    bi[0, 0, 3] = -1  # a hole
    return pool, bt, sl, q, bi, g


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads", [(torch.bfloat16, 128, 32, 8), (torch.float16, 64, 8, 8),
                                                              (torch.bfloat16, 256, 4, 2), (torch.bfloat16, 128, 8, 1)])
def test_cluster_merge_equals_combine_launch(splits, dtype, head_dim, q_heads, kv_heads, monkeypatch, gpu_pool):
    """Dense and sparse (holes, -1 padding past short sequences, an empty sequence), every split count up to 8:
    the combine launch's output bit for bit (same arithmetic and order), within the reference's bound."""
    pool, bt, sl, q, bi, g = _case([2000, 513, 64, 0, 17, 1], kv_heads, q_heads, head_dim, dtype, splits, gpu_pool)
    for cfg in (MMA3, MMA2):
        for idx in (None, bi):
            monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "launch")
            want = cd.paged_decode_cuda(q, pool, 0, bt, sl, None, idx, num_splits=splits, config=cfg)
            monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "cluster")
            for _ in range(2):
                got = cd.paged_decode_cuda(q, pool, 0, bt, sl, None, idx, num_splits=splits, config=cfg)
                assert torch.equal(got, want), (cfg, idx is None, (got.float() - want.float()).abs().max())
            ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=idx)
            assert tilehal.calc_diff(got, ref) < 1e-5
            assert torch.all(got[3] == 0)


@pytest.mark.gpu
def test_cluster_merge_default_splits_and_graph(monkeypatch, gpu_pool):
    """Through kvpool.paged_decode with the split count the host picks, and under CUDA-graph replay with new q
    and selections: the combine launch's output."""
    pool, bt, sl, q, bi, g = _case([2000, 513, 64, 0, 1], 8, 32, 128, torch.bfloat16, 7, gpu_pool)
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "cluster")
    static_q, static_bi = q.clone(), bi.clone()
    kvpool.paged_decode(static_q, pool, 0, bt, sl, block_indices=static_bi)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kvpool.paged_decode(static_q, pool, 0, bt, sl, block_indices=static_bi)
    for _ in range(3):
        static_q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g))
        static_bi.copy_(bi[:, torch.randperm(8, device="cuda", generator=g)])  # other kv heads' selections
        graph.replay()
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "launch")
        want = kvpool.paged_decode(static_q, pool, 0, bt, sl, block_indices=static_bi)
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "cluster")
        assert torch.equal(out, want)
        dense = kvpool.paged_decode(static_q, pool, 0, bt, sl)
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "launch")
        assert torch.equal(dense, kvpool.paged_decode(static_q, pool, 0, bt, sl))
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "cluster")
