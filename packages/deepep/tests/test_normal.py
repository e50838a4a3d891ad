"""Normal-mode dispatch/combine on 2 and 4 Gloo ranks against a Python reference."""

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

CASES_2 = [
    {"tokens": [37, 21], "experts": 8, "k": 4, "hidden": 64},
    {"tokens": [0, 19], "experts": 8, "k": 2, "hidden": 32, "dtype": torch.bfloat16},  # zero tokens
    {"tokens": [25, 25], "experts": 16, "k": 3, "hidden": 48, "kind": "hot", "align": 8},
    {"tokens": [12, 30], "experts": 8, "k": 4, "hidden": 64, "kinds": {0: "silent"}, "worst": 80},
]

CASES_4 = [
    {"tokens": [40, 0, 33, 17], "experts": 16, "k": 4, "hidden": 64},  # one rank with no tokens
    {"tokens": [20, 20, 20, 20], "experts": 32, "k": 8, "hidden": 128, "dtype": torch.bfloat16, "kind": "hot"},
    {"tokens": [9, 14, 3, 30], "experts": 8, "k": 2, "hidden": 64, "kinds": {1: "silent", 3: "silent"},
     "align": 4},
    {"tokens": [11, 0, 0, 6], "experts": 16, "k": 4, "hidden": 32, "worst": 64},
    {"tokens": [0, 0, 0, 0], "experts": 8, "k": 2, "hidden": 32},  # nothing anywhere
]


def test_dispatch_combine_2_ranks(ranks):
    out = ranks(2, "dispatch_combine", cases=CASES_2)
    assert sum(r[0]["received"] for r in out) > 0


def test_dispatch_combine_4_ranks(ranks):
    out = ranks(4, "dispatch_combine", cases=CASES_4)
    assert out[0][-1]["received"] == 0


def test_fp8_dispatch_4_ranks(ranks):
    ranks(4, "fp8_dispatch")


def test_async_finish_and_previous_event(ranks):
    ranks(2, "async_overlap")


def test_bad_inputs_name_the_argument(ranks):
    msgs = ranks(2, "bad_inputs")[0]
    assert "topk_idx" in msgs[0] and "int64" in msgs[0]
    assert "[-1, 8)" in msgs[1]
    assert "x.dtype" in msgs[2]
    assert "scales" in msgs[3] and "(4, 2)" in msgs[3]
    assert "topk_idx" in msgs[4]
    assert "handle" in msgs[5]


CASES_8 = [
    {"tokens": [30, 0, 12, 25, 7, 30, 1, 18], "experts": 32, "k": 8, "hidden": 64, "dtype": torch.bfloat16},
    {"tokens": [10] * 8, "experts": 64, "k": 4, "hidden": 32, "kind": "hot", "kinds": {2: "silent"}, "align": 4},
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dispatch_combine_8_ranks(ranks):
    """8 Gloo ranks (the EP8 shape of issue 8), run by hand: `pytest -m slow -k 8_ranks`."""
    ranks(8, "dispatch_combine", cases=CASES_8, timeout_s=280)
    ranks(8, "low_latency", use_fp8=True, tokens=[16, 0, 9, 16, 3, 12, 16, 1], experts=32, k=8,
          max_tokens=16, timeout_s=280)
    ranks(8, "hierarchical", ranks_per_node=4, timeout_s=280)
