"""get_dispatch_layout against a plain-Python reference (hypothesis over routings)."""

import pytest
import torch
from deepep.dispatcher import send_order
from deepep.fp8 import per_token_cast_back, per_token_cast_to_fp8
from deepep.layout import compute_layout
from hypothesis import given, settings
from hypothesis import strategies as st
from tilehal import ShapeError


@st.composite
def routings(draw):
    ranks = draw(st.sampled_from([1, 2, 4, 8]))
    per_node = draw(st.sampled_from([r for r in (1, 2, 4, 8) if r <= ranks and ranks % r == 0]))
    experts = ranks * draw(st.integers(1, 4))
    k = draw(st.integers(1, min(8, experts)))
    tokens = draw(st.integers(0, 12))
    rows = draw(st.lists(st.lists(st.integers(-1, experts - 1), min_size=k, max_size=k),
                         min_size=tokens, max_size=tokens))
    return ranks, per_node, experts, torch.tensor(rows, dtype=torch.int64).view(tokens, k)


@settings(max_examples=150, deadline=None)
@given(routings())
def test_layout_matches_reference(case):
    ranks, per_node, experts, idx = case
    lay = compute_layout(idx, experts, ranks, per_node)
    epr = experts // ranks
    per_expert = [0] * experts
    in_rank = [[False] * ranks for _ in range(idx.shape[0])]
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // epr] = True
    assert lay.num_tokens_per_expert.tolist() == per_expert
    assert lay.is_token_in_rank.tolist() == (in_rank if in_rank else [])
    assert lay.num_tokens_per_rank.tolist() == [sum(r[i] for r in in_rank) for i in range(ranks)]
    assert lay.num_tokens_per_rank.dtype == lay.num_tokens_per_expert.dtype == torch.int32
    if per_node < ranks:
        nodes = ranks // per_node
        want = [sum(any(r[n * per_node:(n + 1) * per_node]) for r in in_rank) for n in range(nodes)]
        assert lay.num_tokens_per_rdma_rank.tolist() == want
    else:
        assert lay.num_tokens_per_rdma_rank is None
    # the send order groups tokens by destination rank, in token order
    tok, counts = send_order(lay.is_token_in_rank)
    want_tok = [t for r in range(ranks) for t in range(idx.shape[0]) if in_rank[t][r]]
    assert tok.tolist() == want_tok and sum(counts) == len(want_tok)


def test_layout_rejects_bad_input():
    with pytest.raises(ShapeError, match="topk_idx.*int64"):
        compute_layout(torch.zeros(2, 2, dtype=torch.int32), 4, 2, 2)
    with pytest.raises(ShapeError, match=r"\[-1, 4\)"):
        compute_layout(torch.full((2, 2), -2, dtype=torch.int64), 4, 2, 2)
    with pytest.raises(ValueError, match="num_experts"):
        compute_layout(torch.zeros(2, 2, dtype=torch.int64), 5, 2, 2)


def test_fp8_cast_round_trip():
    x = torch.randn(5, 256) * torch.logspace(-3, 3, 5).view(5, 1)
    q, s = per_token_cast_to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    back = per_token_cast_back(q, s)
    assert ((back - x).abs() <= x.abs() / 16 + s.repeat_interleave(128, 1) * 2 ** -9 + 1e-9).all()
