"""Shared helpers: multi-rank runs of the worker functions in workers.py (a plain file, not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepep.testing import run_on_ranks

WORKERS = str(Path(__file__).with_name("workers.py"))


def pytest_configure(config):
    # Registered here too, so --strict-markers passes where pytest-timeout is not installed.
    config.addinivalue_line("markers", "timeout(seconds): per-test time limit (pytest-timeout)")


@pytest.fixture
def ranks():
    """ranks(world_size, "worker_name", timeout_s=..., **kwargs) -> per-rank results."""

    def run(world_size: int, name: str, **kwargs):
        return run_on_ranks(world_size, WORKERS, name, **kwargs)

    return run
