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
    with pytest.raises(ArgumentError, match=r"block_size: expected an integer in \[1, 2147483647\], got 0"):
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
    with pytest.raises(ArgumentError, match=r"k: expected an integer in \[1, 2147483647\]"):
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


def _quest_inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, generator=g)
    kmin = torch.randn(6, 2, 16, generator=g)
    bt = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1]], dtype=torch.int32)
    return q, kmin, kmin + 1, bt, torch.tensor([40, 20], dtype=torch.int32)


@pytest.mark.parametrize("fn", ["select_blocks", "quest_scores"])
def test_select_blocks_refuses_nan_and_negative_inputs(fn):
    from dataengine import quest_scores, select_blocks

    call = (lambda *a: select_blocks(*a, top_k=2, block_size=16)) if fn == "select_blocks" else \
        (lambda *a: quest_scores(*a, block_size=16))
    q, kmin, kmax, bt, sl = _quest_inputs()
    call(q, kmin, kmax, bt, sl)
    bad_q = q.clone()
    bad_q[1, 2, 3] = math.nan
    with pytest.raises(ArgumentError, match="q: expected finite values, got 1 NaN/Inf"):
        call(bad_q, kmin, kmax, bt, sl)  # was: every block scored -inf, only forced blocks chosen
    bad_k = kmin.clone()
    bad_k[0, 0, 0] = math.nan
    with pytest.raises(ArgumentError, match="kmin: expected no NaN"):
        call(q, bad_k, kmax, bt, sl)
    empty_min, empty_max = kmin.clone(), kmax.clone()
    empty_min[5], empty_max[5] = math.inf, -math.inf  # kvpool's summary of a block with no keys: allowed
    call(q, empty_min, empty_max, bt, sl)
    with pytest.raises(ArgumentError, match="seq_lens: expected lengths >= 0, got -3"):
        call(q, kmin, kmax, bt, torch.tensor([40, -3], dtype=torch.int32))
    with pytest.raises(ArgumentError, match=r"block_table: expected ids >= -1 \(-1 pads\), got -2"):
        call(q, kmin, kmax, torch.tensor([[0, 1, 2, -2], [3, 4, -1, -1]], dtype=torch.int32), sl)
    with pytest.raises(ArgumentError, match="block_size: expected an integer >= 1, got 0"):
        call_bs = select_blocks if fn == "select_blocks" else quest_scores
        kw = {"top_k": 2} if fn == "select_blocks" else {}
        call_bs(q, kmin, kmax, bt, sl, block_size=0, **kw)  # was: ZeroDivisionError from torch


def test_select_ints_and_topk_counts_are_checked():
    from dataengine import select_blocks, topk_blocks

    q, kmin, kmax, bt, sl = _quest_inputs()
    for kw, pattern in (({"top_k": 2.5}, "top_k: expected an integer >= 1, got 2.5"),
                        ({"top_k": 2, "sink_blocks": True}, "sink_blocks: expected an integer >= 0, got True"),
                        ({"top_k": 2, "local_blocks": -1}, "local_blocks: expected an integer >= 0, got -1"),
                        ({"top_k": 2, "reduce": np.array(["max"])}, "reduce: expected one of 'max', 'sum', 'mean'")):
        with pytest.raises(ArgumentError, match=pattern):
            select_blocks(q, kmin, kmax, bt, sl, **kw)
    with pytest.raises(ArgumentError, match="num_valid: expected counts >= 0, got -1"):
        topk_blocks(torch.randn(2, 5), 2, num_valid=torch.tensor([5, -1]))
