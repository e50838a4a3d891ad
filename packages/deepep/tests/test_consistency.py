"""Ranks that disagree (issue 16, item 4): every rank raises a ShapeError naming what differs, before any
row moves, instead of one process dying of SIGABRT in Gloo and another returning uninitialised rows."""

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("vary, field", [("hidden", "hidden 64"), ("dtype", "x_dtype"), ("experts", "experts_per_rank"),
                                         ("topk", "topk 2")])
def test_every_rank_names_the_disagreement(ranks, vary, field):
    out = ranks(2, "disagreeing_dispatch", vary=vary, timeout_s=90)
    for rank, msg in enumerate(out):
        assert msg.startswith("dispatch: expected every rank to dispatch the same layout"), (rank, msg)
        assert field in msg or field.split()[0] in msg, (rank, msg)


def test_handle_and_layout_contradictions_are_refused(ranks):
    out = ranks(2, "handle_reuse_checks", timeout_s=90)
    for errs in out:
        assert errs[0] == "no error"  # every rank replays the handle with hidden 32: fine, as in DeepEP
        assert errs[1].startswith("topk_idx: expected the routing the handle was dispatched with")
        assert errs[2].startswith("dispatch (cached): expected every rank to dispatch the same layout") \
            and "hidden" in errs[2]  # only rank 1 changed it: refused on both ranks
        assert errs[3].startswith("num_tokens_per_expert: expected the per-expert token counts of topk_idx")
        assert errs[4].startswith("is_token_in_rank: expected the ranks topk_idx routes each token to")
        assert errs[5] == "ok True"


@pytest.mark.parametrize("odd_rank", [1, 2])  # a node peer of rank 0, then a rail peer
def test_hierarchical_ranks_name_the_disagreement(ranks, odd_rank):
    out = ranks(4, "disagreeing_dispatch", vary="hidden", odd_rank=odd_rank, transport="hierarchical",
                ranks_per_node=2, timeout_s=90)
    for rank, msg in enumerate(out):
        assert msg.startswith("dispatch: expected every rank to dispatch the same layout"), (rank, msg)


def test_nvlink_engine_layout_agreement(ranks):
    """Issue 16 item 4 for the NVLink engine (normal and low-latency): its host-side agreement check, on Gloo."""
    for msgs in ranks(3, "nvlink_agreement", timeout_s=90):
        assert msgs[0] == "exchanges 1", msgs  # the same layout again costs no exchange
        assert msgs[1].startswith("dispatch: expected every rank to call dispatch with the same layout") \
            and "hidden" in msgs[1], msgs
        assert msgs[2].startswith("low_latency_dispatch: expected every rank") and "num_experts" in msgs[2], msgs
        assert msgs[3].startswith("combine: expected every rank") and "x_dtype" in msgs[3], msgs
        assert msgs[4] == "exchanges 5", msgs


def test_combine_layouts_that_differ_are_refused_on_every_rank(ranks):
    for transport, world, per_node in (("torch", 2, None), ("hierarchical", 4, 2)):
        out = ranks(world, "disagreeing_combine", transport=transport, ranks_per_node=per_node, timeout_s=90)
        for rank, msg in enumerate(out):
            assert msg.startswith("combine: expected every rank to combine the same layout"), (transport, rank, msg)
            assert "x_dtype" in msg, msg


def test_hierarchical_cached_dispatch_checks_the_layout(ranks):
    for msgs in ranks(4, "hierarchical_cached_layout", timeout_s=90):
        assert msgs[0] == "ok 32", msgs  # every rank changed hidden alike: fine, as in DeepEP
        assert msgs[1].startswith("dispatch (cached): expected every rank to dispatch the same layout") \
            and "hidden" in msgs[1], msgs
