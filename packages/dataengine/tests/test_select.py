import pytest
import torch
from dataengine.select import quest_scores, select_blocks, topk_blocks
from hypothesis import given, settings
from hypothesis import strategies as st


def _true_scores(q, k, Hkv):
    # q [Hq, D], k [n, Hkv, D] -> [Hkv, group, n] exact dot products.
    Hq, D = q.shape
    return torch.einsum("hgd,nhd->hgn", q.reshape(Hkv, Hq // Hkv, D).double(), k.double())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_quest_bound_upper_bounds_every_key(paged, seed):
    q, keys, kmin, kmax, table, lens, _ = paged(seed)
    bound = quest_scores(q, kmin, kmax, table, lens, block_size=4)
    for b, k in enumerate(keys):
        s = _true_scores(q[b], k, 2).amax(1)  # max over the group, as reduce="max"
        for lb in range(-(-k.shape[0] // 4)):
            blk = s[:, lb * 4:(lb + 1) * 4].amax(-1)
            assert bool((bound[b, :, lb].double() >= blk - 1e-4).all())
        assert bool(torch.isinf(bound[b, :, -(-k.shape[0] // 4):]).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), top_k=st.integers(1, 12), sink=st.integers(0, 2), local=st.integers(0, 2))
def test_max_key_block_kept_or_outranked(paged, seed, top_k, sink, local):
    q, keys, kmin, kmax, table, lens, _ = paged(seed)
    sel = select_blocks(q, kmin, kmax, table, lens, top_k, sink, local)
    bound = quest_scores(q, kmin, kmax, table, lens)
    for b, k in enumerate(keys):
        nb = -(-k.shape[0] // 4)
        s = _true_scores(q[b], k, 2).amax(1)
        for h in range(2):
            chosen = [int(x) for x in sel[b, h] if x >= 0]
            assert chosen == sorted(set(chosen))
            forced = {p for p in range(nb) if p < sink or p >= nb - local}
            assert forced <= set(chosen)
            assert len(chosen) == min(nb, max(top_k, sink + local))
            best = int(s[h].argmax()) // 4
            if best not in chosen:
                # Quest's guarantee: every freely chosen block bounds at least the true max score.
                free = [p for p in chosen if p not in forced]
                assert all(float(bound[b, h, p]) >= float(s[h].max()) - 1e-4 for p in free)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_needle_block_always_selected(paged, seed):
    # The needle's true score is at least twice any other block's Quest bound (see conftest's
    # paged_summaries), and its own block's bound is >= its score, so that block outranks every block
    # without it and takes the one free slot of the budget (3 = sink 1 + local 1 + 1) whenever it is
    # not forced.
    q, keys, kmin, kmax, table, lens, pos = paged(seed, needle=2.0)
    sel = select_blocks(q, kmin, kmax, table, lens, top_k=3, sink_blocks=1, local_blocks=1)
    for b, k in enumerate(keys):
        s = _true_scores(q[b], k, 2)[:, 0]  # the needle was planted for the first q head of each group
        for h in range(2):
            assert int(s[h].argmax()) == pos[b]  # the premise: the needle is the top-scoring key
            assert pos[b] // 4 in sel[b, h].tolist()


def test_all_blocks_when_budget_covers_them(paged):
    q, keys, kmin, kmax, table, lens, _ = paged(3)
    sel = select_blocks(q, kmin, kmax, table, lens, top_k=50)
    assert sel.shape == (2, 2, 10) and sel.dtype == torch.int32
    assert sel[0, 0].tolist() == list(range(10))
    assert sel[1, 1].tolist() == list(range(6)) + [-1] * 4


def test_empty_sequence_and_forced_budget(paged):
    q, keys, kmin, kmax, table, lens, _ = paged(4)
    lens2 = lens.clone()
    lens2[1] = 0
    sel = select_blocks(q, kmin, kmax, table, lens2, top_k=1, sink_blocks=2, local_blocks=1, block_size=4)
    assert sel.shape == (2, 2, 3)
    assert sel[0, 0].tolist() == [0, 1, 9] and sel[1].eq(-1).all()


def test_errors_name_the_argument(paged):
    q, keys, kmin, kmax, table, lens, _ = paged(5)
    with pytest.raises(ValueError, match="q: expected q_heads divisible by kv_heads"):
        select_blocks(q[:, :3], kmin, kmax, table, lens, 2)
    with pytest.raises(ValueError, match="block_table: expected dtype int32 or int64"):
        select_blocks(q, kmin, kmax, table.float(), lens, 2)
    with pytest.raises(ValueError, match="block_table: expected physical ids < num_blocks"):
        select_blocks(q, kmin, kmax, table + 100, lens, 2)
    with pytest.raises(ValueError, match="kmax: expected shape"):
        select_blocks(q, kmin, kmax[:3], table, lens, 2)
    with pytest.raises(ValueError, match="top_k"):
        select_blocks(q, kmin, kmax, table, lens, 0)
    with pytest.raises(ValueError, match="seq_lens: expected shape"):
        select_blocks(q, kmin, kmax, table, lens[:1], 2)


def test_topk_blocks_nsa_style():
    s = torch.tensor([[[0.5, 0.1, 0.9, 0.3, float("-inf")]], [[0.2, 0.8, 0.1, 0.7, 0.6]]])
    out = topk_blocks(s, 2)
    assert out.tolist() == [[[0, 2]], [[1, 3]]]
    out = topk_blocks(s, 3, num_valid=torch.tensor([4, 3]), sink_blocks=1, local_blocks=1)
    assert out.tolist() == [[[0, 2, 3]], [[0, 1, 2]]]
    assert topk_blocks(torch.tensor([float("-inf"), 1.0]), 2).tolist() == [1, -1]
    with pytest.raises(ValueError, match="NaN"):
        topk_blocks(torch.tensor([float("nan")]), 1)


def test_unwritten_blocks_score_minus_inf_not_nan(paged):
    q, keys, kmin, kmax, table, lens, _ = paged(6)
    q[:, :, 0] = 0.0  # a zero channel would turn 0 * inf into NaN
    phys = int(table[0, 3])
    kmin[phys], kmax[phys] = float("inf"), float("-inf")
    s = quest_scores(q, kmin, kmax, table, lens)
    assert not torch.isnan(s).any() and bool(torch.isneginf(s[0, :, 3]).all())
    sel = select_blocks(q, kmin, kmax, table, lens, top_k=4, sink_blocks=1, local_blocks=1)
    assert 3 not in sel[0].flatten().tolist()
