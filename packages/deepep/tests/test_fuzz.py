"""Fuzz deepep's dispatch/combine arguments (shapes, dtypes, strides, NaN/Inf, sizes 0 and 1, bad ids and
counts) on a 1-rank Gloo group: the reference result or a TileStackError naming the argument, never a raw
torch error or a crash. Hypothesis runs inside the rank (derandomized), so the group starts once."""

import pytest

pytestmark = pytest.mark.timeout(120)


def test_dispatch_arguments_match_the_reference_or_name_themselves(ranks):
    (out,) = ranks(1, "fuzz_dispatch_args", timeout_s=110)
    assert out["ok"] > 10 and out["refused"] > 10, out
