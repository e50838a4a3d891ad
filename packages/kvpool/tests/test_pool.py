"""KVPool sequence API: prefix caching, copy-on-write, exhaustion, LRU eviction, stats."""

import kvpool
import pytest
import torch
from kvpool import PoolExhaustedError


def make(num_blocks=16, bs=4, **kw):
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("debug", True)
    return kvpool.KVPool(1, 1, 4, num_blocks, block_size=bs, watermark=0.0, **kw)


def test_prefix_hit_accounting():
    pool = make()
    prompt = list(range(14))  # 3 full blocks + 2 tokens
    assert pool.add_sequence("a", prompt) == 0
    pool.append("a", len(prompt))
    # Same prompt: hits are capped so the last token is recomputed -> 13 tokens -> 3 full blocks.
    assert pool.add_sequence("b", prompt) == 12
    assert pool.blocks_of("b") == pool.blocks_of("a")[:3]
    # The exact-multiple case: 12 tokens can only hit 2 blocks (the last token is never a hit).
    assert pool.add_sequence("c", prompt[:12]) == 8
    # A different extra key (LoRA id) shares nothing.
    assert pool.add_sequence("d", prompt, extra_key=("lora", 3)) == 0
    # A divergence in block 1 keeps block 0 only (hashes are chained).
    assert pool.add_sequence("e", prompt[:5] + [999] + prompt[6:]) == 4
    st = pool.stats()
    assert st.queries == 5 and st.query_tokens == 14 * 4 + 12
    assert st.hit_tokens == 12 + 8 + 4
    assert st.hit_rate == pytest.approx(24 / 68)
    assert pool.manager.ref[pool.blocks_of("a")[0]] == 4  # a, b, c, e


def test_freed_blocks_stay_matchable_until_reused():
    pool = make(num_blocks=4)
    pool.add_sequence("a", list(range(9)))
    pool.append("a", 9)  # 3 blocks; two full ones hashed
    pool.free("a")
    st = pool.stats()
    assert st.blocks_free == 4 and st.blocks_cached_free == 2
    assert pool.add_sequence("b", list(range(9))) == 8
    pool.free("b")
    pool.add_sequence("x", [7] * 16)
    pool.append("x", 16)  # needs all 4 blocks: the cached ones are evicted, LRU first
    assert pool.stats().evictions == 2
    pool.free("x")
    assert pool.add_sequence("c", list(range(9))) == 0


def test_lru_order_and_explicit_evict():
    pool = make(num_blocks=8)
    for sid, base in (("a", 0), ("b", 100)):
        pool.add_sequence(sid, list(range(base, base + 8)) + [1])
        pool.append(sid, 9)
    a_blocks, b_blocks = pool.blocks_of("a"), pool.blocks_of("b")
    pool.free("a")
    pool.free("b")
    # Released later = more recent; within a sequence the tail goes first (least likely shared).
    assert pool.manager.lru_order() == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert pool.evict(2) == 2
    assert pool.add_sequence("a2", list(range(8)) + [1]) == 0
    assert pool.add_sequence("b2", list(range(100, 108)) + [1]) == 8


def test_fork_copy_on_write():
    pool = make()
    pool.add_sequence("a", list(range(6)))
    s = pool.append("a", 6)
    k = torch.arange(6 * 4, dtype=torch.float32).view(6, 1, 4)
    pool.write(0, s, k, -k)
    pool.fork("a", "b")
    assert pool.blocks_of("a") == pool.blocks_of("b")
    sb = pool.append("b", [42])  # into the shared partial block: b gets a private copy
    assert pool.blocks_of("b")[0] == pool.blocks_of("a")[0]
    assert pool.blocks_of("b")[1] != pool.blocks_of("a")[1]
    pool.write(0, sb, torch.full((1, 1, 4), 7.0), torch.full((1, 1, 4), 8.0))
    sa = pool.append("a", [43])
    pool.write(0, sa, torch.full((1, 1, 4), 1.0), torch.full((1, 1, 4), 2.0))
    ka, _ = pool.gather(0, "a")
    kb, vb = pool.gather(0, "b")
    assert torch.equal(ka[:6], k) and torch.equal(kb[:6], k)
    assert torch.all(ka[6] == 1.0) and torch.all(kb[6] == 7.0) and torch.all(vb[6] == 8.0)
    assert pool.stats().cow_copies == 1


