"""Low-latency dispatch (fixed per-expert buffers, fp8 or bf16) and weighted combine."""

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("use_fp8", [True, False])
def test_low_latency_2_ranks(ranks, use_fp8):
    ranks(2, "low_latency", use_fp8=use_fp8, tokens=[32, 7])


def test_low_latency_4_ranks_with_idle_rank(ranks):
    ranks(4, "low_latency", use_fp8=True, tokens=[16, 0, 30, 5], experts=16, k=4)
