"""Selection over fp8 (e4m3) key summaries (select.py's module docstring: outward rounding, the
NaN codes as open ends). The outward rounding here is the test's own (a search over the sorted
e4m3 values), independent of the writer's (kvpool), which dataengine never imports.

Properties, for every generated input:
- the Quest bound over fp8 summaries still bounds every key's true score (q . k) and is never
  below the bound over exact summaries;
- a planted needle (true score >= 2x every other block's exact bound, the premise of the
  exact-summary test) is still selected: with the other keys in [-3, 3], outward rounding moves
  each channel's bound by at most one e4m3 step (<= 0.25 there), so another block's fp8 bound is
  at most 3.25 |q|_1 while the needle scores 6 |q|_1;
- the open ends: a key above 448 keeps its block a candidate (bound ~2^100), a block with nothing
  written scores -inf.
"""

import torch
from dataengine.select import UNBOUNDED, decode_fp8_summary, quest_scores, select_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

FP8 = torch.float8_e4m3fn
_V = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
_ORD = ~torch.isnan(_V)
_SV, _perm = _V[_ORD].sort()
_SC = torch.arange(256)[_ORD][_perm]  # codes in value order (-0 before +0)


def round_outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """fp8 codes: the tightest e4m3 bound of x (above 448 / below -448: the open end)."""
    x = x.float().contiguous()
    if up:
        i = torch.searchsorted(_SV, x, right=False)  # first value >= x
        codes = torch.where(i < len(_SV), _SC[i.clamp(max=len(_SV) - 1)], 0x7F)
    else:
        i = torch.searchsorted(_SV, x, right=True) - 1  # last value <= x
        codes = torch.where(i >= 0, _SC[i.clamp(min=0)], 0xFF)
    return codes.to(torch.uint8).view(FP8)


def _fp8_paged(paged, seed, **kw):
    """conftest's paged_summaries (unwritten blocks: inf / -inf, kvpool's fresh summaries) plus their fp8 codes."""
    q, keys, kmin, kmax, table, lens, pos = paged(seed, unwritten=float("inf"), **kw)
    fmin = round_outward(kmin, up=False).view(torch.uint8)
    fmax = round_outward(kmax, up=True).view(torch.uint8)
    fmin[kmin == float("inf")] = 0x7F  # nothing written
    fmax[kmax == float("-inf")] = 0xFF
    return q, keys, kmin, kmax, fmin.view(FP8), fmax.view(FP8), table, lens, pos


