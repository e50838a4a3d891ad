import numpy as np
import pytest
import torch
from dataengine.data import (
    ExponentiatedGradientWeights,
    Filter,
    LengthScorer,
    NGramRepetitionScorer,
    PositionTracker,
    ResumableLoader,
    StreamingDataset,
    merge_states,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FILTERS = [Filter(LengthScorer(), min_score=5), Filter(NGramRepetitionScorer(3), max_score=0.5)]


def _stream(ds, mode, rank=0, world=1):
    if mode == "shuffle":
        return StreamingDataset(ds, seed=3, filters=FILTERS, rank=rank, world_size=world, chunk=64)
    return StreamingDataset(ds, seed=3, domain_weights=[0.5, 0.3, 0.2], num_positions=900, filters=FILTERS,
                            rank=rank, world_size=world, chunk=64)


def _reference(ds, mode):
    return [(s["position"], s["sample_id"]) for s in _stream(ds, mode).iter_samples(0, 1)]


def test_shuffle_epoch_is_a_filtered_permutation(small_dataset):
    ds, samples, _ = small_dataset
    ref = _reference(ds, "shuffle")
    ids = [i for _, i in ref]
    assert len(ids) == len(set(ids))
    rep = NGramRepetitionScorer(3)
    want = {i for i, s in enumerate(samples) if len(s) >= 5 and rep(s) <= 0.5}
    assert set(ids) == want
    assert ids != sorted(ids)  # shuffled
    other = [s["sample_id"] for s in StreamingDataset(ds, seed=4, filters=FILTERS).iter_samples(0, 1)]
    assert other != ids


@pytest.mark.parametrize("mode", ["shuffle", "mixture"])
@pytest.mark.parametrize("consumers", [2, 3, 5])
def test_any_split_gives_the_same_sequence(small_dataset, mode, consumers):
    ds, *_ = small_dataset
    got = []
    for c in range(consumers):
        got += [(s["position"], s["sample_id"]) for s in _stream(ds, mode).iter_samples(c, consumers)]
    assert sorted(got) == _reference(ds, mode)


def _simulate(ds, mode, state, ranks, workers, steps, seed):
    """Consume `steps` samples from ranks x workers consumers progressing at random rates."""
    rng = np.random.default_rng(seed)
    C = ranks * workers
    trackers, iters = [], []
    for r in range(ranks):
        s = _stream(ds, mode, r, ranks)
        if state is not None:
            s.load_state_dict(state)
        trackers.append(PositionTracker(range(r * workers, (r + 1) * workers), C, s.start, s.ahead))
        iters += [(r, s.iter_samples(r * workers + w, C)) for w in range(workers)]
    got, live = [], list(range(C))
    while len(got) < steps and live:
        k = int(rng.choice(live))
        r, it = iters[k]
        nxt = next(it, None)
        if nxt is None:
            live.remove(k)
            continue
        trackers[r].observe([nxt["position"]])
        got.append((nxt["position"], nxt["sample_id"]))
    base = _stream(ds, mode).state_dict()
    states = []
    for t in trackers:
        st_ = dict(base)
        st_.update(t.partial_state(), complete=False)
        states.append(st_)
    return got, merge_states(states)


@settings(max_examples=25, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["shuffle", "mixture"]), split1=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       split2=st.tuples(st.integers(1, 3), st.integers(1, 3)), steps=st.integers(0, 300), seed=st.integers(0, 99))
def test_resume_under_another_split_yields_exactly_the_rest(small_dataset, mode, split1, split2, steps, seed):
    ds, *_ = small_dataset
    ref = _reference(ds, mode)
    first, state = _simulate(ds, mode, None, *split1, steps, seed)
    rest, _ = _simulate(ds, mode, state, *split2, 10**9, seed + 1)
    assert not set(first) & set(rest)
    assert sorted(first + rest) == ref


