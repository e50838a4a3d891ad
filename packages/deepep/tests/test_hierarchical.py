"""Hierarchical transport, emulated on CPU as 2 "nodes" x 2 ranks."""

import pytest

pytestmark = pytest.mark.timeout(120)


def test_hierarchical_2x2(ranks):
    out = ranks(4, "hierarchical", ranks_per_node=2)
    assert sum(o["remote_rows"] for o in out) > 0
