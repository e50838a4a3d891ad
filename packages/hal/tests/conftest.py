import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private, empty compile cache for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TILESTACK_CACHE_DIR", str(root))
    monkeypatch.setenv("TILESTACK_CACHE_KEY_FILE", str(tmp_path / "config" / "cache.key"))
    return root
