"""paged_decode / paged_prefill against SDPA on the gathered K/V (CPU)."""

import math

import kvpool
import pytest
import torch
from tilehal import ShapeError


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("q_heads", [2, 8])
def test_decode_matches_sdpa(dtype, tol, q_heads, fill_pool, sdpa_decode):
    pool = kvpool.KVPool(1, 2, 32, 64, block_size=8, dtype=dtype)
    lens = [1, 8, 9, 37, 60]
    fill_pool(pool, lens)
    ids = list(range(len(lens)))
    q = torch.randn(len(lens), q_heads, 32).to(dtype)
    out = kvpool.paged_decode(q, pool, 0, pool.block_table(ids), pool.seq_lens(ids), scale=0.3)
    assert out.dtype == dtype and out.shape == q.shape
    for i in ids:
        k, v = pool.gather(0, i)
        ref = sdpa_decode(q[i], k, v, scale=0.3)
        torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol)


def test_default_scale_and_empty_sequence(fill_pool, sdpa_decode):
    pool = kvpool.KVPool(1, 1, 16, 16, block_size=4, dtype=torch.float32)
    fill_pool(pool, [5])
    pool.add_sequence(7, [1])  # registered, nothing appended: zero tokens to attend to
    q = torch.randn(2, 2, 16)
    out = kvpool.paged_decode(q, pool, 0, pool.block_table([0, 7]), pool.seq_lens([0, 7]))
    k, v = pool.gather(0, 0)
    torch.testing.assert_close(out[0].double(), sdpa_decode(q[0], k, v, scale=1 / math.sqrt(16)), atol=1e-5, rtol=0)
    assert torch.all(out[1] == 0)


