"""Host tier on the CPU: offload on eviction, prefix hits on host blocks, prefetch, host LRU."""

import kvpool
import pytest
import torch


def make(num_blocks=4, host_blocks=4):
    return kvpool.KVPool(1, 1, 4, num_blocks, block_size=2, dtype=torch.float32, host_blocks=host_blocks,
                         watermark=0.0, debug=True)


def fill(pool, sid, prompt, scale=1.0):
    pool.add_sequence(sid, prompt)
    n = len(prompt) - pool.num_tokens(sid)
    slots = pool.append(sid, n)
    start = pool.num_tokens(sid) - n
    k = torch.arange(start, start + n, dtype=torch.float32)[:, None, None].expand(n, 1, 4) * scale
    pool.write(0, slots, k, -k)
    return k


def test_evicted_blocks_come_back_from_host():
    pool = make()
    fill(pool, "a", [1, 2, 3, 4, 5])
    ka, _ = pool.gather(0, "a")
    pool.free("a")
    assert pool.evict() == 2  # the two full blocks
    st = pool.stats()
    assert st.offloads == 2 and st.blocks_cached == 0 and st.host_blocks_used == 2
    fill(pool, "x", [9] * 8, scale=100.0)  # reuses (overwrites) every device block
    pool.free("x")
    assert pool.add_sequence("b", [1, 2, 3, 4, 5]) == 4
    assert pool.stats().host_hit_tokens == 4
    assert pool.prefetch("b") == 2 and pool.prefetch("b") == 0
    kb, vb = pool.gather(0, "b")
    assert torch.equal(kb, ka[:4]) and torch.equal(vb, -ka[:4])
    st = pool.stats()
    assert st.onloads == 2 and st.prefetches == 2


def test_onload_without_prefetch_happens_on_first_use():
    pool = make()
    fill(pool, "a", [1, 2, 3])
    pool.free("a")
    pool.evict()
    assert pool.add_sequence("b", [1, 2, 3]) == 2
    bt = pool.block_table(["b"])  # data needed now: copied before the table is handed out
    assert pool.stats().onloads == 1 and pool.stats().prefetches == 0
    assert bt.tolist() == [pool.blocks_of("b")]


def test_host_lru_drops_oldest_when_full():
    pool = make(num_blocks=4, host_blocks=2)
    for sid, base in (("a", 10), ("b", 20)):
        fill(pool, sid, [base, base + 1, base + 2])
        pool.free(sid)
        pool.evict()
    st = pool.stats()
    assert st.offloads == 2 and st.host_evictions == 0
    fill(pool, "c", [30, 31, 32])
    pool.free("c")
    pool.evict()
    assert pool.stats().host_evictions == 1
    assert pool.add_sequence("a2", [10, 11, 12]) == 0  # oldest was dropped
    assert pool.add_sequence("b2", [20, 21, 22]) == 2


def test_exhaustion_with_host_tier_is_clean():
    pool = make(num_blocks=2, host_blocks=2)
    fill(pool, "a", [1, 2, 3])
    pool.free("a")
    pool.evict()
    fill(pool, "z", [5, 6, 7])  # both device blocks in use
    before = (pool.manager.snapshot(), pool.stats(), sorted(pool.host.lru.items()))
    with pytest.raises(kvpool.PoolExhaustedError):
        pool.add_sequence("b", [1, 2, 3])
    assert (pool.manager.snapshot(), pool.stats(), sorted(pool.host.lru.items())) == before
