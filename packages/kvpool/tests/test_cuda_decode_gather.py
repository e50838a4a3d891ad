"""The sparse gather decode kernel (paged_decode_gather.cuh, KVPOOL_DECODE_SPARSE=gather...): its host
logic and compile-only checks here (CI), numerics vs the torch reference on a GPU."""

import math

import kvpool
import pytest
import tilehal
import torch
from kvpool import cuda_decode as cd

GATHERS = [cd.GatherConfig(2, "ticket"), cd.GatherConfig(1, "ticket"), cd.GatherConfig(2, "launch")]
GATHER_IDS = ["bpw2_ticket", "bpw1_ticket", "bpw2_launch"]
# bf16 rounding of P relative to a partition-dependent running max (as the mma kernel, FlashAttention):
# calc_diff vs the float32 reference stays below this; the dense mma test holds the same bound.
TOL = 1e-5


def _have_nvrtc() -> bool:
    return tilehal.compiler_versions()["nvrtc"] is not None


def test_sparse_env_parsing_and_precedence(monkeypatch):
    assert cd.GatherConfig.parse(None) is None and cd.GatherConfig.parse("") is None
    assert cd.GatherConfig.parse("mma") is None
    assert cd.GatherConfig.parse("gather") == cd.GatherConfig(2, "ticket")
    assert cd.GatherConfig.parse("gather:1") == cd.GatherConfig(1, "ticket")
    assert cd.GatherConfig.parse("gather:2:launch") == cd.GatherConfig(2, "launch")
    for bad in ("gather:3", "gather:0", "gather:2:fused", "gather:2:ticket:x", "gathr", "simt"):
        with pytest.raises(ValueError, match="KVPOOL_DECODE_SPARSE"):
            cd.GatherConfig.parse(bad)
    monkeypatch.delenv("KVPOOL_DECODE_SPARSE", raising=False)
    monkeypatch.delenv("KVPOOL_DECODE_KERNEL", raising=False)
    assert cd.sparse_config() is cd.SPARSE_CONFIG
    monkeypatch.setattr(cd, "SPARSE_CONFIG", cd.GatherConfig(1, "launch"))
    assert cd.sparse_config() == cd.GatherConfig(1, "launch")
    monkeypatch.setenv("KVPOOL_DECODE_KERNEL", "simt")  # the dense kernels' variable: SPARSE_CONFIG steps aside
    assert cd.sparse_config() is None
    monkeypatch.setenv("KVPOOL_DECODE_SPARSE", "gather:2")  # the sparse variable wins for sparse calls
    assert cd.sparse_config() == cd.GatherConfig(2, "ticket")
    monkeypatch.setenv("KVPOOL_DECODE_SPARSE", "mma")
    assert cd.sparse_config() is None


def test_gather_splits_one_round_per_cta():
    # issue 15's step: 64 blocks of 16 tokens = 64 steps; 4 warps x BPW steps a CTA
    assert cd.gather_splits(64, 16, 2) == 8 and cd.gather_splits(64, 16, 1) == 16
    assert cd.gather_splits(0, 16, 2) == 1 and cd.gather_splits(1, 16, 2) == 1
    assert cd.gather_splits(9, 16, 1) == 3  # odd: 9 steps, 4 a CTA
    assert cd.gather_splits(5, 8, 2) == 1  # 40 tokens = 3 steps (the last one partial)
    assert cd.gather_splits(100_000, 16, 2) == cd.GATHER_MAX_SPLITS  # then each CTA loops over rounds
    for items in range(0, 300, 7):
        for bs in (8, 16, 32, 64):  # block sizes that tile a round (4 x bpw steps of 16 tokens) exactly
            for bpw in (1, 2):
                s = cd.gather_splits(items, bs, bpw)
                per_split = math.ceil(items / s)
                per_split_steps = math.ceil(per_split * bs / 16)
                assert 1 <= s <= cd.GATHER_MAX_SPLITS
                if s < cd.GATHER_MAX_SPLITS:  # one round per CTA, and no CTA left without work
                    assert per_split_steps <= 4 * bpw and (s - 1) * per_split < max(items, 1)