def test_dataloader_workers_resume(small_dataset):
    ds, *_ = small_dataset
    ref = _reference(ds, "mixture")
    loader = ResumableLoader(_stream(ds, "mixture"), batch_size=4, num_workers=2)
    seen = []
    for k, batch in enumerate(loader):
        seen += list(zip(batch["position"].tolist(), batch["sample_id"].tolist()))
        assert batch["input_ids"].shape[0] == len(batch["lengths"])
        if k == 20:
            break
    state = loader.state_dict()
    resumed = ResumableLoader(_stream(ds, "mixture"), batch_size=3, num_workers=0)
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += list(zip(batch["position"].tolist(), batch["sample_id"].tolist()))
    assert sorted(seen) == ref


def test_partial_rank_state_rejected(small_dataset):
    ds, *_ = small_dataset
    _, state = _simulate(ds, "shuffle", None, 2, 1, 10, 0)
    partial = dict(state, complete=False)
    with pytest.raises(ValueError, match="merge_states"):
        _stream(ds, "shuffle").load_state_dict(partial)


def test_online_reweighting_changes_mixture_and_resumes(small_dataset):
    ds, *_ = small_dataset
    def make():
        return StreamingDataset(ds, seed=5, domain_weights=[1 / 3] * 3, num_positions=1500)
    eg = ExponentiatedGradientWeights(3, lr=2.0)
    loader = ResumableLoader(make(), batch_size=8)
    seen, doms_after = [], []
    for step, batch in enumerate(loader):
        seen += list(zip(batch["position"].tolist(), batch["sample_id"].tolist()))
        if step >= 10:
            doms_after += batch["domain"].tolist()
        if step < 10:
            # Domain 2 ("books") reports a much higher loss, so it should gain weight.
            w = eg.update([1.0, 1.0, 3.0])
            loader.set_domain_weights(w)
        if step == 40:
            break
    counts = np.bincount(doms_after, minlength=3) / len(doms_after)
    assert counts[2] > 0.6
    state = loader.state_dict()
    resumed = ResumableLoader(make(), batch_size=8)
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += list(zip(batch["position"].tolist(), batch["sample_id"].tolist()))
    # Replaying the recorded weight schedule from scratch gives the same whole sequence.
    replay = make()
    replay.load_state_dict(dict(state, frontier=0, ahead=[]))
    assert sorted(seen) == [(s["position"], s["sample_id"]) for s in replay.iter_samples(0, 1)]


def test_eg_weights_properties():
    eg = ExponentiatedGradientWeights(3, lr=1.0, smoothing=0.1, reference_losses=[1.0, 1.0, 1.0])
    w = eg.update({0: 1.0, 2: 2.5})
    assert w.argmax() == 2 and abs(w.sum() - 1) < 1e-12 and w.min() >= 0.1 / 3
    state = eg.state_dict()
    other = ExponentiatedGradientWeights(3, lr=1.0, smoothing=0.1, reference_losses=[1.0, 1.0, 1.0])
    other.load_state_dict(state)
    np.testing.assert_allclose(other.update([1.0, np.nan, 2.0]), eg.update([1.0, np.nan, 2.0]))
    with pytest.raises(ValueError, match="domain_losses"):
        eg.update([1.0])


def test_keep_mask_and_weight_validation(small_dataset):
    ds, *_ = small_dataset
    mask = np.zeros(len(ds), dtype=bool)
    mask[::2] = True
    ids = [s["sample_id"] for s in StreamingDataset(ds, keep_mask=mask)]
    assert sorted(ids) == list(range(0, len(ds), 2))
    with pytest.raises(ValueError, match="domain_weights"):
        StreamingDataset(ds, domain_weights=[1.0, 0.0])
    with pytest.raises(ValueError, match="keep_mask"):
        StreamingDataset(ds, keep_mask=np.ones(3, bool))
    s = torch.utils.data.DataLoader(StreamingDataset(ds, num_positions=10), batch_size=None)
    assert len(list(s)) == 10
