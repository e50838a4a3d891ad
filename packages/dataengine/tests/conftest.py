"""Shared helpers for dataengine tests (test files do not import each other)."""

import numpy as np
import pytest
import torch


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def small_dataset(tmp_path):
    """600 samples over 3 domains in several shards, some of them highly repetitive."""
    from dataengine.data import write_dataset

    gen = np.random.default_rng(7)
    samples, domains = [], []
    for i in range(600):
        n = int(gen.integers(1, 60))
        s = gen.integers(0, 500, n)
        if i % 7 == 0:
            s = np.tile(s[:3], n // 3 + 1)[:n]  # degenerate loop: high n-gram repetition
        samples.append(s)
        domains.append(int(gen.integers(0, 3)))
    ds = write_dataset(tmp_path / "ds", samples, domains, ("web", "code", "books"), shard_tokens=4000)
    return ds, samples, domains


KEY_CLIP = 3.0  # with a needle, the other keys are clipped to [-KEY_CLIP, KEY_CLIP]


def paged_summaries(seed, B=2, Hq=8, Hkv=2, D=16, bs=4, lens=(37, 21), num_blocks=40, needle=None, key_scale=1.0,
                    unwritten=0.0):
    """Random paged keys; kmin/kmax computed over each block's filled tokens (what kvpool keeps), the
    blocks no sequence uses left at `unwritten` (kmin) / -`unwritten` (kmax): 0 or inf (kvpool's fresh
    summaries). Keys are key_scale * N(0, 1). Returns (q, keys [per sequence: len, Hkv, D], kmin,
    kmax, table, lens int32, needle positions).

    With `needle` (a margin > 1), each sequence gets one key per kv head along its group's first
    q head, strong enough that its true score beats the Quest bound of every block without it:
    any other block's keys lie in [-KEY_CLIP, KEY_CLIP], so its bound for q head h is at most
    KEY_CLIP * |q_h|_1; the needle scores c * |q_0|^2 with c = needle * KEY_CLIP * max_h |q_h|_1 / |q_0|^2.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g)
    max_blocks = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    kmin = torch.full((num_blocks, Hkv, D), unwritten)
    kmax = torch.full((num_blocks, Hkv, D), -unwritten)
    keys, needle_pos, used = [], [], 0
    for b, n in enumerate(lens):
        k = key_scale * torch.randn(n, Hkv, D, generator=g)
        if needle is not None:
            k = k.clamp(-KEY_CLIP, KEY_CLIP)
            pos = int(torch.randint(0, n, (1,), generator=g))
            qg = q[b].reshape(Hkv, Hq // Hkv, D)
            c = needle * KEY_CLIP * qg.abs().sum(-1).amax(-1) / qg[:, 0].square().sum(-1)  # [Hkv]
            k[pos] = c[:, None] * qg[:, 0]
            needle_pos.append(pos)
        keys.append(k)
        for lb in range(-(-n // bs)):
            phys = int(perm[used])
            used += 1
            table[b, lb] = phys
            chunk = k[lb * bs:(lb + 1) * bs]
            kmin[phys], kmax[phys] = chunk.amin(0), chunk.amax(0)
    return q, keys, kmin, kmax, table, torch.tensor(lens, dtype=torch.int32), needle_pos


@pytest.fixture(scope="session")
def paged():
    """paged_summaries (test modules cannot import conftest); session-scoped, so hypothesis tests may use it."""
    return paged_summaries
