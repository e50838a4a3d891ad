"""CUDA paged decode: compile-only checks here, numerics vs the torch reference on a GPU."""

import math

import kvpool
import pytest
import tilehal
import torch
from kvpool import cuda_decode


def _have_nvrtc() -> bool:
    return tilehal.compiler_versions()["nvrtc"] is not None or tilehal.compiler_versions()["nvcc"] is not None


CONFIGS = [cuda_decode.KernelConfig(), cuda_decode.KernelConfig("mma", 64, 2), cuda_decode.KernelConfig("mma", 64, 3)]
CONFIG_IDS = ["simt", "mma_x2", "mma_x3"]
GPU_CONFIGS, GPU_CONFIG_IDS = CONFIGS, CONFIG_IDS


def _same_math_tolerance(cfg) -> float:
    """calc_diff bound between two runs whose only difference is the split/warp partition.

    simt keeps probabilities in fp32, so a different partition changes only fp32 rounding; mma
    rounds them to the MMA input type (bf16/fp16) relative to the running max, which depends on
    the partition, as in FlashAttention.
    """
    return 1e-5 if cfg.variant == "mma" else 1e-6


@pytest.mark.skipif(not _have_nvrtc(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (128, 8), (256, 2)])
def test_kernels_compile(cfg, dtype, head_dim, group):
    module = cuda_decode.compile_decode(dtype, head_dim, group, cfg=cfg)
    assert len(module.cubin) > 1000
    assert set(module.lowered_names) == set(cuda_decode.kernel_names(dtype, head_dim, group, cfg))


