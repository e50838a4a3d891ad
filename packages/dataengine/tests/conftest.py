"""Shared helpers for dataengine tests (test files do not import each other)."""

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
