"""Every public entry point, each argument replaced in turn by a bad value (wrong type, NaN, 0, -1,
huge, empty / NaN tensors): the call succeeds or raises a TileStackError naming the argument, never
a raw numpy/torch/Python exception or a hang (issue 16, item 7)."""

import dataengine as de
import dataengine.data as dd
import numpy as np
import pytest
import torch
from dataengine.masks import BlockMask
from tilehal.testing import probe_arguments


def _select_args():
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    kmin = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))
    bt = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1]], dtype=torch.int32)
    return dict(q=q, kmin=kmin, kmax=kmin + 1, block_table=bt, seq_lens=torch.tensor([40, 20], dtype=torch.int32))


def _dataset(tmp_path):
    return dd.write_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5, 6, 7]], domains=[0, 1], domain_names=("a", "b"))


CASES = {
    "select_blocks": lambda _: (de.select_blocks, dict(_select_args(), top_k=2, sink_blocks=1, local_blocks=1,
                                                       block_size=16, reduce="max")),
    "quest_scores": lambda _: (de.quest_scores, dict(_select_args(), block_size=16)),
    "topk_blocks": lambda _: (de.topk_blocks, dict(scores=torch.randn(2, 5), k=2, num_valid=torch.tensor([5, 3]),
                                                   sink_blocks=0, local_blocks=0)),
    "BlockMask": lambda _: (BlockMask, dict(kv_num_blocks=torch.tensor([[[1]]], dtype=torch.int32),
                                            kv_indices=torch.tensor([[[[0]]]], dtype=torch.int32), q_block_size=16,
                                            kv_block_size=16, q_len=16, kv_len=16)),
    "BlockMask.causal": lambda _: (BlockMask.causal, dict(q_len=256, kv_len=256, block_size=128, batch=1, heads=1)),
    "BlockMask.sliding_window": lambda _: (BlockMask.sliding_window, dict(q_len=256, kv_len=256, window=128,
                                                                          block_size=128)),
    "BlockMask.document": lambda _: (BlockMask.document, dict(cu_seqlens=torch.tensor([0, 100, 256]), block_size=128,
                                                              seq_len=256, causal=True)),
    "BlockMask.from_dense": lambda _: (BlockMask.from_dense, dict(blocks=torch.ones(1, 1, 2, 2, dtype=torch.bool),
                                                                  q_len=256, kv_len=256, q_block_size=128,
                                                                  kv_block_size=128)),
    "BlockMask.from_doc_ids": lambda _: (BlockMask.from_doc_ids, dict(doc_ids=torch.zeros(1, 256, dtype=torch.long),
                                                                      block_size=128, causal=False)),
    "BlockMask.from_element_mask": lambda _: (BlockMask.from_element_mask, dict(
        allowed=torch.ones(1, 1, 256, 256, dtype=torch.bool), q_block_size=128, kv_block_size=128)),
    "BlockMask.topk": lambda _: (BlockMask.topk, dict(block_scores=torch.randn(1, 1, 2, 2), k=1, q_len=256,
                                                      kv_len=256, block_size=128)),
    "pack": lambda _: (de.pack, dict(samples=[[1, 2, 3], [4, 5]], row_len=4, pad_id=0, overlong="error")),
    "best_fit_decreasing": lambda _: (de.best_fit_decreasing, dict(lengths=[3, 2, 1], capacity=4)),
    "packing_efficiency": lambda _: (de.packing_efficiency, dict(lengths=[3, 2, 1], row_len=4)),
    "padding_efficiency": lambda _: (de.padding_efficiency, dict(lengths=[3, 2, 1], row_len=4, batch_size=2)),
    "nm_mask": lambda _: (de.nm_mask, dict(weight=torch.randn(8, 16), pattern="2:4", method="magnitude")),
    "prune": lambda _: (de.prune, dict(weight=torch.randn(8, 16), pattern="2:4")),
    "compress": lambda _: (de.compress, dict(weight=de.prune(torch.randn(8, 16)), pattern="2:4")),
    "is_nm_sparse": lambda _: (de.is_nm_sparse, dict(weight=torch.randn(8, 16), pattern="2:4")),
    "decompress": lambda _: (de.decompress, dict(c=de.compress(de.prune(torch.randn(8, 16))))),
    "ExponentiatedGradientWeights": lambda _: (dd.ExponentiatedGradientWeights, dict(
        num_domains=3, lr=1.0, smoothing=1e-3, initial=[0.2, 0.3, 0.5], reference_losses=[1.0, 1.0, 1.0], ema=0.9)),
    "jaccard": lambda _: (dd.jaccard, dict(a=np.arange(10), b=np.arange(10), ngram=5)),
    "MinHashLSH": lambda _: (dd.MinHashLSH, dict(num_perm=128, bands=16, ngram=5, threshold=0.8, seed=0)),
    "pad_collate": lambda _: (dd.pad_collate, dict(samples=[{"tokens": torch.tensor([1, 2]), "sample_id": 0,
                                                             "domain": 0, "position": 0}], pad_id=0)),
    "PackCollate": lambda _: (dd.PackCollate, dict(row_len=8, pad_id=0)),
    "domain_losses": lambda _: (dd.domain_losses, dict(per_sample_loss=torch.ones(4),
                                                       domains=torch.tensor([0, 1, 2, 0]), num_domains=3)),
    "Filter": lambda _: (dd.Filter, dict(scorer=dd.LengthScorer(), min_score=1.0, max_score=10.0)),
    "NGramRepetitionScorer": lambda _: (dd.NGramRepetitionScorer, dict(n=3)),
    "StreamingDataset": lambda p: (dd.StreamingDataset, dict(dataset=_dataset(p), seed=0, domain_weights=[0.5, 0.5],
                                                             num_positions=10, rank=0, world_size=1, chunk=8)),
    "set_domain_weights": lambda p: (dd.StreamingDataset(_dataset(p), domain_weights=[0.5, 0.5]).set_domain_weights,
                                     dict(weights=[0.5, 0.5], from_position=0)),
    "ResumableLoader": lambda p: (dd.ResumableLoader, dict(stream=dd.StreamingDataset(_dataset(p)), batch_size=2,
                                                           num_workers=0)),
    "TokenDataset": lambda p: (dd.TokenDataset, dict(root=_dataset(p).root, verify=False)),
    "ShardWriter": lambda p: (dd.ShardWriter, dict(root=p / "w", dtype=np.uint16, domains=("default",),
                                                   shard_tokens=1024, format="npy")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name, tmp_path):
    fn, kwargs = CASES[name](tmp_path)
    fn(**kwargs)  # the baseline is valid
    assert probe_arguments(fn, kwargs) == []