def _assert_bounds_block_maxima(q, keys, bound) -> None:
    """bound [B, 2 kv heads, blocks of 4] is at least each block's true max score over its group's q heads
    (float64 q . k, tolerance 1e-4 relative)."""
    for b, k in enumerate(keys):
        Hq, D = q.shape[1:]
        s = torch.einsum("hgd,nhd->hgn", q[b].reshape(2, Hq // 2, D).double(), k.double()).amax(1)
        for lb in range(-(-k.shape[0] // 4)):
            blk = s[:, lb * 4:(lb + 1) * 4].amax(-1)
            assert bool((bound[b, :, lb].double() >= blk - 1e-4 * (1 + blk.abs())).all())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_fp8_bound_upper_bounds_every_key_and_the_exact_bound(paged, seed, scale):
    q, keys, kmin, kmax, fmin, fmax, table, lens, _ = _fp8_paged(paged, seed, key_scale=scale)
    exact = quest_scores(q, kmin, kmax, table, lens, block_size=4)
    bound = quest_scores(q, fmin, fmax, table, lens, block_size=4)
    assert torch.equal(torch.isfinite(bound), torch.isfinite(exact))
    fin = torch.isfinite(exact)
    assert bool((bound[fin].double() >= exact[fin].double() - 1e-5 * (1 + exact[fin].abs().double())).all())
    _assert_bounds_block_maxima(q, keys, bound)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_fp8_needle_block_always_selected(paged, seed):
    q, keys, kmin, kmax, fmin, fmax, table, lens, pos = _fp8_paged(paged, seed, needle=2.0)
    sel = select_blocks(q, fmin, fmax, table, lens, top_k=3, sink_blocks=1, local_blocks=1)
    for b, k in enumerate(keys):
        Hq, D = q.shape[1:]
        s = torch.einsum("hgd,nhd->hgn", q[b].reshape(2, Hq // 2, D).double(), k.double())[:, 0]
        for h in range(2):
            assert int(s[h].argmax()) == pos[b]
            assert pos[b] // 4 in sel[b, h].tolist()


def test_open_ends(paged):
    q, keys, kmin, kmax, fmin, fmax, table, lens, _ = _fp8_paged(paged, 1)
    q = q.abs()  # every q channel positive: kmax decides the bound
    raw_max, raw_min = fmax.view(torch.uint8), fmin.view(torch.uint8)
    big, dead = int(table[0, 2]), int(table[0, 5])
    raw_max[big, :, 3] = 0x7F  # a key above 448 in channel 3
    raw_min[dead], raw_max[dead] = 0x7F, 0xFF  # nothing written
    s = quest_scores(q, fmin, fmax, table, lens)
    assert bool((s[0, :, 2] > UNBOUNDED * 0.01).all()) and bool(torch.isfinite(s[0, :, 2]).all())
    assert bool(torch.isneginf(s[0, :, 5]).all())
    sel = select_blocks(q, fmin, fmax, table, lens, top_k=3, sink_blocks=1, local_blocks=1)
    assert all(2 in row for row in sel[0].tolist()) and all(5 not in row for row in sel[0].tolist())
    codes = torch.tensor([0x7F, 0xFF, 0x38], dtype=torch.uint8)
    assert decode_fp8_summary(codes, "max").tolist() == [UNBOUNDED, float("-inf"), 1.0]
    assert decode_fp8_summary(codes, "min").tolist() == [float("inf"), -UNBOUNDED, 1.0]


def test_fp8_recall_close_to_exact_on_clustered_keys():
    # Attention-mass recall of the chosen blocks (softmax over all keys), exact vs fp8 summaries,
    # on keys clustered per block (a block's centre + noise, so attention concentrates on the
    # blocks whose centre aligns with q): fp8's slack is one e4m3 step per channel.
    rec = {"exact": [], "fp8": []}
    n, D, bs, nb = 4096, 64, 16, 256
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 4, D, generator=g)
        k = (2.0 * torch.randn(nb, 1, D, generator=g)).repeat_interleave(bs, 0) + 0.3 * torch.randn(n, 1, D, generator=g)
        kb = k.reshape(nb, bs, 1, D)
        kmin, kmax = kb.amin(1), kb.amax(1)
        table = torch.arange(nb, dtype=torch.int32)[None]
        lens = torch.tensor([n], dtype=torch.int32)
        att = torch.softmax((q[0].double() @ k[:, 0].double().T) / D ** 0.5, -1)  # [Hq, n]
        mass = att.reshape(4, nb, bs).sum(-1)
        for name, (lo, hi) in (("exact", (kmin, kmax)),
                               ("fp8", (round_outward(kmin, False), round_outward(kmax, True)))):
            sel = select_blocks(q, lo, hi, table, lens, top_k=16, sink_blocks=1, local_blocks=1)[0, 0]
            rec[name].append(float(mass[:, sel[sel >= 0].long()].sum(-1).mean()))
    e, f = sum(rec["exact"]) / 6, sum(rec["fp8"]) / 6
    print(f"attention-mass recall, top 16 of 256 blocks: exact summaries {e:.4f}, fp8 {f:.4f}")
    assert e > 0.3  # the premise: attention is concentrated enough for selection to matter
    assert f >= e - 0.03, rec  # fp8 loses at most 3 points of attention mass here


# ----------------------------------------------------------------------------- int4 rows
from dataengine.select import decode_int4_summary, int4_row_bytes  # noqa: E402


def encode_int4_dyadic(x: torch.Tensor, up: bool) -> torch.Tensor:
    """A valid outward int4 encoding, the test's own: per 32-channel group lo = floor(min), step a
    multiple of 1/8 >= range / 15, codes by ceil / floor in float64 (all values dyadic, so the
    float32 decode is exact). Unwritten rows (+inf / -inf) keep their infinity with step 0."""
    D = x.shape[-1]
    g = x.double().reshape(*x.shape[:-1], D // 32, 32)
    dead = torch.isinf(g).all(-1)
    gg = torch.where(torch.isinf(g), 0.0, g)
    lo = torch.floor(gg.amin(-1))
    step = torch.ceil((gg.amax(-1) - lo) / 15 * 8) / 8
    c = (gg - lo[..., None]) / torch.where(step > 0, step, 1.0)[..., None]
    c = (torch.ceil(c) if up else torch.floor(c)).clamp(0, 15)
    c = torch.where(dead[..., None], 0.0, c)
    lo = torch.where(dead, g[..., 0], lo)
    step = torch.where(dead, 0.0, step)
    codes = c.to(torch.uint8).reshape(*x.shape[:-1], D // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    params = torch.stack((lo, step), -1).to(torch.bfloat16).reshape(*x.shape[:-1], D // 16).view(torch.uint8)
    return torch.cat((packed, params), -1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_int4_bound_upper_bounds_every_key(paged, seed):
    q, keys, kmin, kmax, _, _, table, lens, _ = _fp8_paged(paged, seed, D=64)
    lo, hi = encode_int4_dyadic(kmin, False), encode_int4_dyadic(kmax, True)
    assert lo.shape[-1] == int4_row_bytes(64)
    assert bool((decode_int4_summary(lo, 64) <= torch.where(torch.isinf(kmin), float("inf"), kmin)).all())
    bound = quest_scores(q, lo, hi, table, lens, block_size=4)
    exact = quest_scores(q, kmin, kmax, table, lens, block_size=4)
    assert torch.equal(torch.isfinite(bound), torch.isfinite(exact))
    _assert_bounds_block_maxima(q, keys, bound)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_int4_needle_block_always_selected(paged, seed):
    # other keys in [-3, 3]: a group's step is at most 6 / 15 rounded up to 1/8 (0.5), so another
    # block's int4 bound is at most 3.5 |q|_1 while the needle (margin 2) scores 6 |q|_1
    q, keys, kmin, kmax, _, _, table, lens, pos = _fp8_paged(paged, seed, D=64, needle=2.0)
    lo, hi = encode_int4_dyadic(kmin, False), encode_int4_dyadic(kmax, True)
    sel = select_blocks(q, lo, hi, table, lens, top_k=3, sink_blocks=1, local_blocks=1)
    for b in range(len(keys)):
        for h in range(2):
            assert pos[b] // 4 in sel[b, h].tolist()
