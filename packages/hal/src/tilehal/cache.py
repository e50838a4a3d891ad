"""The on-disk compile cache shared by the C and CUDA JITs.

Layout: `$TILESTACK_CACHE_DIR/<kind>/<key>/<artifact>` plus `<artifact>.hmac` and a `.lock`.

What it trusts, and how it checks (docs/security.md has the whole model):

- The root must be a directory owned by this user. One writable by group or others is repaired
  to 0700 (with a warning); one owned by someone else is refused with a `CacheError`.
- Every path below the root is opened relative to its parent's file descriptor with
  `O_NOFOLLOW`: a symlink planted for a directory, an artifact or a lock file is never followed
  (it is removed and the entry rebuilt). Every directory and file must be ours and not writable
  by group or others.
- Names (`kind`, `key`, the artifact name) are single path components of `[A-Za-z0-9_.+-]`;
  `../x` is refused before anything touches the disk.
- Integrity: `<artifact>.hmac` is an HMAC-SHA256 of (kind, key, artifact name, bytes) under a
  per-user key kept outside the cache (`$TILESTACK_CACHE_KEY_FILE`, default
  `~/.config/tilestack/cache.key`, mode 0600). Whoever can write the cache but not read that key
  cannot make us load their bytes; a mismatch means a rebuild, never a load.
- The bytes that were verified are the bytes used: CUDA gets them from memory; a C library is
  loaded by path only while that path still names the inode that was verified (checked before
  and after dlopen).
- Writes go to a temporary file in the entry (O_EXCL, 0600) and are renamed into place; a
  per-key lock serialises builders, and every wait for it is bounded
  (`$TILESTACK_CACHE_LOCK_TIMEOUT`, default 600 s) by a `CacheError` naming the lock and its
  holder's pid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ArgumentError, CacheError

log = logging.getLogger("tilehal.cache")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_POLL_S = 0.05


def check_name(name: object, arg: str = "name") -> str:
    """`name` if it is one safe path component (letters, digits, `_ . + -`, not starting with `.`)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(f"{arg}: expected 1-128 characters of [A-Za-z0-9_.+-] not starting with '.', "
                            f"got {name!r}")
    return name


def _uid() -> int:
    return os.getuid()


def _check_owned(st: os.stat_result, what: str, fd: int | None = None) -> None:
    """Refuse a path another user owns; repair group/world write bits on our own (via `fd`)."""
    if st.st_uid != _uid():
        raise CacheError(f"{what}: expected to be owned by uid {_uid()}, got uid {st.st_uid}; refusing to use it "
                         "(set TILESTACK_CACHE_DIR to a directory of your own)")
    if st.st_mode & 0o022:
        if fd is None:
            raise CacheError(f"{what}: expected no group/world write permission, got mode {oct(st.st_mode & 0o777)}")
        log.warning("%s was writable by group or others (mode %s); repaired to owner-only", what,
                    oct(st.st_mode & 0o777))
        os.fchmod(fd, (st.st_mode & 0o700) if stat.S_ISREG(st.st_mode) else 0o700)


