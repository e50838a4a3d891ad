"""The pool cannot be poisoned (issue 16, item 5) and its arguments fail with errors that name them
(items 6-7). Each test here failed before the write-path checks existed."""

import math

import kvpool
import numpy as np
import pytest
import torch
from kvpool.errors import OutOfRangeError, SlotOwnershipError, UnknownSequenceError
from tilehal import ArgumentError, ShapeError, TileStackError


def pool_of(dtype=torch.float32, debug=False, **kw):
    args = dict(num_blocks=16, block_size=4, dtype=dtype, watermark=0.0, debug=debug)
    args.update(kw)
    return kvpool.KVPool(1, 1, 4, **args)


def kv(n, value):
    x = torch.full((n, 1, 4), float(value))
    return x, -x


def test_writing_another_live_sequences_slot_is_refused():
    pool = pool_of()
    pool.add_sequence("a", list(range(3)))
    pool.add_sequence("b", list(range(100, 103)))
    sa, sb = pool.append("a", 3), pool.append("b", 3)
    pool.write(0, sa, *kv(3, 1.0), seq_id="a")
    pool.write(0, sb, *kv(3, 2.0), seq_id="b")
    with pytest.raises(SlotOwnershipError, match="slots: expected slots of 'a'"):
        pool.write(0, sb, *kv(3, 9.0), seq_id="a")
    assert torch.all(pool.gather(0, "b")[0] == 2.0)


def test_a_freed_but_cached_block_cannot_be_overwritten():
    pool = pool_of()
    prompt = list(range(9))
    pool.add_sequence("a", prompt)
    s = pool.append("a", 9)
    k = torch.arange(9 * 4, dtype=torch.float32).view(9, 1, 4)
    pool.write(0, s, k, k)
    pool.free("a")
    for debug in (False, True):
        pool.debug = debug
        with pytest.raises(SlotOwnershipError, match="free .its cached prefix stays matchable"):
            pool.write(0, s[:4], *kv(4, 666.0))
    assert pool.add_sequence("b", prompt) == 8
    torch.testing.assert_close(pool.gather(0, "b")[0], k[:8])


def test_shared_prefix_blocks_are_read_only():
    pool = pool_of()
    pool.add_sequence("a", list(range(5)))
    s = pool.append("a", 5)
    pool.write(0, s, *kv(5, 1.0))
    pool.add_sequence("b", list(range(5)))  # shares block 0
    with pytest.raises(SlotOwnershipError, match="shared by 2 sequences"):
        pool.write(0, s[:4], *kv(4, 5.0))
    pool.free("b")
    with pytest.raises(SlotOwnershipError, match="a prefix-cache block any later prompt may match"):
        pool.write(0, s[:4], *kv(4, 5.0))  # unshared again, but matchable by the next prompt
    pool.write(0, s[4:], *kv(1, 5.0))  # the partial last block stays the owner's
    assert torch.all(pool.gather(0, "a")[0][:4] == 1.0)


def test_append_fork_then_write_reaches_every_fork():
    """The order a generation step uses (tilestack.hf's parallel sampling): unwritten positions of a
    block shared right after append may be written once, and every fork sees them."""
    pool = pool_of()
    pool.add_sequence("a", [1, 2, 3])
    s = pool.append("a", 3)
    pool.fork("a", "b")
    pool.write(0, s, *kv(3, 4.0))
    assert torch.all(pool.gather(0, "b")[0] == 4.0)
    with pytest.raises(SlotOwnershipError, match="shared by 2"):
        pool.write(0, s, *kv(3, 5.0))


@pytest.mark.parametrize("bad", [-1, 64, 10**9, -(2**40)])
def test_out_of_range_slots_name_the_argument_without_debug(bad):
    pool = pool_of(debug=False)
    pool.add_sequence("a", [1])
    pool.append("a", 1)
    with pytest.raises(OutOfRangeError, match=r"slots: expected values in \[0, 64\)") as info:
        pool.write(0, torch.tensor([bad]), *kv(1, 1.0))
    assert isinstance(info.value, IndexError) and isinstance(info.value, ValueError)


