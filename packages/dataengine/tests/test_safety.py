"""dataengine refuses what it used to accept silently (issue 16, items 6-7); each of these failed before."""

import json
import math
import pickle

import numpy as np
import pytest
import torch
from dataengine import BlockMask, pack
from dataengine.data import ShardError, ShardWriter, StreamingDataset, TokenDataset, write_dataset
from tilehal import ArgumentError, ShapeError, TileStackError


@pytest.mark.parametrize("bad", [[1.7, 2.0], [math.nan, 3.0], np.array([1.5]), torch.tensor([2.9]), [True, False]])
def test_pack_refuses_float_and_bool_token_ids(bad):
    with pytest.raises(ArgumentError, match=r"samples\[0\]: expected integer token ids"):
        pack([bad], 8)


@pytest.mark.parametrize("bad", [[1.7, 2.0], [math.nan], np.array([3.0, math.inf])])
def test_shard_writer_refuses_float_token_ids(tmp_path, bad):
    with ShardWriter(tmp_path / "d") as w:
        with pytest.raises(ArgumentError, match="tokens: expected integer token ids"):
            w.add(bad)
        w.add([1, 2, 3])
    assert TokenDataset(tmp_path / "d").tokens(0).tolist() == [1, 2, 3]


def test_shard_writer_refuses_a_float_dtype(tmp_path):
    with pytest.raises(ArgumentError, match="dtype: expected an integer numpy dtype"):
        ShardWriter(tmp_path / "d", dtype=np.float32)


def _index(root):
    return json.loads((root / "index.json").read_text())


def test_shard_names_cannot_leave_the_root(tmp_path):
    outside = tmp_path / "outside"
    write_dataset(outside, [[7, 7, 7]])
    root = tmp_path / "ds"
    write_dataset(root, [[1, 2]])
    index = _index(root)
    index["shards"][0]["name"] = "../outside/shard_00000"
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match="expected a plain file name inside the dataset"):
        TokenDataset(root)


@pytest.mark.parametrize("edit", [
    lambda ix: ix.pop("dtype"), lambda ix: ix["shards"][0].pop("num_tokens"), lambda ix: ix.update(dtype="float32"),
    lambda ix: ix.update(dtype="not-a-dtype"), lambda ix: ix["shards"][0].update(format="zip"),
    lambda ix: ix["shards"][0].update(num_samples=-1), lambda ix: ix.update(shards={}),
])
def test_a_damaged_index_names_the_field(tmp_path, edit):
    root = tmp_path / "ds"
    write_dataset(root, [[1, 2], [3]])
    index = _index(root)
    edit(index)
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match="index.json"):
        TokenDataset(root)


def test_verify_survives_pickling_into_workers(tmp_path):
    root = tmp_path / "ds"
    write_dataset(root, [[1, 2, 3], [4, 5]])
    ds = TokenDataset(root, verify=True)
    tok = root / "shard_00000.tokens"
    data = bytearray(tok.read_bytes())
    data[0] ^= 0xFF  # same size, wrong contents: only a checksum sees it
    tok.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="checksum"):
        pickle.loads(pickle.dumps(ds))  # what a DataLoader worker does
    assert pickle.loads(pickle.dumps(TokenDataset(root))).verify is False


def test_a_stream_state_from_another_dataset_is_refused(tmp_path):
    a = write_dataset(tmp_path / "a", [[i] * (i + 1) for i in range(10)])
    b = write_dataset(tmp_path / "b", [[i] * (i + 2) for i in range(10)])
    sa, sb = StreamingDataset(a, seed=1), StreamingDataset(b, seed=1)
    it = iter(sa)
    next(it)
    state = sa.state_dict()
    with pytest.raises(ArgumentError, match=r"state\['dataset'\]: expected"):
        sb.load_state_dict(state)
    StreamingDataset(a, seed=1).load_state_dict(state)  # the same dataset loads
    with pytest.raises(ArgumentError, match="state: expected key 'frontier'"):
        sa.load_state_dict({"seed": 1, "ahead": []})


