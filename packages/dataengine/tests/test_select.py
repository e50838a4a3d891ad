import pytest
import torch
from dataengine.select import quest_scores, select_blocks, topk_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

KEY_CLIP = 3.0  # with a needle, the other keys are clipped to [-KEY_CLIP, KEY_CLIP]


def _paged(seed, B=2, Hq=8, Hkv=2, D=16, bs=4, lens=(37, 21), num_blocks=40, needle=None, needle_pos=None):
    """Random paged keys; kmin/kmax computed over each block's filled tokens (what kvpool keeps).

    With `needle` (a margin > 1), each sequence gets one key per kv head along its group's first
    q head, strong enough that its true score beats the Quest bound of every block without it:
    any other block's keys lie in [-KEY_CLIP, KEY_CLIP], so its bound for q head h is at most
    KEY_CLIP * |q_h|_1; the needle scores c * |q_0|^2 with c = needle * KEY_CLIP * max_h |q_h|_1 / |q_0|^2.
    Its position per sequence is appended to `needle_pos` when a list is given.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g)
    max_blocks = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    keys = []  # per sequence [len, Hkv, D]
    kmin = torch.zeros(num_blocks, Hkv, D)
    kmax = torch.zeros(num_blocks, Hkv, D)
    used = 0
    for b, n in enumerate(lens):
        k = torch.randn(n, Hkv, D, generator=g)
        if needle is not None:
            k = k.clamp(-KEY_CLIP, KEY_CLIP)
            pos = int(torch.randint(0, n, (1,), generator=g))
            qg = q[b].reshape(Hkv, Hq // Hkv, D)
            c = needle * KEY_CLIP * qg.abs().sum(-1).amax(-1) / qg[:, 0].square().sum(-1)  # [Hkv]
            k[pos] = c[:, None] * qg[:, 0]
            if needle_pos is not None:
                needle_pos.append(pos)
        keys.append(k)
        for lb in range(-(-n // bs)):
            phys = int(perm[used])
            used += 1
            table[b, lb] = phys
            chunk = k[lb * bs:(lb + 1) * bs]
            kmin[phys], kmax[phys] = chunk.amin(0), chunk.amax(0)
    return q, keys, kmin, kmax, table, torch.tensor(lens, dtype=torch.int32)


def _true_scores(q, k, Hkv):
    # q [Hq, D], k [n, Hkv, D] -> [Hkv, group, n] exact dot products.
    Hq, D = q.shape
    return torch.einsum("hgd,nhd->hgn", q.reshape(Hkv, Hq // Hkv, D).double(), k.double())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_quest_bound_upper_bounds_every_key(seed):
    q, keys, kmin, kmax, table, lens = _paged(seed)
    bound = quest_scores(q, kmin, kmax, table, lens, block_size=4)
    for b, k in enumerate(keys):
        s = _true_scores(q[b], k, 2).amax(1)  # max over the group, as reduce="max"
        for lb in range(-(-k.shape[0] // 4)):
            blk = s[:, lb * 4:(lb + 1) * 4].amax(-1)
            assert bool((bound[b, :, lb].double() >= blk - 1e-4).all())
        assert bool(torch.isinf(bound[b, :, -(-k.shape[0] // 4):]).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), top_k=st.integers(1, 12), sink=st.integers(0, 2), local=st.integers(0, 2))
def test_max_key_block_kept_or_outranked(seed, top_k, sink, local):
    q, keys, kmin, kmax, table, lens = _paged(seed)
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
def test_needle_block_always_selected(seed):
    # The needle's true score is at least twice any other block's Quest bound (see _paged), and
    # its own block's bound is >= its score, so that block outranks every block without it and
    # takes the one free slot of the budget (3 = sink 1 + local 1 + 1) whenever it is not forced.
    pos = []
    q, keys, kmin, kmax, table, lens = _paged(seed, needle=2.0, needle_pos=pos)
    sel = select_blocks(q, kmin, kmax, table, lens, top_k=3, sink_blocks=1, local_blocks=1)
    for b, k in enumerate(keys):
        s = _true_scores(q[b], k, 2)[:, 0]  # the needle was planted for the first q head of each group
        for h in range(2):
            assert int(s[h].argmax()) == pos[b]  # the premise: the needle is the top-scoring key
            assert pos[b] // 4 in sel[b, h].tolist()


def test_all_blocks_when_budget_covers_them():
    q, keys, kmin, kmax, table, lens = _paged(3)
    sel = select_blocks(q, kmin, kmax, table, lens, top_k=50)
    assert sel.shape == (2, 2, 10) and sel.dtype == torch.int32
    assert sel[0, 0].tolist() == list(range(10))
    assert sel[1, 1].tolist() == list(range(6)) + [-1] * 4


def test_empty_sequence_and_forced_budget():
    q, keys, kmin, kmax, table, lens = _paged(4)
    lens2 = lens.clone()
    lens2[1] = 0
    sel = select_blocks(q, kmin, kmax, table, lens2, top_k=1, sink_blocks=2, local_blocks=1, block_size=4)
    assert sel.shape == (2, 2, 3)
    assert sel[0, 0].tolist() == [0, 1, 9] and sel[1].eq(-1).all()


def test_errors_name_the_argument():
    q, keys, kmin, kmax, table, lens = _paged(5)
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


def test_unwritten_blocks_score_minus_inf_not_nan():
    q, keys, kmin, kmax, table, lens = _paged(6)
    q[:, :, 0] = 0.0  # a zero channel would turn 0 * inf into NaN
    phys = int(table[0, 3])
    kmin[phys], kmax[phys] = float("inf"), float("-inf")
    s = quest_scores(q, kmin, kmax, table, lens)
    assert not torch.isnan(s).any() and bool(torch.isneginf(s[0, :, 3]).all())
    sel = select_blocks(q, kmin, kmax, table, lens, top_k=4, sink_blocks=1, local_blocks=1)
    assert 3 not in sel[0].flatten().tolist()