@pytest.mark.skipif(not _have_nvrtc(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("name,value", [("MMA_MAX_ITEMS", 256), ("MMA_STEP", 32), ("TILE", 32)])
def test_mirrored_constants_are_checked_by_the_compiler(monkeypatch, name, value):
    # The host's copies of the kernels' constants are static_asserted in every compiled source:
    # a copy that drifts fails to build instead of launching a wrong grid or shared-memory size.
    cfg = cuda_decode.KernelConfig() if name == "TILE" else cuda_decode.KernelConfig("mma", 64, 2)
    monkeypatch.setattr(cuda_decode, name, value)
    checks = cuda_decode.kernel_checks(torch.bfloat16, 64, 1, cfg)
    assert f"== {value}" in checks
    with pytest.raises(tilehal.CompileError, match="static assert"):
        cuda_decode.compile_decode.__wrapped__(torch.bfloat16, 64, 1, cfg=cfg)


def test_kernel_config_parsing():
    assert cuda_decode.KernelConfig.parse(None) == cuda_decode.DEFAULT_CONFIG == cuda_decode.KernelConfig("mma", 64, 3)
    assert cuda_decode.KernelConfig.parse("simt") == cuda_decode.KernelConfig("simt", 64, 2)
    assert cuda_decode.KernelConfig.parse("mma") == cuda_decode.KernelConfig("mma", 64, 3)
    assert cuda_decode.KernelConfig.parse("mma:64:4") == cuda_decode.KernelConfig("mma", 64, 4)
    for bad in ("v4", "mma:32:3", "mma:64:1", "simt:64:2", "v2:32:4"):
        with pytest.raises(ValueError, match="KVPOOL_DECODE_KERNEL"):
            cuda_decode.KernelConfig.parse(bad)
    for old in ("v1", "v3", "v3:64:3"):  # the former history names: refused, with the new name
        with pytest.raises(ValueError, match="v1 is now 'simt', v3 is 'mma'"):
            cuda_decode.KernelConfig.parse(old)


def test_default_config_follows_env(monkeypatch):
    monkeypatch.setenv("KVPOOL_DECODE_KERNEL", "simt")
    assert cuda_decode.default_config() == cuda_decode.KernelConfig()
    monkeypatch.delenv("KVPOOL_DECODE_KERNEL")
    assert cuda_decode.default_config() == cuda_decode.DEFAULT_CONFIG


def test_mma_shared_memory_fits_two_ctas_per_sm():
    # 4 warps x 3 stages x (K + V) x 16 tokens x 256 B + the block list: two CTAs per H200 SM.
    smem = cuda_decode.smem_bytes(torch.bfloat16, 128, 4, cuda_decode.KernelConfig("mma", 64, 3))
    assert smem == 4 * 3 * 2 * 16 * 256 + 2 * 512 * 4
    assert 2 * (smem + 1024) <= 228 * 1024


def test_split_choice_fills_waves():
    # 64 sequences x 8 kv heads = 512 CTAs over 132 SMs x 3: one split leaves a 30 % wave.
    s = cuda_decode.choose_splits(64, 8, 4096, 132, 3)
    ctas = 64 * 8 * s
    assert ctas / (math.ceil(ctas / 396) * 396) > 0.85
    assert cuda_decode.choose_splits(8, 8, 32768, 132, 3) > 4  # long sequences: split-K
    assert cuda_decode.choose_splits(1, 1, 100, 132, 3) == 1  # too short to split
    # a sparse step's short rows (64 blocks x 16 tokens, b8 x 8 kv heads): 4 tiles per split allow
    # 4 splits (256 of 396 CTA slots), 2 tiles per split 6 (384)
    assert cuda_decode.choose_splits(8, 8, 1024, 132, 3) == 4
    assert cuda_decode.choose_splits(8, 8, 1024, 132, 3, min_tiles=2) == 6


def test_unsupported_reasons():
    pool = kvpool.KVPool(1, 2, 96, 4, dtype=torch.float32)
    assert "dtype" in cuda_decode.unsupported_reason(torch.zeros(1, 2, 96), pool)
    pool = kvpool.KVPool(1, 2, 96, 4, dtype=torch.bfloat16)
    assert "head_dim" in cuda_decode.unsupported_reason(torch.zeros(1, 2, 96, dtype=torch.bfloat16), pool)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=GPU_CONFIG_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(128, 32, 8), (64, 8, 8), (256, 4, 2), (128, 8, 1)])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_dense_matches_reference(cfg, dtype, head_dim, q_heads, kv_heads, splits, gpu_pool):
    lens = [1, 15, 16, 17, 300, 1000, 0]
    pool = gpu_pool(lens, heads=kv_heads, head_dim=head_dim, dtype=dtype)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(len(lens), q_heads, head_dim, device="cuda", dtype=dtype)
    out = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, num_splits=splits, config=cfg)
    ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl)
    assert tilehal.calc_diff(out, ref) < 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(out[-1] == 0)  # empty sequence
    # Table narrower than the sequences and holes (-1): masked like the reference, no OOB reads.
    narrow = bt[:, :3].clone()
    narrow[:, 1] = -1
    out = cuda_decode.paged_decode_cuda(q, pool, 0, narrow, sl, None, None, num_splits=splits, config=cfg)
    assert tilehal.calc_diff(out, kvpool.paged_decode_reference(q, pool, 0, narrow, sl)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=GPU_CONFIG_IDS)
@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_matches_reference_and_all_blocks_equal_dense(cfg, per_head, monkeypatch, gpu_pool):
    monkeypatch.setattr(cuda_decode, "default_config", lambda: cfg)
    lens = [2000, 513, 64]
    pool = gpu_pool(lens, seed=1)
    ids = [0, 1, 2]
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    n = 20
    shape = (3, 8, n) if per_head else (3, n)
    g = torch.Generator(device="cuda").manual_seed(3)
    bi = torch.full(shape, -1, dtype=torch.int32, device="cuda")
    for i, L in enumerate(lens):
        nb = -(-L // 16)
        k = min(nb, n - 3)
        if per_head:
            for h in range(8):
                bi[i, h, :k] = torch.randperm(nb, device="cuda", generator=g)[:k].int()
        else:
            bi[i, :k] = torch.randperm(nb, device="cuda", generator=g)[:k].int()
    out = kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi)
    ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=bi)
    assert tilehal.calc_diff(out, ref) < 1e-5
    full = torch.arange(bt.shape[1], device="cuda", dtype=torch.int32).expand(3, -1).contiguous()
    dense = kvpool.paged_decode(q, pool, 0, bt, sl)
    # Same math; only the split boundaries (per-sequence block count vs index-list width) differ.
    torch.testing.assert_close(kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=full), dense,
                               atol=1e-3, rtol=1e-2)
    assert tilehal.calc_diff(kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=full), dense) < _same_math_tolerance(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 32, 12])  # 12: not a power of two, mma hands over to simt