@pytest.mark.parametrize("w", [[math.nan, 1.0], [-1.0, 2.0], [math.inf, 1.0], [0.0, 0.0], ["a", 1.0]])
def test_domain_weights_must_be_finite_and_non_negative(tmp_path, w):
    ds = write_dataset(tmp_path / "d", [[1], [2], [3]], domains=[0, 1, 1], domain_names=("x", "y"))
    with pytest.raises(ArgumentError, match="domain_weights"):
        StreamingDataset(ds, domain_weights=w)


def test_block_mask_arguments_name_themselves():
    with pytest.raises(ArgumentError, match="block_size: expected an integer >= 1, got 0"):
        BlockMask.from_doc_ids(torch.zeros(1, 8, dtype=torch.long), block_size=0)
    with pytest.raises(ShapeError, match=r"doc_ids: expected \[batch, seq_len\]"):
        BlockMask.from_doc_ids(torch.zeros(8, dtype=torch.long), 4)
    with pytest.raises(ShapeError, match="doc_ids: expected integer document ids"):
        BlockMask.from_doc_ids(torch.tensor([[0.0, math.nan]]), 4)
    with pytest.raises(ArgumentError, match="doc_ids: expected ids >= -1"):
        BlockMask.from_doc_ids(torch.tensor([[0, -3]]), 4)
    with pytest.raises(ArgumentError, match="doc_ids: expected non-decreasing"):
        BlockMask.from_doc_ids(torch.tensor([[1, 1, 0, 0]]), 2)  # silently wrong blocks before
    with pytest.raises(ArgumentError, match="block_scores: expected no NaN"):
        BlockMask.topk(torch.tensor([[[[1.0, math.nan]]]]), 1, 4, 8, block_size=4)
    with pytest.raises(ArgumentError, match="k: expected an integer >= 1"):
        BlockMask.topk(torch.zeros(1, 1, 1, 2), -1, 4, 8, block_size=4)
    with pytest.raises(ArgumentError, match="window"):
        BlockMask.sliding_window(8, window=-4, block_size=4)
    with pytest.raises(ArgumentError, match="q_len"):
        BlockMask.causal(-3, block_size=4)
    with pytest.raises(ShapeError, match="blocks: expected a boolean"):
        BlockMask.from_dense(torch.tensor([[[math.nan]]]), 4, 4, 4)


def test_dataset_lookups_name_the_argument(tmp_path):
    ds = write_dataset(tmp_path / "d", [[1, 2], [3]])
    with pytest.raises(ArgumentError, match="sample id: expected an integer"):
        ds.tokens(0.5)
    with pytest.raises(IndexError, match="sample id"):
        ds.tokens(2)
    assert [x.tolist() for x in ds] == [[1, 2], [3]]  # iteration still stops at the end
    with pytest.raises(ArgumentError, match="domain"):
        ds.domain_ids("nope")
    assert issubclass(ShardError, TileStackError)


def test_loader_helpers_name_their_arguments(tmp_path):
    from dataengine.data import PackCollate, ResumableLoader, domain_losses

    ds = write_dataset(tmp_path / "d", [[1, 2], [3]])
    with pytest.raises(ArgumentError, match="batch_size"):
        ResumableLoader(StreamingDataset(ds), batch_size=0)
    with pytest.raises(ArgumentError, match="stream"):
        ResumableLoader(ds)
    with pytest.raises(ArgumentError, match="row_len"):
        PackCollate(0)
    with pytest.raises(ArgumentError, match="domains: expected ids in"):
        domain_losses(torch.ones(2), torch.tensor([0, 5]), 2)
    with pytest.raises(ShapeError, match="domains: expected integer"):
        domain_losses(torch.ones(2), torch.tensor([0.0, 1.0]), 2)
    out = domain_losses(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 2]), 3)
    assert out[0] == 2.0 and math.isnan(out[1]) and out[2] == 5.0
