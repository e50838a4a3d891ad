"""Shared helpers for dataengine tests (test files do not import each other)."""

import numpy as np
import pytest


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