def test_mma_other_block_sizes(block_size, gpu_pool):
    pool = gpu_pool([300, 37, 1], heads=2, head_dim=64, block_size=block_size)
    bt, sl = pool.block_table([0, 1, 2]), pool.seq_lens([0, 1, 2])
    q = torch.randn(3, 8, 64, device="cuda", dtype=torch.bfloat16)
    out = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, config=cuda_decode.KernelConfig("mma", 64, 3))
    assert tilehal.calc_diff(out, kvpool.paged_decode_reference(q, pool, 0, bt, sl)) < 1e-5


@pytest.mark.gpu
def test_fp8_pool_on_gpu_uses_reference_within_tolerance():
    lens = [100, 37]
    pool8 = kvpool.KVPool(1, 2, 64, 32, block_size=16, dtype=torch.float8_e4m3fn, device="cuda")
    pool32 = kvpool.KVPool(1, 2, 64, 32, block_size=16, dtype=torch.float32, device="cuda")
    for p in (pool8, pool32):
        for i, L in enumerate(lens):
            p.add_sequence(i, list(range(L)), extra_key=i)
    for i, L in enumerate(lens):
        k, v = torch.randn(L, 2, 64, device="cuda"), torch.randn(L, 2, 64, device="cuda")
        for p in (pool8, pool32):
            p.write(0, p.append(i, L).cuda(), k, v)
    q = torch.randn(2, 4, 64, device="cuda")
    o8 = kvpool.paged_decode(q, pool8, 0, pool8.block_table([0, 1]), pool8.seq_lens([0, 1]))
    o32 = kvpool.paged_decode(q, pool32, 0, pool32.block_table([0, 1]), pool32.seq_lens([0, 1]))
    assert (o8 - o32).norm() / o32.norm() < 0.05


@pytest.mark.gpu
def test_host_tier_on_gpu_round_trip():
    """Offload on the side stream, bring back by prefix hit + prefetch, data intact."""
    pool = kvpool.KVPool(2, 2, 64, 8, block_size=16, dtype=torch.bfloat16, device="cuda", host_blocks=8,
                         watermark=0.0, debug=True)
    assert pool.storage.k.is_cuda and pool.host.tensors[0].is_pinned()
    prompt = list(range(65))
    pool.add_sequence("a", prompt)
    slots = pool.append("a", 65).cuda()
    kv = [(torch.randn(65, 2, 64, device="cuda"), torch.randn(65, 2, 64, device="cuda")) for _ in range(2)]
    for layer, (k, v) in enumerate(kv):
        pool.write(layer, slots, k, v)
    pool.free("a")
    assert pool.evict() == 4 and pool.stats().offloads == 4
    # Overwrite every device block so only the host copies hold the data.
    pool.add_sequence("junk", [7] * 128)
    s = pool.append("junk", 128).cuda()
    for layer in range(2):
        pool.write(layer, s, torch.zeros(128, 2, 64, device="cuda"), torch.zeros(128, 2, 64, device="cuda"))
    pool.free("junk")
    assert pool.add_sequence("b", prompt) == 64
    assert pool.stats().host_hit_tokens == 64
    assert pool.prefetch("b") == 4
    pool.append("b", 1)
    for layer, (k, v) in enumerate(kv):
        gk, gv = pool.gather(layer, "b")
        torch.testing.assert_close(gk[:64], k[:64].bfloat16(), atol=0, rtol=0)
        torch.testing.assert_close(gv[:64], v[:64].bfloat16(), atol=0, rtol=0)


