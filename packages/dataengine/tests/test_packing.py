import numpy as np
import pytest
import torch
from dataengine.masks import BlockMask
from dataengine.packing import best_fit_decreasing, pack, packing_efficiency, padding_efficiency
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 64), max_size=60), cap=st.integers(64, 100))
def test_bfd_never_overflows_and_places_everything(lengths, cap):
    bins = best_fit_decreasing(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    # Any-fit property: a row is opened only when nothing fits, so at most one row is at most half full.
    nonempty = [sum(lengths[i] for i in b) for b in bins if sum(lengths[i] for i in b) > 0]
    assert sum(2 * s <= cap for s in nonempty) <= 1


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=30), L=st.integers(32, 64),
       overlong=st.sampled_from(["split", "truncate"]))
def test_pack_loses_no_token_and_positions_restart(lengths, L, overlong):
    rng = np.random.default_rng(sum(lengths))
    samples = [rng.integers(1, 1000, n) for n in lengths]
    pb = pack(samples, L, pad_id=0, overlong=overlong)
    assert pb.tokens.shape[1] == L
    # Rebuild every sample from the rows.
    got: dict[int, list[tuple[int, np.ndarray]]] = {}
    for r, row in enumerate(pb.samples):
        cu = pb.cu_seqlens[r].tolist()
        for d, (idx, off) in enumerate(row):
            seg = pb.tokens[r, cu[d]:cu[d + 1]].numpy()
            got.setdefault(idx, []).append((off, seg))
            assert pb.position_ids[r, cu[d]:cu[d + 1]].tolist() == list(range(cu[d + 1] - cu[d]))
            assert bool((pb.doc_ids[r, cu[d]:cu[d + 1]] == d).all())
        assert bool((pb.doc_ids[r, cu[-1]:] == -1).all()) and bool((pb.tokens[r, cu[-1]:] == 0).all())
    for i, s in enumerate(samples):
        rebuilt = np.concatenate([seg for _, seg in sorted(got[i], key=lambda t: t[0])])
        want = s if overlong == "split" else s[:L]
        np.testing.assert_array_equal(rebuilt, want)
    assert pb.num_tokens == sum(len(s) if overlong == "split" else min(len(s), L) for s in samples)
    flat = pb.cu_seqlens_flat.tolist()
    assert flat[0] == 0 and flat[-1] == pb.tokens.numel() and flat == sorted(flat)


def test_pack_block_mask_is_document_causal():
    pb = pack([np.arange(1, 6), np.arange(1, 12), np.arange(1, 4)], 16)
    m = pb.block_mask(block_size=4)
    ref = BlockMask.document(pb.cu_seqlens, 4, seq_len=16, causal=True)
    assert torch.equal(m.to_dense(), ref.to_dense())


def test_overlong_error_names_sample():
    with pytest.raises(ValueError, match=r"samples\[1\]: expected at most row_len=8"):
        pack([np.ones(3, np.int64), np.ones(9, np.int64)], 8)


def test_efficiency_beats_padding_on_long_tail():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.5, 1.0, 2000).astype(int) + 1, 4096)
    packed = packing_efficiency(lengths, 4096)
    padded = padding_efficiency(lengths, 4096)
    assert packed > 0.95 and packed > 5 * padded
    assert 0 < padding_efficiency(lengths, batch_size=8) <= 1
