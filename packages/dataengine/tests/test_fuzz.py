"""Fuzz dataengine's argument handling: random shapes, dtypes, strides and values (NaN, Inf, negative,
sizes 0 and 1). Each call either matches an independent reference or raises a TileStackError that
names the argument; never a raw numpy/torch exception, never a silently wrong result."""

import math

import numpy as np
import pytest
import torch
from dataengine import BlockMask, pack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilehal import TileStackError

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SPECIAL = [0, 1, 5, 2**31, -1, 1.5, math.nan, math.inf]


@st.composite
def token_seq(draw):
    kind = draw(st.sampled_from(["int64", "int32", "uint16", "float64", "bool", "list", "tensor", "strided", "2d"]))
    n = draw(st.integers(0, 7))
    if kind == "list":
        return draw(st.lists(st.sampled_from(SPECIAL), min_size=n, max_size=n))
    vals = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    if kind == "float64":
        arr = np.array(vals, dtype=np.float64)
        if n:
            arr[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf, 2.5]))
        return arr
    if kind == "bool":
        return np.array(vals, dtype=bool)
    if kind == "tensor":
        return torch.tensor(vals, dtype=torch.int64)
    if kind == "strided":
        return np.array(vals * 2, dtype=np.int64)[::2]
    if kind == "2d":
        return np.array(vals, dtype=np.int64).reshape(1, -1)
    return np.array(vals, dtype=kind)


def _names_argument(e: Exception, *names: str) -> bool:
    head = str(e).split(":")[0]
    return any(n in head for n in names)


@FUZZ
@given(samples=st.lists(token_seq(), max_size=5), row_len=st.sampled_from([0, 1, 3, 8, 2.5, -1]),
       overlong=st.sampled_from(["error", "truncate", "split"]))
def test_pack_keeps_every_token_or_names_the_argument(samples, row_len, overlong):
    try:
        pb = pack(samples, row_len, overlong=overlong)
    except TileStackError as e:
        assert _names_argument(e, "samples", "row_len", "lengths"), str(e)
        return
    except Exception as e:  # pragma: no cover - what this test exists to catch
        pytest.fail(f"raw {type(e).__name__}: {e}")
    # Reference: each sample, as exact integers, cut like `overlong` says.
    want = []
    for s in samples:
        ids = [int(x) for x in (s.tolist() if hasattr(s, "tolist") else s)]
        assert all(float(x) == x for x in (s.tolist() if hasattr(s, "tolist") else s))  # no float was truncated
        if overlong == "truncate":
            ids = ids[:row_len]
        want.extend(ids)
    got = [int(t) for r in range(pb.tokens.shape[0]) for t, d in zip(pb.tokens[r], pb.doc_ids[r]) if d >= 0]
    assert sorted(got) == sorted(want)
    assert pb.tokens.shape[1] == row_len


def _reference_doc_mask(doc: torch.Tensor, bs: int, causal: bool) -> torch.Tensor:
    B, L = doc.shape
    allowed = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    if causal:
        allowed &= torch.tril(torch.ones(L, L, dtype=torch.bool))
    nb = -(-L // bs)
    pad = torch.zeros(B, nb * bs, nb * bs, dtype=torch.bool)
    pad[:, :L, :L] = allowed
    return pad.reshape(B, nb, bs, nb, bs).any(dim=(2, 4))


@FUZZ
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=4), pad=st.integers(0, 3),
       bs=st.sampled_from([1, 2, 3, 4, 0, -2]), causal=st.booleans(),
       corrupt=st.sampled_from([None, "nan", "neg", "shuffle", "1d", "float"]), batch=st.integers(1, 2))
def test_doc_mask_matches_the_element_reference_or_names_the_argument(lengths, pad, bs, causal, corrupt, batch):
    row = [d for d, n in enumerate(lengths) for _ in range(n)] + [-1] * pad
    doc = torch.tensor([row] * batch, dtype=torch.long)
    if corrupt == "nan":
        doc = doc.double()
        if doc.numel():
            doc[0, 0] = math.nan
    elif corrupt == "neg" and doc.numel():
        doc[0, -1] = -5
    elif corrupt == "shuffle" and doc.shape[1] > 1:
        doc = doc.flip(1)
    elif corrupt == "1d":
        doc = doc[0]
    elif corrupt == "float":
        doc = doc.float()
    try:
        m = BlockMask.from_doc_ids(doc, bs, causal)
    except TileStackError as e:
        assert _names_argument(e, "doc_ids", "block_size"), str(e)
        return
    except Exception as e:  # pragma: no cover
        pytest.fail(f"raw {type(e).__name__}: {e}")
    assert bs >= 1 and doc.dim() == 2 and not doc.is_floating_point()
    ref = _reference_doc_mask(doc, bs, causal)
    assert torch.equal(m.to_dense()[:, 0], ref)


@FUZZ
@given(scores=st.lists(st.sampled_from([0.0, 1.0, -2.0, math.inf, -math.inf, math.nan, 3.5]), min_size=1,
                       max_size=6), k=st.sampled_from([1, 2, 3, 0, -1, 1.5]))
def test_topk_picks_the_k_best_finite_blocks_or_names_the_argument(scores, k):
    t = torch.tensor(scores).view(1, 1, 1, -1)
    n = len(scores)
    try:
        m = BlockMask.topk(t, k, 4, 4 * n, block_size=4)
    except TileStackError as e:
        assert _names_argument(e, "block_scores", "k"), str(e)
        return
    except Exception as e:  # pragma: no cover
        pytest.fail(f"raw {type(e).__name__}: {e}")
    assert not any(math.isnan(x) for x in scores)
    chosen = m.to_dense()[0, 0, 0].tolist()
    allowed = [i for i, x in enumerate(scores) if x > -math.inf]
    assert sum(chosen) == min(k, len(allowed))
    worst_chosen = min((scores[i] for i in range(n) if chosen[i]), default=math.inf)
    assert all(scores[i] <= worst_chosen for i in range(n) if not chosen[i])
