"""Every public entry point of kvpool, each argument replaced in turn by a bad value (wrong type, NaN,
0, -1, huge, empty / NaN tensors): the call succeeds or raises a TileStackError naming the argument,
never a raw numpy/torch/Python exception or a hang (issue 16, item 7). Each case builds a fresh pool,
so a mutated call that succeeds cannot disturb the next one."""

import pytest
import torch
from kvpool import KVPool, paged_decode, paged_decode_reference, paged_prefill, paged_prefill_reference
from tilehal.testing import probe_arguments

POOL = dict(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8, block_size=4, dtype=torch.float32)


def _pool(seqs=(("a", 6),)):
    pool = KVPool(**POOL)
    for sid, n in seqs:
        pool.add_sequence(sid, list(range(n)))
        slots = pool.append(sid, n)
        g = torch.Generator().manual_seed(n)
        for layer in range(POOL["num_layers"]):
            pool.write(layer, slots, torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g))
    return pool


def _decode_args():
    pool = _pool()
    return dict(q=torch.randn(1, 4, 16), pool=pool, layer=1, block_table=pool.block_table(["a"]),
                seq_lens=pool.seq_lens(["a"]))


def _method(name, **kw):
    def make():
        pool = _pool()
        return getattr(pool, name), kw
    return make


def _write_args():
    pool = KVPool(**POOL)
    pool.add_sequence("a", [1, 2, 3])
    slots = pool.append("a", 3)
    return pool.write, dict(layer=0, slots=slots, k=torch.randn(3, 2, 16), v=torch.randn(3, 2, 16))


CASES = {
    "KVPool": lambda: (KVPool, dict(POOL, host_blocks=0, prefix_caching=True, watermark=0.01)),
    "paged_decode": lambda: (paged_decode, dict(_decode_args(), scale=None, block_indices=None)),
    "paged_decode_reference": lambda: (paged_decode_reference, _decode_args()),
    "paged_prefill": lambda: (paged_prefill, dict(_decode_args(), q=torch.randn(2, 4, 16),
                                                  cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32))),
    "paged_prefill_reference": lambda: (paged_prefill_reference, dict(_decode_args(), q=torch.randn(2, 4, 16),
                                                                      cu_seqlens_q=torch.tensor([0, 2],
                                                                                                dtype=torch.int32))),
    "write": _write_args,
    "add_sequence": _method("add_sequence", seq_id="b", tokens=[1, 2, 3], extra_key=None),
    "append": _method("append", seq_id="a", tokens=2),
    "append_batch": _method("append_batch", seq_ids=["a"], num_tokens=1),
    "block_table": _method("block_table", seq_ids=["a"], device=None),
    "seq_lens": _method("seq_lens", seq_ids=["a"], device=None),
    "blocks_of": _method("blocks_of", seq_id="a"),
    "num_tokens": _method("num_tokens", seq_id="a"),
    "fork": _method("fork", src_id="a", dst_id="b"),
    "free": _method("free", seq_id="a"),
    "evict": _method("evict", num_blocks=1),
    "prefetch": _method("prefetch", seq_id="a"),
    "gather": _method("gather", layer=0, seq_id="a", dtype=None),
    "key_summary": _method("key_summary", layer=0),
    "layer_cache": _method("layer_cache", layer=0),
    "layer_scales": _method("layer_scales", layer=0),
}


def _fresh(name):
    """A fresh (fn, kwargs) per mutated call: pool methods change the pool."""
    return CASES[name]()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name):
    fn, kwargs = _fresh(name)
    fn(**kwargs)  # the baseline is valid
    assert probe_arguments(fn, kwargs, fresh=lambda: _fresh(name)) == []