def _owned_fd(fd: int, what: str) -> int:
    """fd after _check_owned on it; closed when the check raises."""
    try:
        _check_owned(os.fstat(fd), what, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _root_path() -> Path:
    return Path(os.environ.get("TILESTACK_CACHE_DIR") or Path.home() / ".cache" / "tilestack")


def _open_root() -> int:
    root = _root_path()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CacheError(f"TILESTACK_CACHE_DIR: cannot use {root} as the compile cache: {e}") from e
    return _owned_fd(fd, f"compile cache root {root}")


def cache_dir() -> Path:
    """The cache root, created 0700 (compiled code is executable: keep it private) and checked."""
    os.close(_open_root())
    return _root_path()


def _remove_planted(dir_fd: int, name: str, where: str) -> None:
    """Remove a symlink (or other non-directory) found where a cache directory or file belongs."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        log.warning("compile cache: %s/%s is a %s, not what the cache put there; removing it", where, name,
                    "symlink" if stat.S_ISLNK(st.st_mode) else "foreign entry")
        if stat.S_ISDIR(st.st_mode):
            raise CacheError(f"{where}/{name}: expected a regular file, found a directory")
        os.unlink(name, dir_fd=dir_fd)


def _open_subdir(parent_fd: int, name: str, where: str) -> int:
    """Open (creating 0700) the directory `name` under `parent_fd`, never through a symlink."""
    for attempt in range(2):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR) or attempt:
                raise CacheError(f"{where}/{name}: cannot open cache directory: {e}") from e
            _remove_planted(parent_fd, name, where)
            continue
        return _owned_fd(fd, f"{where}/{name}")
    raise AssertionError("unreachable")


def _open_file(dir_fd: int, name: str, where: str, flags: int, mode: int = 0o600) -> int | None:
    """Open a file in a cache directory without following symlinks; None when it is absent.

    A symlink or a file of ours that others may write is removed (returns None: rebuild it).
    """
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise CacheError(f"{where}/{name}: cannot open: {e}") from e
        _remove_planted(dir_fd, name, where)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid() or st.st_mode & 0o022:
        os.close(fd)
        if st.st_uid != _uid():
            raise CacheError(f"{where}/{name}: expected a file owned by uid {_uid()}, got uid {st.st_uid}")
        log.warning("compile cache: %s/%s has mode %s (writable by others); discarding it", where, name,
                    oct(st.st_mode & 0o777))
        _remove_planted(dir_fd, name, where)
        return None
    return fd


def _read_fd(fd: int) -> bytes:
    chunks = []
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


# ----------------------------------------------------------------------------- the per-user key


def key_file() -> Path:
    """Where the per-user HMAC key lives: $TILESTACK_CACHE_KEY_FILE, else ~/.config/tilestack/cache.key."""
    env = os.environ.get("TILESTACK_CACHE_KEY_FILE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "tilestack" / "cache.key"


@functools.lru_cache(maxsize=8)
def _load_key(path: str, root: str) -> bytes:
    p = Path(path)
    if Path(os.path.realpath(p)).is_relative_to(os.path.realpath(root)):
        raise CacheError(f"TILESTACK_CACHE_KEY_FILE: expected a path outside the cache {root}, got {p}")
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CacheError(f"TILESTACK_CACHE_KEY_FILE: cannot create the cache key's directory {p.parent}: {e}") from e
    try:
        _check_owned(os.fstat(dfd), f"cache key directory {p.parent}", dfd)
        for _ in range(3):
            fd = _open_file(dfd, p.name, str(p.parent), os.O_RDONLY)
            if fd is not None:
                try:
                    st = os.fstat(fd)
                    key = _read_fd(fd)
                finally:
                    os.close(fd)
                if st.st_mode & 0o077 or len(key) < 32:
                    # Readable by others (or truncated): it may be known, so it is worth nothing. Rotate it.
                    log.warning("cache key %s had mode %s / %d bytes; replacing it (cached builds will be redone)",
                                p, oct(st.st_mode & 0o777), len(key))
                    os.unlink(p.name, dir_fd=dfd)
                    continue
                return key
            tmp = f".{p.name}.{secrets.token_hex(8)}.tmp"
            tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                os.write(tfd, secrets.token_bytes(32))
                os.fsync(tfd)
            finally:
                os.close(tfd)
            try:
                os.link(tmp, p.name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)  # fails if one exists
            except FileExistsError:
                pass  # another process made the key first: use theirs
            finally:
                os.unlink(tmp, dir_fd=dfd)
        raise CacheError(f"TILESTACK_CACHE_KEY_FILE: could not create a stable key at {p}")
    except OSError as e:
        if isinstance(e, CacheError):
            raise
        raise CacheError(f"TILESTACK_CACHE_KEY_FILE: cannot read or create the cache key {p}: {e}") from e
    finally:
        os.close(dfd)


def _secret() -> bytes:
    root = str(_root_path())
    try:
        return _load_key(str(key_file()), root)
    except CacheError as e:
        if os.environ.get("TILESTACK_CACHE_KEY_FILE"):
            raise
        # No usable ~/.config (a read-only home, say): a private per-user directory under the temp dir.
        fallback = Path(tempfile.gettempdir()) / f"tilestack-{_uid()}" / "cache.key"
        log.warning("compile cache: %s; using the key at %s instead (set TILESTACK_CACHE_KEY_FILE to choose)",
                    e, fallback)
        return _load_key(str(fallback), root)


def _mac(kind: str, key: str, artifact_name: str, data: bytes) -> str:
    secret = _secret()
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (b"tilestack-cache-v2", kind.encode(), key.encode(), artifact_name.encode(), data):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


# ----------------------------------------------------------------------------- keys and digests


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


HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".hh", ".hxx", ".inc", ".inl", ".cu", ".def")


def headers_digest(dirs: Iterable[str | os.PathLike]) -> str:
    """Digest of every header file under `dirs` (relative path and bytes), so an edit changes the key."""
    h = hashlib.sha256()
    for d in dirs:
        d = os.fspath(d)
        h.update(len(d).to_bytes(8, "little"))
        h.update(d.encode())
        h.update(_dir_digest(d, _dir_stamp(d)).encode())
    return h.hexdigest()


def _dir_stamp(d: str) -> tuple:
    root = Path(d)
    if not root.is_dir():
        return ()
    out = []
    for p in root.rglob("*"):
        if p.suffix in HEADER_SUFFIXES and p.is_file():
            st = p.stat()
            out.append((str(p), st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=64)
def _dir_digest(d: str, stamp: tuple) -> str:
    # `stamp` (paths, mtimes, sizes) keys the memo so an edit is noticed without rehashing every call.
    h = hashlib.sha256()
    for path, _, _ in stamp:
        p = Path(path)
        rel = str(p.relative_to(d)).encode()
        body = p.read_bytes()
        for part in (rel, body):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


# ----------------------------------------------------------------------------- writes and locks


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same directory and a rename (by path)."""
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


def _atomic_write_at(dir_fd: int, name: str, data: bytes) -> None:
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def lock_timeout_s() -> float:
    raw = os.environ.get("TILESTACK_CACHE_LOCK_TIMEOUT", "600")
    try:
        value = float(raw)
    except ValueError:
        raise ArgumentError(f"TILESTACK_CACHE_LOCK_TIMEOUT: expected seconds as a number, got {raw!r}") from None
    if not value > 0:
        raise ArgumentError(f"TILESTACK_CACHE_LOCK_TIMEOUT: expected a positive number of seconds, got {raw!r}")
    return value


@contextlib.contextmanager
def _locked(dir_fd: int, where: str, timeout_s: float | None = None) -> Iterator[None]:
    timeout_s = lock_timeout_s() if timeout_s is None else timeout_s
    fd = None
    for _ in range(2):
        fd = _open_file(dir_fd, ".lock", where, os.O_RDWR | os.O_CREAT)
        if fd is not None:
            break
    if fd is None:
        raise CacheError(f"{where}/.lock: could not create the lock file")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_fd(fd).decode(errors="replace").strip() or "unknown"
                    raise CacheError(f"{where}/.lock: still held by pid {holder} after {timeout_s:g} s "
                                     "(TILESTACK_CACHE_LOCK_TIMEOUT); is a compile stuck? Remove the entry "
                                     "or raise the timeout") from None
                time.sleep(_LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the entry point


@dataclass
class CachedArtifact:
    """A verified artifact: its `data`, its `path`, and whether it came from the cache.

    `fd` (when not None) is an open read-only descriptor of exactly the verified file; the
    caller closes it (`close()`).
    """

    path: Path
    data: bytes
    hit: bool
    fd: int | None = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __iter__(self):  # (path, hit), as the cache returned before CachedArtifact existed
        return iter((self.path, self.hit))


def _load_verified(entry_fd: int, where: str, kind: str, key: str, artifact_name: str,
                   keep_fd: bool) -> tuple[bytes, int | None] | None:
    fd = _open_file(entry_fd, artifact_name, where, os.O_RDONLY)
    if fd is None:
        return None
    try:
        data = _read_fd(fd)
        mfd = _open_file(entry_fd, artifact_name + ".hmac", where, os.O_RDONLY)
        if mfd is None:
            return None
        try:
            record = _read_fd(mfd).decode(errors="replace").strip()
        finally:
            os.close(mfd)
        if not hmac.compare_digest(record, _mac(kind, key, artifact_name, data)):
            log.warning("compile cache: %s/%s failed its integrity check (HMAC); rebuilding", where, artifact_name)
            return None
        out = (data, fd if keep_fd else None)
        if keep_fd:
            fd = None
        return out
    finally:
        if fd is not None:
            os.close(fd)


def cached_build(kind: str, key: str, artifact_name: str, build: Callable[[Path], bytes], *,
                 keep_fd: bool = False, validate: Callable[[bytes], None] | None = None) -> CachedArtifact:
    """Return a verified artifact for (kind, key), building it with `build(workdir)` on a miss.

    `build` runs at most once per key across processes at a time, in a private temporary
    directory outside the cache. `validate(data)` may raise to refuse what a build produced
    (nothing is cached then). With `keep_fd`, the result holds an open descriptor of the file.
    """
    for arg, value in (("kind", kind), ("key", key), ("artifact_name", artifact_name)):
        check_name(value, arg)
    root_fd = _open_root()
    root = _root_path()
    try:
        kind_fd = _open_subdir(root_fd, kind, str(root))
        try:
            entry_fd = _open_subdir(kind_fd, key, f"{root}/{kind}")
        finally:
            os.close(kind_fd)
    finally:
        os.close(root_fd)
    where = f"{root}/{kind}/{key}"
    path = Path(where) / artifact_name
    try:
        got = _load_verified(entry_fd, where, kind, key, artifact_name, keep_fd)
        if got is not None:
            return CachedArtifact(path, got[0], True, got[1])
        with _locked(entry_fd, where):
            got = _load_verified(entry_fd, where, kind, key, artifact_name, keep_fd)
            if got is not None:  # another process built it while we waited
                return CachedArtifact(path, got[0], True, got[1])
            with tempfile.TemporaryDirectory(prefix=f"tilestack-build-{kind}-") as work:
                data = build(Path(work))
            if validate is not None:
                validate(data)
            _atomic_write_at(entry_fd, artifact_name, data)
            _atomic_write_at(entry_fd, artifact_name + ".hmac", _mac(kind, key, artifact_name, data).encode())
            fd = None
            if keep_fd:
                fd = _open_file(entry_fd, artifact_name, where, os.O_RDONLY)
                if fd is None or _read_fd(fd) != data:
                    if fd is not None:
                        os.close(fd)
                    raise CacheError(f"{where}/{artifact_name}: changed while it was being written")
            return CachedArtifact(path, data, False, fd)
    finally:
        os.close(entry_fd)


def flag_list(flags: Sequence[str], arg: str) -> list[str]:
    """`flags` as a list of strings; refuse a bare string (it would be split into characters)."""
    if isinstance(flags, (str, bytes)) or not isinstance(flags, (list, tuple)) or \
            not all(isinstance(f, str) for f in flags):
        raise ArgumentError(f"{arg}: expected a sequence of strings, got {flags!r}")
    return list(flags)
