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


def test_tma_configs_and_reasons():
    cfg = cuda_prefill.config_from_name("wg2n64s6p4pptma")
    assert cuda_prefill.wg_tma(cfg) and cuda_prefill.wg_pingpong(cfg) and not cuda_prefill.wg_tma(("wg", 2, 64, 6, 4, "pp"))
    # the stages' full / empty barriers plus full_v and the tail barrier
    assert cuda_prefill.smem_bytes(torch.bfloat16, 128, cfg) == 128 * 256 + 12 * 64 * 256 + 8 * 19 + 1024
    assert "true, true>" in cuda_prefill.kernel_name(torch.bfloat16, 128, cfg)
    assert cuda_prefill.DEFAULT_CONFIG in cuda_prefill.WGMMA_CONFIGS and cuda_prefill.wg_tma(cuda_prefill.DEFAULT_CONFIG)
    assert not cuda_prefill.wg_tma(cuda_prefill.CP_ASYNC_CONFIG)  # what a pool TMA cannot read gets

    def pool(bs):
        return kvpool.KVPool(1, 2, 64, 8, block_size=bs, dtype=torch.bfloat16)
    assert cuda_prefill.tma_reason(pool(16), cfg) is None and cuda_prefill.tma_reason(pool(256), cfg) is None
    assert "multiple of 8" in cuda_prefill.tma_reason(pool(12), cfg)
    assert "neither divides" in cuda_prefill.tma_reason(pool(24), cfg)


