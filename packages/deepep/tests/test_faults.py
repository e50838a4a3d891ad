"""A dead or stalled peer gives CommTimeoutError (rank, stage, and the peer that stopped answering) within the
timeout, never a hang."""

import pytest

pytestmark = pytest.mark.timeout(90)


def test_killed_rank_4_ranks(ranks):
    timeout_s = 3.0
    out = ranks(4, "killed_rank", victim=3, comm_timeout_s=timeout_s, allow_missing={3}, pg_timeout_s=20)
    for rank, err in enumerate(out[:3]):
        assert err["elapsed"] < timeout_s + 2.0, err
        assert err["rank"] == rank and err["stage"].startswith("dispatch/"), err
        assert f"rank {rank}" in err["msg"] and "dispatch/" in err["msg"]
        assert err["peer"] == 3 and "waiting for rank 3" in err["msg"], err  # the peer that stopped answering


def test_stalled_rank_times_out(ranks):
    timeout_s = 2.0
    out = ranks(2, "stalled_rank", comm_timeout_s=timeout_s, pg_timeout_s=30)
    err = out[0]
    assert timeout_s - 0.1 < err["elapsed"] < timeout_s + 2.0, err
    assert err["rank"] == 0 and err["stage"] == "dispatch/counts" and "timed out" in err["msg"]
    assert err["peer"] == 1 and "waiting for rank 1" in err["msg"], err
