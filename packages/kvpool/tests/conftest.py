"""Shared helpers for kvpool tests (no imports between test files: --import-mode=importlib)."""

from __future__ import annotations

import kvpool
import pytest
import torch


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Independent oracle: torch SDPA (float64) of one query row against contiguous K/V [T, H, D]."""
    qh = q.double()[None, :, None, :]  # [1, Hq, 1, D]
    kh = k.double().transpose(0, 1)[None]  # [1, H, T, D]
    vh = v.double().transpose(0, 1)[None]
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    return out[0, :, 0, :]


def _fill_pool(pool: kvpool.KVPool, lens: list[int], layer: int = 0, seed: int = 0, base: int = 0):
    """Add sequences base.. with distinct prompts, write random K/V; returns {seq_id: (k, v)} as written."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    for i, L in enumerate(lens):
        sid = base + i
        pool.add_sequence(sid, [sid * 100_003 + j for j in range(L)])
        slots = pool.append(sid, L)
        k = torch.randn(L, pool.num_kv_heads, pool.head_dim, generator=g)
        v = torch.randn(L, pool.num_kv_heads, pool.head_dim, generator=g)
        pool.write(layer, slots, k, v)
        written[sid] = (k, v)
    return written


def _gpu_pool(lens, heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16, chunk=48, seed=0):
    """A GPU pool whose sequences' blocks interleave (appended round-robin in chunks), random K/V."""
    total = sum(-(-L // block_size) for L in lens) + 8
    pool = kvpool.KVPool(1, heads, head_dim, total, block_size=block_size, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for i, L in enumerate(lens):
        pool.add_sequence(i, [i] * max(L, 1), extra_key=i)
    done = [0] * len(lens)
    while any(d < L for d, L in zip(done, lens)):
        for i, L in enumerate(lens):
            n = min(chunk, L - done[i])
            if n <= 0:
                continue
            slots = pool.append(i, n).cuda()
            k = torch.randn(n, heads, head_dim, device="cuda", generator=g)
            v = torch.randn(n, heads, head_dim, device="cuda", generator=g)
            pool.write(0, slots, k, v)
            done[i] += n
    return pool


@pytest.fixture
def gpu_pool():
    return _gpu_pool


@pytest.fixture
def sdpa_decode():
    return _sdpa_decode


@pytest.fixture
def fill_pool():
    return _fill_pool


@pytest.fixture
def small_pool() -> kvpool.KVPool:
    return kvpool.KVPool(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=32, block_size=4,
                         dtype=torch.float32, debug=True)
