"""Fuzz kvpool's write path and paged_decode's arguments: every input either matches an independent
model (what was written reads back; decode equals SDPA over the gathered K/V) or raises a
TileStackError naming an argument. Never a raw torch error, never a silently wrong read."""

import math

import kvpool
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tilehal import TileStackError

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
ARG_NAMES = ("slots", "k:", "v:", "layer", "seq_id", "block_table", "seq_lens", "block_indices", "q:")
SPECIAL = [0.0, 1.0, -3.5, 250.0, 1e-3, math.nan, math.inf, -math.inf]


def names_an_argument(err: Exception) -> bool:
    return any(str(err).startswith(n) or f"{n}" in str(err).split(":")[0] for n in ARG_NAMES)


@st.composite
def values(draw, n, heads, dim):
    flat = draw(st.lists(st.sampled_from(SPECIAL) | st.floats(-100, 100, width=32), min_size=n * heads * dim,
                         max_size=n * heads * dim))
    return torch.tensor(flat, dtype=torch.float32).view(n, heads, dim)


@FUZZ
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
       bs=st.integers(1, 4), num_blocks=st.integers(1, 6), heads=st.integers(1, 2), dim=st.sampled_from([1, 4]))
def test_writes_read_back_or_are_refused_by_name(data, dtype, bs, num_blocks, heads, dim):
    pool = kvpool.KVPool(1, heads, dim, num_blocks, block_size=bs, dtype=dtype, watermark=0.0)
    model: dict[int, dict[int, torch.Tensor]] = {}  # seq -> {position: written k}
    for step in range(data.draw(st.integers(1, 6))):
        sid = data.draw(st.integers(0, 2))
        if sid not in pool:
            try:
                pool.add_sequence(sid, data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6)))
            except TileStackError:
                continue
            model[sid] = {}
        n = data.draw(st.integers(0, 3))
        try:
            start = pool.num_tokens(sid)
            slots = pool.append(sid, n)
        except TileStackError:
            continue
        mode = data.draw(st.sampled_from(["own", "own", "random", "dup", "other"]))
        others = [s for s in model if s != sid]
        owner = sid
        if mode == "random":
            slots = torch.tensor(data.draw(st.lists(st.integers(-3, num_blocks * bs + 3), max_size=4)), dtype=torch.int64)
        elif mode == "dup" and len(slots):
            slots = torch.cat([slots, slots[:1]])
        elif mode == "other" and others and len(slots):
            owner = others[0]  # our slots, claimed for another sequence: must be refused
        k = data.draw(values(len(slots), heads, dim))
        try:
            pool.write(0, slots, k, k, seq_id=owner if mode in ("own", "other") else None)
        except TileStackError as e:
            assert names_an_argument(e), str(e)
            continue
        except Exception as e:  # pragma: no cover - the failure this test exists to catch
            pytest.fail(f"raw {type(e).__name__} from write: {e}")
        assert owner == sid, "a write claiming another sequence's ownership was accepted"
        if mode == "dup":
            assert len(slots) <= 1
        # Accepted: every slot lies in a live block; record it for every sequence holding that block.
        for j, s in enumerate(slots.tolist()):
            holders = [o for o in model if s // bs in pool.blocks_of(o)]
            assert holders, s
            for o in holders:
                ob = pool.blocks_of(o)
                model[o][ob.index(s // bs) * bs + s % bs] = k[j]
    for sid, written in model.items():
        got = pool.gather(0, sid)[0].float()
        for pos, want in written.items():
            if pos < len(got):
                _assert_stored(got[pos], want, dtype)


def _assert_stored(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), (got, want)
    if dtype == torch.float8_e4m3fn:
        fin = torch.isfinite(want)
        assert torch.all(torch.isfinite(got[~nan]))  # an Inf saturates, never spreads
        assert torch.all(torch.sign(got[~nan & ~fin]) == torch.sign(want[~nan & ~fin]))
        # fp8 e4m3: 3 mantissa bits; the block scale may push small values toward zero.
        tol = 2.0 ** -3 * want[fin].abs() + 2.0 ** -9 * max(float(want[fin].abs().max()) if fin.any() else 0.0, 1.0)
        assert torch.all((got[fin] - want[fin]).abs() <= tol + 1e-6), (got, want)
    else:
        rtol = 0 if dtype == torch.float32 else 2.0 ** -8
        w = want.to(dtype).float()
        assert torch.equal(got[~nan], w[~nan]) or torch.allclose(got[~nan], w[~nan], rtol=rtol, atol=0)


@FUZZ
@given(data=st.data(), lens=st.lists(st.integers(0, 9), min_size=1, max_size=3), bs=st.integers(1, 4))
def test_decode_arguments_match_sdpa_or_are_refused_by_name(data, lens, bs):
    pool = kvpool.KVPool(1, 1, 4, 32, block_size=bs, dtype=torch.float32, watermark=0.0)
    g = torch.Generator().manual_seed(len(lens) * 7 + bs)
    for i, L in enumerate(lens):
        pool.add_sequence(i, [i * 1000 + j for j in range(max(L, 1))])
        if L:
            x = torch.randn(L, 1, 4, generator=g)
            pool.write(0, pool.append(i, L), x, -x)
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    B, width = bt.shape
    if data.draw(st.booleans()):  # corrupt one entry of the table
        if width:
            bt[data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, width - 1))] = data.draw(st.integers(-3, 20))
    if data.draw(st.booleans()):
        sl[data.draw(st.integers(0, B - 1))] = data.draw(st.integers(-2, 12))
    bi = None
    if data.draw(st.booleans()):
        bi = torch.tensor(data.draw(st.lists(st.lists(st.integers(-2, width + 1), min_size=2, max_size=2),
                                             min_size=B, max_size=B)), dtype=torch.int32)
    q = torch.randn(B, 2, 4, generator=g)
    try:
        out = kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi)
    except TileStackError as e:
        assert names_an_argument(e), str(e)
        return
    except Exception as e:  # pragma: no cover
        pytest.fail(f"raw {type(e).__name__} from paged_decode: {e}")
    kc, vc = pool.layer_cache(0)
    for b in range(B):  # independent oracle: gather positions by hand, SDPA in float64
        keep = []
        chosen = None if bi is None else {int(x) for x in bi[b].tolist() if x >= 0}
        for p in range(int(sl[b])):
            i = p // bs
            if i < width and int(bt[b, i]) >= 0 and (chosen is None or i in chosen):
                keep.append((int(bt[b, i]), p % bs))
        if not keep:
            assert torch.all(out[b] == 0)
            continue
        k = torch.stack([kc[blk, off] for blk, off in keep]).double()
        v = torch.stack([vc[blk, off] for blk, off in keep]).double()
        s = torch.einsum("hd,thd->ht", q[b].double(), k.repeat(1, 2, 1)) / 2.0
        want = torch.einsum("ht,thd->hd", torch.softmax(s, -1), v.repeat(1, 2, 1))
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)
