"""Low-latency dispatch (fixed per-expert buffers, fp8 or bf16) and weighted combine."""

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("use_fp8", [True, False])
def test_low_latency_2_ranks(ranks, use_fp8):
    ranks(2, "low_latency", use_fp8=use_fp8, tokens=[32, 7])


def test_low_latency_4_ranks_with_idle_rank(ranks):
    ranks(4, "low_latency", use_fp8=True, tokens=[16, 0, 30, 5], experts=16, k=4)


def test_low_latency_size_hint_and_capture():
    """DeepEP's static helpers: the size hint grows with every dimension and checks its input."""
    from deepep import Buffer, EventOverlap

    base = Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256)
    assert base > 2 * 128 * 7168 * 2  # at least the bf16 rows of both kinds
    assert Buffer.get_low_latency_rdma_size_hint(256, 7168, 2, 256) > base
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > base
    with pytest.raises(ValueError, match="num_experts"):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 3, 256)
    with pytest.raises(ValueError, match="hidden"):
        Buffer.get_low_latency_rdma_size_hint(128, 100, 2, 256)
    ev = Buffer.capture()
    assert isinstance(ev, EventOverlap)
    ev.current_stream_wait()
