"""Programmatic dependent launch of the sparse decode (TILESTACK_PDL=1): compile-only checks here (CI), and on a
GPU the PDL launches against the plain ones and the torch reference, behind a kernel that writes their inputs
(eager and in a CUDA graph: the griddepcontrol.wait must order the read after that kernel)."""

import kvpool
import pytest
import tilehal
import torch
from kvpool import cuda_decode as cd

MMA3 = cd.KernelConfig("mma", 64, 3)


def _have_nvrtc() -> bool:
    return tilehal.compiler_versions()["nvrtc"] is not None


def test_pdl_env(monkeypatch):
    monkeypatch.delenv("TILESTACK_PDL", raising=False)
    assert tilehal.pdl_requested() is False
    monkeypatch.setenv("TILESTACK_PDL", "1")
    assert tilehal.pdl_requested() is True
    monkeypatch.setenv("TILESTACK_PDL", "yes")
    with pytest.raises(ValueError, match="TILESTACK_PDL"):
        tilehal.pdl_requested()


@pytest.mark.skipif(not _have_nvrtc(), reason="needs NVRTC")
@pytest.mark.parametrize("cfg", [MMA3, cd.KernelConfig("mma", 64, 2)], ids=["mma_x3", "mma_x2"])
@pytest.mark.parametrize("dtype,head_dim,group", [(torch.bfloat16, 128, 4), (torch.float16, 64, 1),
                                                  (torch.bfloat16, 256, 2)])
def test_pdl_build_compiles(cfg, dtype, head_dim, group):
    """The -DKVPOOL_PDL build (mma kernel + combine) compiles for sm_90a with the same kernels, and is a
    different binary from the default build (whose source has no griddepcontrol)."""
    plain = cd.compile_decode(dtype, head_dim, group, cfg=cfg)
    pdl = cd.compile_decode(dtype, head_dim, group, cfg=cfg, pdl=True)
    assert set(pdl.lowered_names) == set(cd.kernel_names(dtype, head_dim, group, cfg)) == set(plain.lowered_names)
    assert len(pdl.cubin) > 1000 and pdl.cubin != plain.cubin and pdl.name.endswith("_pdl")


def test_pdl_only_for_sparse_mma_launches(monkeypatch):
    """The launch plan takes PDL only for the mma kernel (simt builds have no wait) and only when asked."""
    monkeypatch.setattr(cd, "compile_decode", lambda *a, **k: _FakeModule(k.get("pdl", False)))
    cd._launch_plan.cache_clear()
    try:
        assert cd._launch_plan(torch.bfloat16, 128, 4, MMA3, 16, 8, 8, 64, 0, 4, 4, True)[5] is True
        assert cd._launch_plan(torch.bfloat16, 128, 4, MMA3, 16, 8, 8, 64, 0, 4, 4, False)[5] is False
        assert cd._launch_plan(torch.bfloat16, 128, 4, cd.KernelConfig(), 16, 8, 8, 64, 0, 4, 4, True)[5] is False
        assert cd._launch_plan(torch.bfloat16, 128, 4, MMA3, 12, 8, 8, 64, 0, 4, 4, True)[5] is False  # -> simt
    finally:
        cd._launch_plan.cache_clear()


class _FakeModule:
    def __init__(self, pdl):
        self.pdl = pdl

    def get_kernel(self, name):
        return (name, self.pdl)


# ----------------------------------------------------------------------------- GPU
def _selection(lens, block_size, n, kv_heads, g):
    bi = torch.full((len(lens), kv_heads, n), -1, dtype=torch.int32, device="cuda")
    for i, L in enumerate(lens):
        nb = -(-L // block_size)
        for h in range(kv_heads):
            k = min(nb, n)
            bi[i, h, :k] = torch.randperm(nb, device="cuda", generator=g)[:k].int()
    return bi


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["launch", "ticket"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_pdl_sparse_decode_equals_plain(combine, splits, monkeypatch, gpu_pool):
    """Each PDL launch, right behind a kernel that writes q and the selection: the plain launch's output bit
    for bit (same kernel code after the wait), and the float32 reference within the mma kernel's bound."""
    lens = [2000, 513, 64, 0, 17, 1]
    pool = gpu_pool(lens, seed=3)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    g = torch.Generator(device="cuda").manual_seed(5)
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", combine)
    for rep in range(3):
        q_src = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        bi_src = _selection(lens, 16, 64, 8, g)
        monkeypatch.delenv("TILESTACK_PDL", raising=False)
        want = cd.paged_decode_cuda(q_src, pool, 0, bt, sl, None, bi_src, num_splits=splits)
        monkeypatch.setenv("TILESTACK_PDL", "1")
        q, bi = torch.empty_like(q_src), torch.empty_like(bi_src)
        torch.cuda.synchronize()
        torch.mul(q_src, 1, out=q)  # kernels writing the decode's inputs just before it
        torch.add(bi_src, 0, out=bi)
        got = cd.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, num_splits=splits)
        assert torch.equal(got, want), (rep, (got.float() - want.float()).abs().max())
        ref = kvpool.paged_decode_reference(q_src, pool, 0, bt, sl, block_indices=bi_src)
        assert tilehal.calc_diff(got, ref) < 1e-5
        assert torch.all(got[3] == 0)


@pytest.mark.gpu
def test_pdl_sparse_decode_in_a_cuda_graph(monkeypatch, gpu_pool):
    """Captured behind the kernels that write its inputs (a programmatic edge in the graph): each replay
    with new q and selections gives the plain eager launch's output."""
    lens = [2000, 513, 64, 0, 1]
    pool = gpu_pool(lens, seed=4)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    g = torch.Generator(device="cuda").manual_seed(9)
    q_src = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    bi_src = _selection(lens, 16, 64, 8, g)
    q, bi = torch.empty_like(q_src), torch.empty_like(bi_src)
    monkeypatch.setenv("TILESTACK_PDL", "1")

    def chain():
        torch.mul(q_src, 1, out=q)
        torch.add(bi_src, 0, out=bi)
        return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        q_src.copy_(torch.randn(q_src.shape, device="cuda", dtype=q_src.dtype, generator=g))
        bi_src.copy_(_selection(lens, 16, 64, 8, g))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.delenv("TILESTACK_PDL")
        want = kvpool.paged_decode(q_src, pool, 0, bt, sl, block_indices=bi_src)
        monkeypatch.setenv("TILESTACK_PDL", "1")
        assert torch.equal(out, want)
