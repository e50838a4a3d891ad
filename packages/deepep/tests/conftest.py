"""Shared helpers: multi-rank runs of the worker functions in workers.py (a plain file, not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepep.testing import run_on_ranks

WORKERS = str(Path(__file__).with_name("workers.py"))


@pytest.fixture
def ranks():
    """ranks(world_size, "worker_name", timeout_s=..., **kwargs) -> per-rank results."""

    def run(world_size: int, name: str, **kwargs):
        return run_on_ranks(world_size, WORKERS, name, **kwargs)

    return run
