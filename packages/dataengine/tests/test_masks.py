import pytest
import torch
from dataengine.masks import BlockMask
from hypothesis import given, settings
from hypothesis import strategies as st


def _blocks_of(allowed, bq, bk):
    # Independent reference: loop over blocks and ask whether any pair inside is allowed.
    Lq, Lk = allowed.shape
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    out = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            out[i, j] = allowed[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
    return out


def _window_elements(Lq, Lk, window):
    i = torch.arange(Lq)[:, None] + (Lk - Lq)
    j = torch.arange(Lk)[None, :]
    ok = j <= i
    if window is not None:
        ok &= (i - j) < window
    return ok


@settings(max_examples=40, deadline=None)
@given(Lq=st.integers(1, 70), extra=st.integers(0, 40), bs=st.sampled_from([4, 8, 16]),
       window=st.one_of(st.none(), st.integers(1, 50)))
def test_causal_and_window_match_element_reference(Lq, extra, bs, window):
    Lk = Lq + extra
    m = BlockMask.sliding_window(Lq, Lk, window, bs, batch=2, heads=3)
    ref = _blocks_of(_window_elements(Lq, Lk, window), bs, bs)
    assert torch.equal(m.to_dense(), ref.expand(2, 3, -1, -1))
    assert m.kv_indices.dtype == torch.int32 and m.kv_num_blocks.dtype == torch.int32
    # Compact form: ascending indices, then -1 padding.
    for row, n in zip(m.kv_indices.reshape(-1, m.kv_indices.shape[-1]), m.kv_num_blocks.reshape(-1)):
        present = row[: int(n)]
        assert bool((present[1:] > present[:-1]).all()) and bool((row[int(n):] == -1).all())


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=6), pad=st.integers(0, 9),
       bs=st.sampled_from([4, 8]), causal=st.booleans())
def test_document_mask_matches_reference(lens, pad, bs, causal):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    L = int(cu[-1]) + pad
    m = BlockMask.document(cu, bs, seq_len=L, causal=causal)
    doc = torch.full((L,), -1)
    for d in range(len(lens)):
        doc[int(cu[d]):int(cu[d + 1])] = d
    allowed = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if causal:
        allowed &= torch.tril(torch.ones(L, L, dtype=torch.bool))
    assert torch.equal(m.to_dense()[0, 0], _blocks_of(allowed, bs, bs))


def test_document_batch_of_rows():
    rows = [torch.tensor([0, 5, 16]), torch.tensor([0, 3])]
    m = BlockMask.document(rows, 4)
    assert m.to_dense().shape == (2, 1, 4, 4)
    assert not m.to_dense()[1, 0, 1:].any()  # row 1 is padding after 3 tokens


def test_and_or_against_dense():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 2, 5, 5, generator=g) > 0.5
    b = torch.rand(2, 2, 5, 5, generator=g) > 0.5
    ma, mb = BlockMask.from_dense(a, 20, 20, 4), BlockMask.from_dense(b, 20, 20, 4)
    assert torch.equal((ma & mb).to_dense(), a & b)
    assert torch.equal((ma | mb).to_dense(), a | b)
    assert torch.equal(ma.to_dense(), a)
    causal = BlockMask.causal(20, 20, 4)  # head-broadcast combines with per-head masks
    assert torch.equal((ma & causal).to_dense(), a & torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    with pytest.raises(ValueError, match="same block sizes"):
        ma & BlockMask.causal(20, 20, 5)


def test_topk_keeps_highest_and_skips_minus_inf():
    scores = torch.tensor([[[[0.1, 0.9, 0.5, float("-inf")], [float("-inf")] * 3 + [1.0]]]])
    m = BlockMask.topk(scores, 2, q_len=8, kv_len=16, block_size=4)
    assert m.kv_indices[0, 0, 0].tolist() == [1, 2, -1, -1]
    assert m.kv_indices[0, 0, 1].tolist() == [3, -1, -1, -1]
    assert m.kv_num_blocks.tolist() == [[[2, 1]]]


def test_element_mask_builder_and_to_dense_elements():
    allowed = _window_elements(10, 10, 3).unsqueeze(0)
    m = BlockMask.from_element_mask(allowed, 4)
    assert torch.equal(m.to_dense()[0, 0], _blocks_of(allowed[0], 4, 4))
    el = m.to_dense_elements()
    assert el.shape == (1, 1, 10, 10) and bool((el[0, 0] | ~allowed[0]).all())  # blocks cover every allowed pair
    assert 0.0 < m.sparsity() < 1.0
