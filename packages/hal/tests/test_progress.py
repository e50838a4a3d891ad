"""tilehal.progress: tqdm when installed, else a plain counter on stderr; disable shows nothing."""

import tilehal
from tilehal.testing import without_modules


def test_progress_plain_counter_without_tqdm(capsys):
    with without_modules("tqdm"):
        assert list(tilehal.progress([3, 1, 2], desc="work", unit="job")) == [3, 1, 2]
        err = capsys.readouterr().err
        assert "work: 3/3 job" in err and err.endswith("\n")
        assert list(tilehal.progress((x for x in range(2)), desc="gen")) == [0, 1]  # no len: no total
        assert "gen: 2 it" in capsys.readouterr().err
        assert list(tilehal.progress([], desc="empty")) == [] and capsys.readouterr().err == ""


def test_progress_disabled_is_silent(capsys):
    assert list(tilehal.progress(range(4), desc="quiet", disable=True)) == [0, 1, 2, 3]
    assert capsys.readouterr().err == ""