@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_all_blocks_equals_dense(per_head, fill_pool):
    pool = kvpool.KVPool(1, 4, 16, 128, block_size=4, dtype=torch.float32)
    lens = [3, 16, 29, 50]
    fill_pool(pool, lens, seed=3)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(len(lens), 8, 16)
    dense = kvpool.paged_decode(q, pool, 0, bt, sl)
    n = bt.shape[1] + 2
    bi = torch.full((len(lens), n), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    for i, L in enumerate(lens):
        nb = -(-L // 4)
        bi[i, :nb] = torch.randperm(nb, generator=g).int()  # any order, -1 padding anywhere after
    if per_head:
        bi = bi[:, None, :].expand(-1, 4, -1).contiguous()
    torch.testing.assert_close(kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi), dense, atol=1e-6, rtol=0)


def test_sparse_subset_matches_sdpa_on_selected_blocks(fill_pool, sdpa_decode):
    bs, H = 4, 2
    pool = kvpool.KVPool(1, H, 16, 64, block_size=bs, dtype=torch.float32)
    fill_pool(pool, [30], seed=5)
    q = torch.randn(1, 4, 16)
    bi = torch.tensor([[[7, 0, -1], [2, 5, 3]]], dtype=torch.int32)  # per kv head
    out = kvpool.paged_decode(q, pool, 0, pool.block_table([0]), pool.seq_lens([0]), block_indices=bi)
    k, v = pool.gather(0, 0)
    for h, blocks in enumerate([[7, 0], [2, 5, 3]]):
        pos = torch.cat([torch.arange(b * bs, min((b + 1) * bs, 30)) for b in blocks])
        ref = sdpa_decode(q[0, 2 * h:2 * h + 2], k[pos, h:h + 1], v[pos, h:h + 1])
        torch.testing.assert_close(out[0, 2 * h:2 * h + 2].double(), ref, atol=1e-5, rtol=0)


def test_fp8_within_tolerance():
    torch.manual_seed(0)
    ref_pool = kvpool.KVPool(1, 2, 64, 64, block_size=16, dtype=torch.float32)
    fp8_pool = kvpool.KVPool(1, 2, 64, 64, block_size=16, dtype=torch.float8_e4m3fn, debug=True)
    lens = [40, 100]
    for p in (ref_pool, fp8_pool):
        for i, L in enumerate(lens):
            p.add_sequence(i, [i * 1000 + j for j in range(L)])
    g = torch.Generator().manual_seed(1)
    for i, L in enumerate(lens):
        # Several writes per sequence with growing magnitudes exercise per-block rescaling.
        for start in range(0, L, 7):
            n = min(7, L - start)
            k = torch.randn(n, 2, 64, generator=g) * (1 + start / 10)
            v = torch.randn(n, 2, 64, generator=g) * (1 + start / 10)
            for p in (ref_pool, fp8_pool):
                p.write(0, p.append(i, n), k, v)
    for i in range(len(lens)):
        k32, v32 = ref_pool.gather(0, i)
        k8, v8 = fp8_pool.gather(0, i)
        assert k8.dtype == torch.float32
        # e4m3 rounds to 3 mantissa bits: relative error <= 2^-4 (power-of-two rescales are
        # exact); values pushed toward the subnormal range get an absolute floor.
        for got, want in ((k8, k32), (v8, v32)):
            assert ((got - want).abs() <= 2**-4 * want.abs() + 2e-3 * want.abs().max()).all()
    q = torch.randn(2, 4, 64)
    ids = [0, 1]
    out8 = kvpool.paged_decode(q, fp8_pool, 0, fp8_pool.block_table(ids), fp8_pool.seq_lens(ids))
    out32 = kvpool.paged_decode(q, ref_pool, 0, ref_pool.block_table(ids), ref_pool.seq_lens(ids))
    rel = (out8 - out32).norm() / out32.norm()
    assert rel < 0.05, rel


def test_prefill_matches_causal_sdpa(fill_pool, sdpa_decode):
    pool = kvpool.KVPool(1, 2, 16, 64, block_size=4, dtype=torch.float32)
    lens = [11, 26]
    fill_pool(pool, lens, seed=2)
    new = [3, 26]  # seq 0: 8 cached + 3 new; seq 1: whole prompt new
    q = torch.randn(sum(new), 4, 16)
    cu = torch.tensor([0, 3, 29])
    out = kvpool.paged_prefill(q, pool, 0, pool.block_table([0, 1]), pool.seq_lens([0, 1]), cu)
    for b, (L, n) in enumerate(zip(lens, new)):
        k, v = pool.gather(0, b)
        for j in range(n):
            pos = L - n + j
            ref = sdpa_decode(q[cu[b] + j], k[:pos + 1], v[:pos + 1])
            torch.testing.assert_close(out[cu[b] + j].double(), ref, atol=1e-5, rtol=0)


def test_bad_arguments_name_themselves(fill_pool):
    pool = kvpool.KVPool(1, 2, 16, 16, block_size=4, dtype=torch.float32)
    fill_pool(pool, [5])
    bt, sl = pool.block_table([0]), pool.seq_lens([0])
    with pytest.raises(ShapeError, match="q: expected head_dim 16"):
        kvpool.paged_decode(torch.randn(1, 2, 8), pool, 0, bt, sl)
    with pytest.raises(ShapeError, match="multiple of kv_heads"):
        kvpool.paged_decode(torch.randn(1, 3, 16), pool, 0, bt, sl)
    with pytest.raises(ShapeError, match="block_table: expected an int32"):
        kvpool.paged_decode(torch.randn(1, 2, 16), pool, 0, bt.long(), sl)
    with pytest.raises(ShapeError, match="seq_lens: expected batch 1"):
        kvpool.paged_decode(torch.randn(1, 2, 16), pool, 0, bt, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ShapeError, match="block_indices"):
        kvpool.paged_decode(torch.randn(1, 2, 16), pool, 0, bt, sl, block_indices=torch.zeros(1, 3, 2, dtype=torch.int32))
    with pytest.raises(IndexError, match="layer"):
        kvpool.paged_decode(torch.randn(1, 2, 16), pool, 1, bt, sl)


def test_prefill_bad_arguments(fill_pool):
    pool = kvpool.KVPool(1, 2, 16, 16, block_size=4, dtype=torch.float32)
    fill_pool(pool, [5])
    bt, sl = pool.block_table([0]), pool.seq_lens([0])
    q = torch.randn(2, 2, 16)
    with pytest.raises(ShapeError, match="cu_seqlens_q"):
        kvpool.paged_prefill(q, pool, 0, bt, sl, torch.tensor([0, 3]))
    with pytest.raises(ShapeError, match="block_table"):
        kvpool.paged_prefill(q, pool, 0, bt.long(), sl, torch.tensor([0, 2]))
    with pytest.raises(ShapeError, match="seq_lens"):
        kvpool.paged_prefill(q, pool, 0, bt, torch.tensor([1], dtype=torch.int32)[:0], torch.tensor([0, 2]))


def test_table_shorter_than_seq_len_and_holes_are_masked(fill_pool, sdpa_decode):
    """Positions the table does not cover (too short, or -1 entries) are not attended to."""
    pool = kvpool.KVPool(1, 1, 16, 32, block_size=4, dtype=torch.float32)
    fill_pool(pool, [16])
    bt, sl = pool.block_table([0]), pool.seq_lens([0])
    q = torch.randn(1, 2, 16)
    k, v = pool.gather(0, 0)
    out = kvpool.paged_decode(q, pool, 0, bt[:, :2].contiguous(), sl)  # covers 8 of 16 tokens
    torch.testing.assert_close(out[0].double(), sdpa_decode(q[0], k[:8], v[:8]), atol=1e-5, rtol=0)
    holed = bt.clone()
    holed[0, 1] = -1
    out = kvpool.paged_decode(q, pool, 0, holed, sl)
    keep = torch.cat([torch.arange(0, 4), torch.arange(8, 16)])
    torch.testing.assert_close(out[0].double(), sdpa_decode(q[0], k[keep], v[keep]), atol=1e-5, rtol=0)