def _kernel_token_cover(items: int, block_size: int, bpw: int, splits: int) -> list[tuple[int, int]]:
    """The (item, offset) pairs the gather kernel's CTAs read, in the kernel's own index arithmetic
    (split_range, then rounds of 4 warps x bpw steps of 16 tokens, one token per lane): a mirror of
    paged_decode_gather.cuh's loops, checked below for exact coverage."""
    per_split = -(-items // splits)
    seen = []
    for split in range(splits):
        begin = split * per_split
        n_items = max(0, min(items, begin + per_split) - begin)
        num_steps = -(-n_items * block_size // 16)
        rounds = -(-num_steps // (4 * bpw))
        for r in range(rounds):
            for warp in range(4):
                step0 = (r * 4 + warp) * bpw
                for lane in range(bpw * 16):
                    if step0 + lane // 16 >= num_steps:  # the kernel skips the math of such steps
                        continue
                    t = step0 * 16 + lane
                    i, off = divmod(t, block_size)
                    if i < n_items:  # gather_row: past the share -> -1
                        seen.append((begin + i, off))
    return seen


def test_gather_rounds_cover_every_selected_token_once():
    for items in (0, 1, 7, 13, 64, 65, 200):
        for bs in (1, 8, 12, 16, 48, 64):
            for bpw in (1, 2):
                for splits in {cd.gather_splits(items, bs, bpw), 1, 3}:
                    seen = _kernel_token_cover(items, bs, bpw, splits)
                    assert sorted(seen) == [(i, o) for i in range(items) for o in range(bs)], (items, bs, bpw, splits)


def test_gather_smem_and_bpw():
    assert cd.gather_smem_bytes(torch.bfloat16, 128, 2) == 64 * 1024
    assert cd.gather_smem_bytes(torch.float16, 128, 1) == 32 * 1024
    assert 3 * (cd.gather_smem_bytes(torch.bfloat16, 128, 2) + 1024) <= 228 * 1024  # 3 CTAs per SM
    assert cd.gather_bpw(256, 2) == 1 and cd.gather_bpw(128, 2) == 2 and cd.gather_bpw(64, 1) == 1


def _exprs():
    return [cd.gather_kernel_names(dt, d, g, cd.gather_bpw(d, bpw))[0] for dt in (torch.bfloat16, torch.float16)
            for d, g in ((64, 1), (128, 4), (128, 8), (256, 2)) for bpw in (1, 2)]


@pytest.mark.skipif(not _have_nvrtc(), reason="needs NVRTC")
def test_gather_kernels_compile_without_spills():
    """sm_90a, every (dtype, head_dim, group, bpw) the host may pick: present, and (when this run compiled
    it: a cache hit has no ptxas report) 0 bytes of spill stores. The host's constants are asserted."""
    exprs = sorted(set(_exprs()))
    checks = "".join(cd._asserts([("kvpool::kThreads", cd.THREADS), ("kvpool::kGatherWarps", cd.GATHER_WARPS),
                                  ("kvpool::kGatherStepTokens", cd.GATHER_STEP)]))
    m = tilehal.compile_cuda('#include "paged_decode_gather.cuh"\n' + checks, arch="sm_90a",
                             name="paged_decode_gather_all", include_dirs=[str(cd.KERNEL_DIR)],
                             options=["--use_fast_math", "--ptxas-options=-v"], name_expressions=exprs)
    assert set(exprs) <= set(m.lowered_names)
    if not m.cache_hit:
        spills = [line for line in m.log.splitlines() if "spill stores" in line]
        assert m.log.count("Compiling entry") == len(exprs) and len(spills) >= len(exprs), m.log
        assert all("0 bytes spill stores" in line for line in spills), m.log


@pytest.mark.skipif(not _have_nvrtc(), reason="needs NVRTC")
def test_gather_module_and_mirrored_constants(monkeypatch):
    m = cd.compile_gather(torch.bfloat16, 128, 4, 2)
    assert set(m.lowered_names) == set(cd.gather_kernel_names(torch.bfloat16, 128, 4, 2))
    monkeypatch.setattr(cd, "GATHER_STEP", 32)  # a drifted copy fails to build
    with pytest.raises(tilehal.CompileError, match="static assert"):
        cd.compile_gather.__wrapped__(torch.bfloat16, 64, 1, 1)


# ----------------------------------------------------------------------------- GPU
def _selection(lens, block_size, n, kv_heads, per_head, g):
    """n selected logical blocks per (sequence[, kv head]), random, -1 padded where the sequence has fewer
    (top_k > available; an empty sequence: all -1)."""
    shape = (len(lens), kv_heads, n) if per_head else (len(lens), 1, n)
    bi = torch.full(shape, -1, dtype=torch.int32, device="cuda")
    for i, L in enumerate(lens):
        nb = -(-L // block_size)
        for h in range(shape[1]):
            k = min(nb, n)
            bi[i, h, :k] = torch.randperm(nb, device="cuda", generator=g)[:k].int()
    return bi if per_head else bi[:, 0].contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("gcfg", GATHERS, ids=GATHER_IDS)
@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads", [(torch.bfloat16, 128, 32, 8), (torch.float16, 128, 32, 8),
                                                              (torch.bfloat16, 64, 8, 8), (torch.float16, 256, 4, 2),
                                                              (torch.bfloat16, 128, 8, 1)])
@pytest.mark.parametrize("n", [64, 13, 1])
def test_gather_matches_reference(gcfg, dtype, head_dim, q_heads, kv_heads, n, gpu_pool):
    """Random selections (odd counts, -1 padded past a short sequence, an empty sequence), per kv head and
    shared, vs the float32 reference."""
    lens = [2000, 513, 64, 0, 17, 1]
    pool = gpu_pool(lens, heads=kv_heads, head_dim=head_dim, dtype=dtype)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(len(lens), q_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    for per_head in (True, False):
        bi = _selection(lens, 16, n, kv_heads, per_head, g)
        out = cd.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, config=gcfg)
        ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=bi)
        assert tilehal.calc_diff(out, ref) < TOL, (per_head, tilehal.calc_diff(out, ref))
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.all(out[3] == 0)  # the empty sequence: nothing to attend to, zeros (as the reference)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 12, 32, 64])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gather_block_sizes_holes_and_split_counts(block_size, splits, gpu_pool):
    """Any block size (12: a step spans blocks; 8: two blocks a step), explicit split counts (1: each CTA
    loops over several rounds), holes in the selection (-1 mid-list) and all -1 rows."""
    lens = [700, 37, 1, 0]
    pool = gpu_pool(lens, heads=2, head_dim=64, block_size=block_size, seed=block_size)
    bt, sl = pool.block_table([0, 1, 2, 3]), pool.seq_lens([0, 1, 2, 3])
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    bi = _selection(lens, block_size, 21, 2, True, g)
    bi[0, 0, 5] = -1
    bi[0, 1] = -1  # a (sequence, kv head) with nothing selected
    for gcfg in GATHERS:
        out = cd.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, num_splits=splits, config=gcfg)
        ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=bi)
        assert tilehal.calc_diff(out, ref) < TOL, (gcfg, tilehal.calc_diff(out, ref))
        assert torch.all(out[0, 4:8] == 0) and torch.all(out[3] == 0)