def test_combine_variant_env(monkeypatch):
    monkeypatch.delenv("KVPOOL_DECODE_COMBINE", raising=False)
    assert cuda_decode.combine_variant() == cuda_decode.DEFAULT_COMBINE
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "ticket")
    assert cuda_decode.combine_variant() == "ticket"
    monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "fused")
    with pytest.raises(ValueError, match="KVPOOL_DECODE_COMBINE"):
        cuda_decode.combine_variant()


def _sparse_case(lens, seed, gpu_pool):
    """A GPU pool with `lens`, its table and lengths, bf16 q (GQA 32/8, d128) and 24 random selected
    blocks per (sequence, kv head); the generator (seeded seed + 2) for more draws."""
    pool = gpu_pool(lens, seed=seed)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    bi = torch.stack([torch.randperm(bt.shape[1], device="cuda", generator=g)[:24].sort().values.int()
                      for _ in range(len(lens) * 8)]).reshape(len(lens), 8, 24)
    return pool, bt, sl, q, bi, g


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 5, 16])
def test_ticket_combine_equals_combine_launch(splits, monkeypatch, gpu_pool):
    """The in-kernel merge of split partials (the last split CTA, ticket per (sequence, kv head))
    gives the combine kernel's output bit for bit (same arithmetic), dense and sparse, call after
    call (the tickets re-arm) and under CUDA-graph replay."""
    cfg = cuda_decode.KernelConfig("mma", 64, 3)
    pool, bt, sl, q, bi, g = _sparse_case([2000, 513, 64, 0, 1], seed=2, gpu_pool=gpu_pool)
    for idx in (None, bi):
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "launch")
        want = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, idx, num_splits=splits, config=cfg)
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "ticket")
        for _ in range(3):
            got = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, idx, num_splits=splits, config=cfg)
            assert torch.equal(got, want)
        ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=idx)
        assert tilehal.calc_diff(got, ref) < 1e-5
    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_decode.paged_decode_cuda(static_q, pool, 0, bt, sl, None, bi, num_splits=splits, config=cfg)
    for seed in range(2):
        static_q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g))
        graph.replay()
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "launch")
        want = cuda_decode.paged_decode_cuda(static_q, pool, 0, bt, sl, None, bi, num_splits=splits, config=cfg)
        monkeypatch.setenv("KVPOOL_DECODE_COMBINE", "ticket")
        assert torch.equal(out, want)


def test_prefetch_env(monkeypatch):
    monkeypatch.delenv("KVPOOL_DECODE_PREFETCH", raising=False)
    assert cuda_decode.prefetch_enabled() == (cuda_decode.DEFAULT_PREFETCH == "1")
    monkeypatch.setenv("KVPOOL_DECODE_PREFETCH", "1")
    assert cuda_decode.prefetch_enabled()
    monkeypatch.setenv("KVPOOL_DECODE_PREFETCH", "yes")
    with pytest.raises(ValueError, match="KVPOOL_DECODE_PREFETCH"):
        cuda_decode.prefetch_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_sparse_prefetch_changes_no_output(splits, monkeypatch, gpu_pool):
    """The L2 prefetch of a sparse share is a hint: the output is bit-identical with and without it."""
    cfg = cuda_decode.KernelConfig("mma", 64, 3)
    pool, bt, sl, q, bi, _ = _sparse_case([2000, 513, 64, 0], seed=5, gpu_pool=gpu_pool)
    bi[1, :, -3:] = -1
    monkeypatch.setenv("KVPOOL_DECODE_PREFETCH", "0")
    want = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, num_splits=splits, config=cfg)
    monkeypatch.setenv("KVPOOL_DECODE_PREFETCH", "1")
    got = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, num_splits=splits, config=cfg)
    assert torch.equal(got, want)
    assert tilehal.calc_diff(got, kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=bi)) < 1e-5
