"""CUDA paged prefill: compile-only checks in CI, numerics vs the torch reference on a GPU.

Tolerance: the kernel rounds the softmax probabilities to the MMA input type (bf16/fp16) before
P @ V, as FlashAttention does; against the float32 reference that gives calc_diff < 2e-5 and
element errors within 2e-2 (bf16 outputs of unit-scale attention).
"""

import itertools

import kvpool
import pytest
import tilehal
import torch
from kvpool import cuda_prefill


def _have_compiler() -> bool:
    v = tilehal.compiler_versions()
    return v["nvrtc"] is not None or v["nvcc"] is not None


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cfg", cuda_prefill.CONFIGS, ids=cuda_prefill.config_name)
def test_prefill_kernels_compile(dtype, head_dim, cfg):
    m = cuda_prefill.compile_prefill(dtype, head_dim, cfg)
    assert cuda_prefill.kernel_name(dtype, head_dim, cfg) in m.lowered_names and len(m.cubin) > 1000


def test_shared_memory_and_tiles():
    # Q (128 rows) + two stages of K and V (64 tokens) at d128 bf16: two CTAs fit an H200 SM.
    assert cuda_prefill.smem_bytes(torch.bfloat16, 128, (8, 1)) == 128 * 256 + 4 * 64 * 256
    assert 2 * (cuda_prefill.smem_bytes(torch.bfloat16, 128, (4, 2)) + 1024) <= 228 * 1024
    # wgmma: Q (128 rows) + 4 stages of K and V + barriers + alignment slack, one CTA per SM
    assert cuda_prefill.smem_bytes(torch.bfloat16, 128, ("wg", 2, 64, 4, 2)) == 128 * 256 + 8 * 64 * 256 + 64 + 1024
    assert all(cuda_prefill.smem_bytes(torch.bfloat16, 128, c) + 1024 <= 228 * 1024 for c in cuda_prefill.WGMMA_CONFIGS)
    tiles = cuda_prefill.tile_list([0, 3, 3, 300], [10, 5, 1000], 128)
    assert tiles[0] == (2, 256) and sorted(tiles) == [(0, 0), (2, 0), (2, 128), (2, 256)]


def test_config_env(monkeypatch):
    monkeypatch.setenv("KVPOOL_PREFILL_KERNEL", "w4x2")
    assert cuda_prefill.default_config() == (4, 2)
    monkeypatch.setenv("KVPOOL_PREFILL_KERNEL", "wg2n64s4p2")
    assert cuda_prefill.default_config() == ("wg", 2, 64, 4, 2) and cuda_prefill.threads(("wg", 2, 64, 4, 2)) == 320
    monkeypatch.setenv("KVPOOL_PREFILL_KERNEL", "w3x1")
    with pytest.raises(ValueError, match="KVPOOL_PREFILL_KERNEL"):
        cuda_prefill.default_config()
    monkeypatch.delenv("KVPOOL_PREFILL_KERNEL")
    assert cuda_prefill.default_config() == cuda_prefill.DEFAULT_CONFIG


def test_unsupported_reasons():
    pool = kvpool.KVPool(1, 2, 64, 4, dtype=torch.bfloat16)
    assert "pool on cpu" in cuda_prefill.unsupported_reason(torch.zeros(1, 2, 64, dtype=torch.bfloat16), pool)


def _prefill_pool(lens, news, heads, head_dim, dtype, block_size=16, seed=0):
    """GPU pool with sequences of `lens` tokens (K/V written), the last `news` of each are new."""
    total_blocks = sum(-(-L // block_size) for L in lens) + 4
    pool = kvpool.KVPool(1, heads, head_dim, total_blocks, block_size=block_size, dtype=dtype, device="cuda",
                         prefix_caching=False, watermark=0.0)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for i, L in enumerate(lens):
        pool.add_sequence(i, [0])
    done = [0] * len(lens)
    while any(d < L for d, L in zip(done, lens)):  # interleave the sequences' blocks
        for i, L in enumerate(lens):
            n = min(40, L - done[i])
            if n <= 0:
                continue
            slots = pool.append(i, n).cuda()
            pool.write(0, slots, torch.randn(n, heads, head_dim, device="cuda", generator=g),
                       torch.randn(n, heads, head_dim, device="cuda", generator=g))
            done[i] += n
    ids = list(range(len(lens)))
    cu = torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int32, device="cuda")
    return pool, pool.block_table(ids), pool.seq_lens(ids), cu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(128, 32, 8), (64, 8, 8), (128, 8, 1), (64, 4, 2)])
@pytest.mark.parametrize("cfg", cuda_prefill.CONFIGS, ids=cuda_prefill.config_name)
def test_prefill_matches_reference(dtype, head_dim, q_heads, kv_heads, cfg):
    lens = [1, 17, 300, 1000, 129, 2100, 40]
    news = [1, 17, 45, 1000, 1, 200, 0]  # cached prefixes of 0..1900 tokens; one sequence adds nothing
    pool, bt, sl, cu = _prefill_pool(lens, news, kv_heads, head_dim, dtype)
    q = torch.randn(int(cu[-1]), q_heads, head_dim, device="cuda", dtype=dtype)
    out = cuda_prefill.paged_prefill_cuda(q, pool, 0, bt, sl, cu, cu.tolist(), sl.tolist(), None, config=cfg)
    ref = kvpool.paged_prefill_reference(q, pool, 0, bt, sl, cu)
    assert tilehal.calc_diff(out, ref) < 2e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 12])  # 12: not a power of two
def test_prefill_block_sizes_and_scale(block_size):
    pool, bt, sl, cu = _prefill_pool([500, 77], [260, 77], 2, 64, torch.bfloat16, block_size=block_size)
    q = torch.randn(int(cu[-1]), 8, 64, device="cuda", dtype=torch.bfloat16)
    out = kvpool.paged_prefill(q, pool, 0, bt, sl, cu, scale=0.3)
    ref = kvpool.paged_prefill_reference(q, pool, 0, bt, sl, cu, scale=0.3)
    assert tilehal.calc_diff(out, ref) < 2e-5


@pytest.mark.gpu
def test_prefill_then_decode_agree():
    """The last new token's prefill output equals a decode step at the same position."""
    pool, bt, sl, cu = _prefill_pool([700], [300], 8, 128, torch.bfloat16)
    q = torch.randn(300, 32, 128, device="cuda", dtype=torch.bfloat16)
    pre = kvpool.paged_prefill(q, pool, 0, bt, sl, cu)
    dec = kvpool.paged_decode(q[-1:].contiguous(), pool, 0, bt, sl)
    assert tilehal.calc_diff(pre[-1:], dec) < 2e-5