def _emulate_tma_tile(view, shape, box, block_table_row, kv_end, t, bn, block_size, head, d, is_v):
    """The kernel's K (or V) tile t as TMA would land it, read back through the consumers' swizzled
    layout: numpy model of cp.async.bulk.tensor (tile mode, SWIZZLE_128B, out-of-bounds boxes zero)
    driven by the producer's boxes and slot coordinates (paged_prefill_wgmma.cuh, tma_producer's
    has_box / slot_of: mirrored here, not executed), then the last tile's V rows past kv_end zeroed.
    The stage starts as 0xFF bytes (NaN in bf16): what a box that is not issued leaves behind."""
    bt = box[0]
    atoms = d // 64
    smem = torch.full((atoms * bn * 128,), 0xFF, dtype=torch.uint8)
    for lane in range(bn // bt):
        j0 = t * bn + lane * bt
        if j0 >= kv_end:
            continue  # not issued
        lb = j0 // block_size
        phys = int(block_table_row[lb]) if lb < len(block_table_row) else -1
        slot = phys * block_size + (j0 - lb * block_size) if phys >= 0 else -bt
        for a in range(atoms):
            if 0 <= slot and slot + bt <= shape[0]:
                data = view[slot:slot + bt, head * atoms + a, :].contiguous().view(torch.uint8).reshape(bt, 128)
            else:
                data = torch.zeros(bt, 128, dtype=torch.uint8)
            base = a * bn * 128 + lane * bt * 128  # the box's destination, relative to a 1024-aligned tile
            for i in range(bt):
                row_addr = base + i * 128
                for c in range(8):  # SWIZZLE_128B: 16-byte chunk c of a 128-byte row at c ^ (address bits 7..9)
                    dst = row_addr + ((c ^ ((row_addr >> 7) & 7)) << 4)
                    smem[dst:dst + 16] = data[i, 16 * c:16 * c + 16]
    last = (kv_end - 1) // bn
    if is_v and t == last:  # the producer's tail: rows r_from .. bn - 1 of every atom, whole rows
        r_from = kv_end - last * bn
        for a in range(atoms):
            smem[a * bn * 128 + r_from * 128:(a + 1) * bn * 128] = 0
    # the consumers' view: token r, channel ch of atom a at a * bn * 128 + r * 128 + ((ch // 8 ^ r % 8) << 4)
    out = torch.empty(bn, d, dtype=view.dtype)
    for r in range(bn):
        for a in range(atoms):
            row = torch.empty(128, dtype=torch.uint8)
            for c in range(8):
                src = a * bn * 128 + r * 128 + ((c ^ (r & 7)) << 4)
                row[16 * c:16 * c + 16] = smem[src:src + 16]
            out[r, 64 * a:64 * a + 64] = row.view(view.dtype)
    return out


@pytest.mark.parametrize("block_size,bn,d", [(16, 64, 128), (32, 128, 64), (128, 64, 128), (8, 64, 64)])
def test_tma_boxes_gather_the_block_table(block_size, bn, d):
    """CPU check of the TMA loader's geometry: the descriptor view (tma_layout, the host's real
    arguments to encode_tiled) plus the producer's boxes land every visible key's row of the kv head
    exactly where the consumers read it; an unmapped block reads zero; V past kv_end is zero (K there
    is masked by the consumers, whatever it holds)."""
    heads, nb = 3, 24
    g = torch.Generator().manual_seed(block_size)
    cache = torch.randn(nb, block_size, heads, d, generator=g).to(torch.bfloat16)
    shape, strides, box = cuda_prefill.tma_layout(cache, bn)
    assert box == (min(block_size, bn), 1, 64) and shape[1:] == (heads * d // 64, 64)
    view = cache.reshape(-1).as_strided(shape, strides)
    n_pages = -(-3 * bn // block_size)
    table = torch.randperm(nb, generator=g)[:n_pages].to(torch.int32)
    table[1] = -1  # an unmapped block inside the range: zeros
    for kv_end in (3 * bn - 5, 2 * bn + 1, 3 * bn):
        for head in (0, heads - 1):
            for t in range(-(-kv_end // bn)):
                for is_v in (False, True):
                    tile = _emulate_tma_tile(view, shape, box, table, kv_end, t, bn, block_size, head, d, is_v)
                    for r in range(bn):
                        j = t * bn + r
                        phys = int(table[j // block_size])
                        if j < kv_end:
                            want = cache[phys, j % block_size, head] if phys >= 0 else torch.zeros(d)
                            assert torch.equal(tile[r].float(), want.float()), (kv_end, head, t, r, is_v)
                        elif is_v:
                            assert not tile[r].any(), (kv_end, head, t, r)


def test_tma_layout_rejects_views():
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(tilehal.ShapeError, match="contiguous"):
        cuda_prefill.tma_layout(cache[:, :, :1], 64)


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


TMA_CONFIGS = [c for c in cuda_prefill.WGMMA_CONFIGS if cuda_prefill.wg_tma(c)]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 64, 256])  # 256: one page holds several kv tiles
@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=cuda_prefill.config_name)
def test_prefill_tma_pages_and_stale_slots(cfg, block_size):
    """TMA loader: every page geometry it accepts, and NaN planted in the unused slots of each
    sequence's last page (stale values of an earlier owner) must not reach the output."""
    lens, news = [700, 77, 1, 300], [300, 77, 1, 45]
    pool, bt, sl, cu = _prefill_pool(lens, news, 2, 128, torch.bfloat16, block_size=block_size, seed=3)
    kc, vc = pool.layer_cache(0)
    for b, L in enumerate(lens):
        if L % block_size:
            phys = int(bt[b, (L - 1) // block_size])
            kc[phys, L % block_size:] = float("nan")
            vc[phys, L % block_size:] = float("nan")
    q = torch.randn(int(cu[-1]), 8, 128, device="cuda", dtype=torch.bfloat16)
    out = cuda_prefill.paged_prefill_cuda(q, pool, 0, bt, sl, cu, cu.tolist(), sl.tolist(), None, config=cfg)
    ref = kvpool.paged_prefill_reference(q, pool, 0, bt, sl, cu)
    assert torch.isfinite(out).all()
    assert tilehal.calc_diff(out, ref) < 2e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_prefill_tma_falls_back_for_unsupported_pages(caplog):
    pool, bt, sl, cu = _prefill_pool([200], [200], 2, 64, torch.bfloat16, block_size=12)
    q = torch.randn(200, 4, 64, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("DEBUG", logger="kvpool.cuda_prefill"):
        out = cuda_prefill.paged_prefill_cuda(q, pool, 0, bt, sl, cu, cu.tolist(), sl.tolist(), None,
                                              config=TMA_CONFIGS[0])
    assert "multiple of 8" in caplog.text
    assert tilehal.calc_diff(out, kvpool.paged_prefill_reference(q, pool, 0, bt, sl, cu)) < 2e-5