def test_exhaustion_leaves_pool_unchanged():
    pool = make(num_blocks=4)
    pool.add_sequence("a", list(range(10)))
    pool.append("a", 10)  # 3 blocks
    before = (pool.manager.snapshot(), pool.num_tokens("a"), pool.stats())
    with pytest.raises(PoolExhaustedError) as e:
        pool.append("a", 7)  # needs 2 more
    assert e.value.needed == 2 and e.value.available == 1
    assert (pool.manager.snapshot(), pool.num_tokens("a"), pool.stats()) == before
    with pytest.raises(PoolExhaustedError):
        pool.add_sequence("b", list(range(100, 120)))
    assert "b" not in pool
    assert (pool.manager.snapshot(), pool.num_tokens("a"), pool.stats()) == before


def test_watermark_applies_to_admission_only():
    pool = kvpool.KVPool(1, 1, 4, 10, block_size=4, dtype=torch.float32, watermark=0.2, debug=True)
    with pytest.raises(PoolExhaustedError, match="watermark"):
        pool.add_sequence("a", list(range(33)))  # 9 blocks: would leave 1 < 2
    pool.add_sequence("a", list(range(32)))  # 8 blocks: leaves exactly 2
    pool.append("a", 32)
    pool.append("a", 8)  # decode growth may use the reserve


def test_block_table_seq_lens_and_summary():
    pool = kvpool.KVPool(1, 2, 3, 16, block_size=4, dtype=torch.float32, debug=True)
    pool.add_sequence(0, list(range(6)))
    pool.add_sequence(1, list(range(50, 52)))
    s0, s1 = pool.append(0, 6), pool.append(1, 2)
    assert s0.dtype == torch.int32
    k0 = torch.randn(6, 2, 3)
    pool.write(0, s0, k0, k0)
    pool.write(0, s1, torch.zeros(2, 2, 3), torch.zeros(2, 2, 3))
    bt = pool.block_table([0, 1])
    assert bt.dtype == torch.int32 and bt.tolist() == [pool.blocks_of(0), pool.blocks_of(1) + [-1]]
    assert pool.seq_lens([1, 0]).tolist() == [2, 6]
    kmin, kmax = pool.key_summary(0)
    assert kmin.shape == (16, 2, 3)
    b0, b1 = pool.blocks_of(0)
    torch.testing.assert_close(kmin[b0], k0[:4].amin(0))
    torch.testing.assert_close(kmax[b1], k0[4:].amax(0))
    # A reused block starts from a clean summary.
    pool.free(0)
    pool.add_sequence(2, [9])
    s2 = pool.append(2, 1)
    pool.write(0, s2, torch.ones(1, 2, 3), torch.ones(1, 2, 3))
    (b2,) = pool.blocks_of(2)
    assert torch.all(pool.key_summary(0)[0][b2] == 1) and torch.all(pool.key_summary(0)[1][b2] == 1)