def test_duplicate_slots_in_one_write_are_refused():
    pool = pool_of()
    pool.add_sequence("a", [1, 2])
    s = pool.append("a", 2)
    with pytest.raises(ArgumentError, match="slots: expected distinct"):
        pool.write(0, torch.cat([s, s[:1]]), *kv(3, 1.0))


def test_one_inf_does_not_poison_an_fp8_block():
    pool = pool_of(dtype=torch.float8_e4m3fn)
    pool.add_sequence("a", [0, 1])
    s = pool.append("a", 2)
    k = torch.tensor([[[1.0, -2.0, 3.0, 0.5]], [[2.0, 0.25, -1.0, 4.0]]])
    pool.write(0, s, k, k)
    pool.fork("a", "b")  # a second sequence shares the block
    inf = torch.tensor([[[math.inf, 1.0, math.nan, -math.inf]]])
    pool.write(0, pool.append("b", 1), inf, inf)  # copy-on-write: into b's own copy
    pool.write(0, pool.append("a", 1), inf, inf)  # into a's block
    for sid in ("a", "b"):
        got = pool.gather(0, sid)[0]
        torch.testing.assert_close(got[:2], k)  # the earlier tokens are intact
        assert got[2, 0, 0] == 7.0 and got[2, 0, 1] == 1.0 and math.isnan(got[2, 0, 2]) and got[2, 0, 3] == -7.0
    # Into a block nobody shares: same result.
    pool2 = pool_of(dtype=torch.float8_e4m3fn)
    pool2.add_sequence("x", [1, 2, 3])
    s2 = pool2.append("x", 3)
    pool2.write(0, s2[:2], k, k)
    pool2.write(0, s2[2:], inf, inf)
    torch.testing.assert_close(pool2.gather(0, "x")[0][:2], k)


def _decode_setup():
    pool = pool_of(num_blocks=8)
    pool.add_sequence(0, list(range(6)))
    pool.write(0, pool.append(0, 6), *kv(6, 1.0))
    return pool, pool.block_table([0]), pool.seq_lens([0]), torch.randn(1, 1, 4)


def test_paged_decode_refuses_seq_lens_past_the_written_tokens():
    pool, bt, sl, q = _decode_setup()
    pool.append(0, 1)  # appended but never written: its slot holds an earlier owner's K/V
    with pytest.raises(OutOfRangeError, match=r"seq_lens\[0\]: expected at most the tokens written"):
        kvpool.paged_decode(q, pool, 0, pool.block_table([0]), pool.seq_lens([0]))
    with pytest.raises(OutOfRangeError, match=r"seq_lens\[0\]"):
        kvpool.paged_decode(q, pool, 0, bt, torch.tensor([-1], dtype=torch.int32))


def test_paged_decode_refuses_block_ids_past_the_pool():
    pool, bt, sl, q = _decode_setup()
    bad = bt.clone()
    bad[0, 0] = 8
    with pytest.raises(OutOfRangeError, match=r"block_table: expected block ids in \[-1, 8\)"):
        kvpool.paged_decode(q, pool, 0, bad, sl)
    bad[0, 0] = -5
    with pytest.raises(OutOfRangeError, match="block_table"):
        kvpool.paged_decode(q, pool, 0, bad, sl)


def test_paged_decode_refuses_out_of_table_and_repeated_block_indices():
    pool, bt, sl, q = _decode_setup()
    with pytest.raises(OutOfRangeError, match=r"block_indices: expected logical block positions in \[-1, 2\)"):
        kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=torch.tensor([[0, 2]], dtype=torch.int32))
    with pytest.raises(ArgumentError, match="block_indices: expected no repeated block"):
        kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=torch.tensor([[1, 1]], dtype=torch.int32))
    ok = kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=torch.tensor([[1, -1]], dtype=torch.int32))
    assert ok.shape == q.shape


def test_paged_prefill_refuses_a_table_that_does_not_cover_seq_lens():
    pool, bt, sl, q = _decode_setup()
    holed = bt.clone()
    holed[0, 0] = -1
    with pytest.raises(OutOfRangeError, match=r"seq_lens\[0\]"):
        kvpool.paged_prefill(torch.randn(1, 1, 4), pool, 0, holed, sl, torch.tensor([0, 1]))


