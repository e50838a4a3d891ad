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