def test_append_token_ids_checked_against_prompt():
    pool = make()
    pool.add_sequence("a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="pending prompt"):
        pool.append("a", [1, 2, 9])
    pool.append("a", [1, 2, 3])
    pool.append("a", 2)  # the rest of the prompt by count
    pool.append("a", [6, 7, 8])  # generated tokens with ids: block 1 becomes hashable
    assert pool.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_argument_errors():
    pool = make()
    with pytest.raises(ValueError, match="num_blocks"):
        kvpool.KVPool(1, 1, 4, 0)
    with pytest.raises(KeyError, match="seq_id"):
        pool.append("nope", 1)
    pool.add_sequence("a", [1])
    with pytest.raises(ValueError, match="already registered"):
        pool.add_sequence("a", [1])
    s = pool.append("a", 1)
    with pytest.raises(ValueError, match=r"k: expected shape \(1, 1, 4\)"):
        pool.write(0, s, torch.zeros(1, 2, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="slots: expected values"):
        pool.write(0, torch.tensor([999], dtype=torch.int32), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(IndexError, match="layer"):
        pool.gather(3, "a")


def test_prefix_caching_off_shares_nothing():
    pool = make(prefix_caching=False)
    pool.add_sequence("a", list(range(9)))
    pool.append("a", 9)
    assert pool.add_sequence("b", list(range(9))) == 0
    assert pool.stats().blocks_cached == 0


def test_copy_on_write_keeps_key_summaries_and_fp8_scales():
    pool = kvpool.KVPool(1, 1, 4, 8, block_size=4, dtype=torch.float8_e4m3fn, watermark=0.0, debug=True)
    pool.add_sequence("a", [1, 2])
    s = pool.append("a", 2)
    k = torch.tensor([[[1.0, -2.0, 3.0, 0.5]], [[2.0, 0.0, -1.0, 4.0]]])
    pool.write(0, s, k, k)
    pool.fork("a", "b")
    pool.append("b", 1)  # copy-on-write of the partial block
    src, dst = pool.blocks_of("a")[0], pool.blocks_of("b")[0]
    assert src != dst
    kmin, kmax = pool.key_summary(0)
    assert torch.equal(kmin[dst], kmin[src]) and torch.equal(kmax[dst], kmax[src])
    torch.testing.assert_close(kmax[dst, 0], k.amax(0)[0])
    ks, vs = pool.layer_scales(0)
    assert torch.equal(ks[dst], ks[src]) and ks[src, 0] > 0
    ka, _ = pool.gather(0, "a")
    kb, _ = pool.gather(0, "b")
    assert torch.equal(ka, kb[:2])


def test_debug_checks_catch_corruption():
    pool = make()
    pool.add_sequence("a", list(range(6)))
    pool.append("a", 6)
    pool.check_invariants()
    b = pool.blocks_of("a")[0]
    pool.manager.ref[b] += 1  # a leaked reference
    with pytest.raises(kvpool.InvariantError, match="ref"):
        pool.check_invariants()
    pool.manager.ref[b] -= 1
    pool.manager.plain.append(pool.manager.plain[-1])  # a double free
    with pytest.raises(kvpool.InvariantError, match="twice"):
        pool.check_invariants()


def test_append_batch_matches_single_appends_and_is_all_or_nothing():
    a, b = make(num_blocks=32), make(num_blocks=32)
    for p in (a, b):
        for sid in range(3):
            p.add_sequence(sid, [sid] * 5)
            p.append(sid, 3)
        p.fork(0, 9)  # seq 0's partial block is shared: the batch must copy it on write too
    batch = a.append_batch([0, 1, 2], [2, 5, 1])
    single = torch.cat([b.append(0, 2), b.append(1, 5), b.append(2, 1)])
    assert batch.dtype == torch.int32 and batch.tolist() == single.tolist()
    assert a.blocks_of(1) == b.blocks_of(1) and a.blocks_of(0) == b.blocks_of(0)
    assert a.stats().cow_copies == 1
    a.add_sequence("big", [1] * 90)
    a.append("big", 88)  # 22 blocks: few left
    before = (a.manager.snapshot(), a.stats())
    with pytest.raises(PoolExhaustedError):
        a.append_batch([0, 1, 2, "big"], 16)
    assert (a.manager.snapshot(), a.stats()) == before
    with pytest.raises(ValueError, match="distinct"):
        a.append_batch([0, 0])
