"""The on-disk compile cache shared by the C and CUDA JITs.

Layout: `$TILESTACK_CACHE_DIR/<kind>/<key>/<artifact>` plus `<artifact>.sha256`. Writes go to a
temporary file in the same directory and are renamed into place, so a reader never sees half
a file; a per-key lock file serialises builders so N processes compiling one source leave one
entry and run the compiler once; the checksum catches a truncated or corrupted artifact,
which is then rebuilt instead of being loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("tilehal.cache")


def cache_dir() -> Path:
    """The cache root, created with mode 0700 (compiled code is executable: keep it private)."""
    root = Path(os.environ.get("TILESTACK_CACHE_DIR") or Path.home() / ".cache" / "tilestack")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


def content_key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:32]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _verified(artifact: Path) -> bool:
    digest = artifact.with_name(artifact.name + ".sha256")
    if not artifact.exists() or not digest.exists():
        return False
    if sha256_file(artifact) == digest.read_text().strip():
        return True
    log.warning("cache entry %s failed its checksum; rebuilding", artifact)
    return False


def cached_build(kind: str, key: str, artifact_name: str, build: Callable[[Path], bytes]) -> tuple[Path, bool]:
    """Return (path to a verified artifact, whether it came from the cache).

    `build(workdir)` produces the artifact's bytes; it runs at most once per key across
    processes at a time.
    """
    entry = cache_dir() / kind / key
    entry.mkdir(mode=0o700, parents=True, exist_ok=True)
    artifact = entry / artifact_name
    if _verified(artifact):
        return artifact, True
    with _locked(entry / ".lock"):
        if _verified(artifact):  # another process built it while we waited
            return artifact, True
        with tempfile.TemporaryDirectory(dir=entry, prefix=".build-") as work:
            data = build(Path(work))
        atomic_write(artifact, data)
        atomic_write(artifact.with_name(artifact.name + ".sha256"), hashlib.sha256(data).hexdigest().encode())
        return artifact, False