def test_unclear_errors_are_now_clear():
    pool = pool_of()
    pool.add_sequence("a", [1])
    s = pool.append("a", 1)
    with pytest.raises(ShapeError, match="k: expected a torch tensor"):
        pool.write(0, s, np.zeros((1, 1, 4), np.float32), torch.zeros(1, 1, 4))
    with pytest.raises(ArgumentError, match="layer: expected an int"):
        pool.write(0.0, s, *kv(1, 1.0))
    with pytest.raises(OutOfRangeError, match="layer"):
        pool.gather(3, "a")
    with pytest.raises(UnknownSequenceError, match="seq_id: 'zz'") as info:
        pool.gather(0, "zz")
    assert isinstance(info.value, KeyError) and str(info.value).startswith("seq_id")
    with pytest.raises(ArgumentError, match="seq_id: expected a hashable"):
        pool.append(["unhashable"], 1)
    with pytest.raises(ShapeError, match="slots: expected a 1-D int32/int64"):
        pool.write(0, [0.5], *kv(1, 1.0))
    with pytest.raises(ArgumentError, match="block_size"):
        kvpool.KVPool(1, 1, 4, 8, block_size=0)
    with pytest.raises(ArgumentError, match="tokens"):
        pool.add_sequence("b", [[1, 2]])
    with pytest.raises(ArgumentError, match="tokens"):
        pool.add_sequence("c", np.array([2**63], dtype=np.uint64))
    for err in (ArgumentError, OutOfRangeError, SlotOwnershipError, UnknownSequenceError):
        assert issubclass(err, TileStackError)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_blocks=2.5), "num_blocks"), (dict(block_size=True), "block_size"), (dict(host_blocks=-1), "host_blocks"),
    (dict(watermark=float("nan")), "watermark"), (dict(watermark="0.1"), "watermark"), (dict(dtype="bf16"), "dtype"),
    (dict(device="gpu:x"), "device"), (dict(dtype=torch.int8), "dtype"),
])
def test_constructor_arguments_name_themselves(kwargs, name):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8)
    args.update(kwargs)
    with pytest.raises(ArgumentError, match=name):
        kvpool.KVPool(**args)


def test_batch_and_evict_counts_are_checked():
    pool = pool_of()
    pool.add_sequence("a", [1])
    with pytest.raises(ArgumentError, match="num_tokens"):
        pool.append_batch(["a"], [1.5])
    with pytest.raises(ArgumentError, match="num_tokens"):
        pool.append_batch(["a"], -1)
    with pytest.raises(ArgumentError, match="num_blocks"):
        pool.evict(-2)


def test_device_slots_keep_every_check():
    # write() checks slots uploaded by device_slots on their host copy: same verdicts as host slots
    pool = kvpool.KVPool(1, 2, 16, 8, block_size=4, prefix_caching=False)
    pool.add_sequence(0, [1])
    slots = pool.append(0, 3)
    k = torch.zeros(3, 2, 16)
    pool.write(0, pool.device_slots(slots), k, k)
    bad = pool.device_slots(torch.tensor([0, 0, 1]))
    with pytest.raises(ArgumentError, match="distinct"):
        pool.write(0, bad, k, k)
    with pytest.raises(OutOfRangeError):
        pool.write(0, pool.device_slots(torch.tensor([0, 1, 99])), k, k)
    free = pool.device_slots(torch.tensor([8, 9, 10]))  # block 2: never allocated
    with pytest.raises(SlotOwnershipError):
        pool.write(0, free, k, k)
    d = pool.device_slots(slots)
    d.add_(0)  # modified in place after upload: the host copy is no longer trusted, the tensor is read
    pool.write(0, d, k, k)


@pytest.mark.gpu
def test_device_slots_write_needs_no_sync():
    pool = kvpool.KVPool(2, 2, 64, 16, block_size=16, device="cuda", prefix_caching=False)
    pool.add_sequence(0, [1])
    slots = pool.device_slots(pool.append(0, 5))
    k = torch.randn(5, 2, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(2):
            pool.write(layer, slots, k, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(pool.k_cache[1, 0, :5].float().cpu(), k.cpu().to(pool.dtype).float())
