import numpy as np
import pytest
import torch
from dataengine.data import (
    LengthScorer,
    MinHashLSH,
    ModelLossScorer,
    NGramRepetitionScorer,
    jaccard,
    score_dataset,
)


def test_ngram_repetition_reference():
    rep = NGramRepetitionScorer(2)
    assert rep(np.array([1, 2, 3, 4, 5])) == 0.0
    # Bigrams: (1,2) (2,1) (1,2) (2,1) (1,2): 2 unique of 5.
    assert rep(np.array([1, 2, 1, 2, 1, 2])) == pytest.approx(1 - 2 / 5)
    assert rep(np.array([7])) == 0.0


def test_model_loss_scorer_matches_manual_cross_entropy():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 50)
    model = lambda ids: emb(ids)  # logits = embedding rows  # noqa: E731
    t = np.array([3, 9, 4, 4, 17, 2])
    logits = emb(torch.tensor(t)).double()
    want = -torch.log_softmax(logits[:-1], -1)[torch.arange(5), torch.tensor(t[1:])].mean().item()
    assert ModelLossScorer(model)(t) == pytest.approx(want, rel=1e-5)
    assert ModelLossScorer(model, perplexity=True)(t) == pytest.approx(np.exp(want), rel=1e-5)
    with pytest.raises(ValueError, match="model output: expected logits"):
        ModelLossScorer(lambda ids: torch.zeros(1, 2))(t)


def test_score_dataset(small_dataset):
    ds, samples, _ = small_dataset
    np.testing.assert_array_equal(score_dataset(ds, LengthScorer(), progress=False), [len(s) for s in samples])
    rep = score_dataset(ds, NGramRepetitionScorer(3), ids=[0, 1, 7], progress=False)
    assert rep[0] > 0.5 and rep[2] > 0.5 or len(samples[0]) < 6  # samples 0 and 7 are loops


def test_minhash_finds_near_duplicates_only():
    rng = np.random.default_rng(0)
    base = [rng.integers(0, 30000, 300) for _ in range(40)]
    docs = list(base)
    for k in range(10):  # near copies: 3 token substitutions each
        d = base[k].copy()
        d[rng.integers(0, 300, 3)] = rng.integers(0, 30000, 3)
        docs.append(d)
    lsh = MinHashLSH(num_perm=128, bands=32, ngram=5, threshold=0.7)
    keep = lsh.keep_mask(docs, progress=False)
    assert keep[:40].all() and not keep[40:].any()
    sigs = lsh.signatures(docs[:2] + [docs[40]], progress=False)
    est = float(np.mean(sigs[0] == sigs[2]))
    assert abs(est - jaccard(docs[0], docs[40])) < 0.15
    assert float(np.mean(sigs[0] == sigs[1])) < 0.1
    with pytest.raises(ValueError, match="bands"):
        MinHashLSH(num_perm=100, bands=16)