@pytest.mark.gpu
def test_gather_every_block_equals_dense_and_env_routes_paged_decode(monkeypatch, gpu_pool):
    """Selecting every block gives the dense kernel's output (same math, other partition); through
    kvpool.paged_decode, KVPOOL_DECODE_SPARSE routes sparse calls to the gather kernel."""
    lens = [2000, 513, 64]
    pool = gpu_pool(lens, seed=1)
    bt, sl = pool.block_table([0, 1, 2]), pool.seq_lens([0, 1, 2])
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    full = torch.arange(bt.shape[1], device="cuda", dtype=torch.int32).expand(3, -1).contiguous()
    monkeypatch.delenv("KVPOOL_DECODE_SPARSE", raising=False)
    dense = kvpool.paged_decode(q, pool, 0, bt, sl)
    want = kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=full)
    monkeypatch.setenv("KVPOOL_DECODE_SPARSE", "gather")
    got = kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=full)
    assert torch.equal(got, cd.paged_decode_cuda(q, pool, 0, bt, sl, None, full, config=cd.GatherConfig()))
    assert tilehal.calc_diff(got, dense) < TOL and tilehal.calc_diff(got, want) < TOL
    torch.testing.assert_close(got, dense, atol=1e-3, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("bpw", [1, 2])
def test_gather_ticket_equals_launch_and_graph_replay(bpw, gpu_pool):
    """The in-kernel merge (last split CTA, tickets) gives the combine launch's output bit for bit, call
    after call (tickets re-arm) and under CUDA-graph replay with new q and new selections."""
    lens = [2000, 513, 64, 0, 1]
    pool = gpu_pool(lens, seed=2)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    bi = _selection(lens, 16, 64, 8, True, g)
    ticket, launch = cd.GatherConfig(bpw, "ticket"), cd.GatherConfig(bpw, "launch")
    want = cd.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, config=launch)
    for _ in range(3):
        assert torch.equal(cd.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, config=ticket), want)
    static_q, static_bi = q.clone(), bi.clone()
    outs = {}
    for name, cfg in (("ticket", ticket), ("launch", launch)):
        cd.paged_decode_cuda(static_q, pool, 0, bt, sl, None, static_bi, config=cfg)  # warm outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[name] = cd.paged_decode_cuda(static_q, pool, 0, bt, sl, None, static_bi, config=cfg)
        outs[name + "_graph"] = graph
    for _ in range(2):
        static_q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g))
        static_bi.copy_(_selection(lens, 16, 64, 8, True, g))
        for name in ("ticket", "launch"):
            outs[name + "_graph"].replay()
        ref = kvpool.paged_decode_reference(static_q, pool, 0, bt, sl, block_indices=static_bi)
        assert torch.equal(outs["ticket"], outs["launch"])
        assert tilehal.calc_diff(outs["ticket"], ref) < TOL
