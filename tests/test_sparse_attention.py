"""kvpool x dataengine: Quest block selection driving kvpool's sparse paged decode.

dataengine.select_blocks picks blocks from kvpool's key summaries; kvpool.paged_decode attends
only to them. The output is checked against an independent float64 attention over the same
blocks (built from the K/V this test generated, not read back from the pool), and the
selection's attention-mass recall (share of the full softmax mass inside the chosen blocks) is
reported and compared with a random choice of the same size.
"""

import math

import pytest
import torch

kvpool = pytest.importorskip("kvpool")
select = pytest.importorskip("dataengine.select")

BLOCK = 16
KV_HEADS, GROUP, HEAD_DIM = 2, 4, 64


def _build(device, dtype, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = kvpool.KVPool(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=256, block_size=BLOCK,
                         dtype=dtype, device=device, prefix_caching=False)
    B = len(lens)
    q = torch.randn(B, KV_HEADS * GROUP, HEAD_DIM, generator=g)
    keys, values = [], []
    for b, n in enumerate(lens):
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) * 0.5
        # A few "relevant" keys aligned with the group's queries, as in long-context retrieval:
        # attention concentrates on them, which is what block selection exploits.
        qg = q[b].reshape(KV_HEADS, GROUP, HEAD_DIM).mean(1)
        for pos in torch.randint(0, n, (6,), generator=g).tolist():
            k[pos] += 3.0 * qg
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
        k, v = k.to(dtype), v.to(dtype)  # the reference sees exactly what the pool stores
        pool.add_sequence(b, list(range(1000 * b, 1000 * b + n)))
        slots = pool.append(b, n)
        pool.write(0, slots.to(device), k.to(device), v.to(device))
        keys.append(k.double())
        values.append(v.double())
    return pool, q.to(device, dtype), keys, values


def _reference(q, keys, values, allowed_blocks):
    """float64 attention of each q head over the tokens of its kv head's allowed blocks."""
    B, Hq, D = q.shape
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = keys[b].shape[0]
        tok_block = torch.arange(n) // BLOCK
        for h in range(Hq):
            kv = h // GROUP
            keep = torch.isin(tok_block, torch.tensor(sorted(allowed_blocks(b, kv)), dtype=torch.long))
            s = keys[b][keep, kv] @ q[b, h].double().cpu() / math.sqrt(D)
            out[b, h] = torch.softmax(s, 0) @ values[b][keep, kv]
    return out


def _recall(q, keys, chosen):
    """Mean share of the full softmax mass that falls in the chosen blocks."""
    B, Hq, D = q.shape
    total, count = 0.0, 0
    for b in range(B):
        tok_block = torch.arange(keys[b].shape[0]) // BLOCK
        for h in range(Hq):
            kv = h // GROUP
            p = torch.softmax(keys[b][:, kv] @ q[b, h].double().cpu() / math.sqrt(D), 0)
            total += float(p[torch.isin(tok_block, torch.tensor(sorted(chosen(b, kv)), dtype=torch.long))].sum())
            count += 1
    return total / count


def _run(device, dtype, atol):
    lens = [700, 333, 1024, 97]
    pool, q, keys, values = _build(device, dtype, lens)
    ids = list(range(len(lens)))
    kmin, kmax = pool.key_summary(0)
    table, seq_lens = pool.block_table(ids), pool.seq_lens(ids)
    top_k = 8
    sel = select.select_blocks(q, kmin, kmax, table, seq_lens, top_k=top_k, sink_blocks=1, local_blocks=1)
    assert sel.dtype == torch.int32 and sel.shape == (len(lens), KV_HEADS, top_k)

    def chosen(b, kv):
        return [int(x) for x in sel[b, kv].tolist() if x >= 0]

    sparse = kvpool.paged_decode(q, pool, 0, table, seq_lens, block_indices=sel)
    ref = _reference(q, keys, values, chosen)
    torch.testing.assert_close(sparse.double().cpu(), ref, atol=atol, rtol=atol)

    # Dense decode is the same computation with every block chosen.
    dense = kvpool.paged_decode(q, pool, 0, table, seq_lens)
    all_blocks = select.select_blocks(q, kmin, kmax, table, seq_lens, top_k=table.shape[1])

    def every(b, kv):
        return list(range(-(-lens[b] // BLOCK)))

    assert all(chosen_all == every(b, kv) for b in range(len(lens)) for kv in range(KV_HEADS)
               for chosen_all in [[int(x) for x in all_blocks[b, kv].tolist() if x >= 0]])
    torch.testing.assert_close(dense.double().cpu(), _reference(q, keys, values, every), atol=atol, rtol=atol)

    recall = _recall(q, keys, chosen)
    g = torch.Generator().manual_seed(1)
    rand_sel = {(b, kv): torch.randperm(-(-lens[b] // BLOCK), generator=g)[: len(chosen(b, kv))].tolist()
                for b in range(len(lens)) for kv in range(KV_HEADS)}
    random_recall = _recall(q, keys, lambda b, kv: rand_sel[(b, kv)])
    budget = sum(len(chosen(b, kv)) for b in range(len(lens)) for kv in range(KV_HEADS))
    blocks = sum(-(-n // BLOCK) for n in lens) * KV_HEADS
    print(f"\n[{device} {dtype}] Quest top-{top_k}: attention-mass recall {recall:.3f} "
          f"(random blocks of the same budget: {random_recall:.3f}), {budget}/{blocks} blocks read")
    assert recall > random_recall + 0.2
    return recall


def test_sparse_decode_on_quest_selection_cpu():
    _run("cpu", torch.float32, atol=1e-4)


@pytest.mark.gpu
def test_sparse_decode_on_quest_selection_cuda():
    _run("cuda", torch.bfloat16, atol=2e-2)
