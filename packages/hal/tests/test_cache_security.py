"""The compile cache as an attacker sees it: forged entries, symlinks, foreign roots, bad names,
stuck locks, and the C cache key's ambiguities (issue 16, items 2 and 3)."""

import fcntl
import hashlib
import os
import shutil
import time

import numpy as np
import pytest
from tilehal import ArgumentError, CacheError, CompileError, compile_c
from tilehal.cache import cached_build

pytest.importorskip("cffi", reason="compile_c loads libraries through cffi")

GOOD = "int answer(void) { return 42; }"
EVIL = "int answer(void) { return 666; }"
CDEF = "int answer(void);"


def _evil_library(tmp_path, monkeypatch):
    """Build the attacker's library in a cache of its own and return (bytes, its .hmac record)."""
    other = tmp_path / "attacker-cache"
    with monkeypatch.context() as m:
        m.setenv("TILESTACK_CACHE_DIR", str(other))
        m.setenv("TILESTACK_CACHE_KEY_FILE", str(tmp_path / "attacker.key"))
        lib = compile_c(EVIL, CDEF)
        assert lib.lib.answer() == 666
        return lib.path.read_bytes(), (lib.path.parent / "module.so.hmac").read_text()


def test_forged_artifact_and_checksum_are_not_loaded(cache, tmp_path, monkeypatch):
    first = compile_c(GOOD, CDEF)
    evil, evil_mac = _evil_library(tmp_path, monkeypatch)
    entry = first.path.parent
    for record in (hashlib.sha256(evil).hexdigest(), evil_mac):  # a plain checksum; a MAC under another key
        first.path.unlink()
        first.path.write_bytes(evil)
        (entry / "module.so.hmac").write_text(record)
        (entry / "module.so.sha256").write_text(hashlib.sha256(evil).hexdigest())
        again = compile_c(GOOD, CDEF)
        assert not again.cache_hit
        assert again.lib.answer() == 42


def test_symlinked_artifact_is_not_followed(cache, tmp_path, monkeypatch):
    first = compile_c(GOOD, CDEF)
    evil, _ = _evil_library(tmp_path, monkeypatch)
    target = tmp_path / "evil.so"
    target.write_bytes(evil)
    first.path.unlink()
    first.path.symlink_to(target)
    again = compile_c(GOOD, CDEF)
    assert again.lib.answer() == 42
    assert not again.path.is_symlink()
    assert target.read_bytes() == evil  # the link's target was never written


def test_symlinked_entry_and_kind_dirs_are_replaced(cache, tmp_path):
    first = compile_c(GOOD, CDEF)
    entry = first.path.parent
    planted = tmp_path / "planted"
    shutil.copytree(entry, planted)
    shutil.rmtree(entry)
    entry.symlink_to(planted, target_is_directory=True)
    again = compile_c(GOOD, CDEF)
    assert again.lib.answer() == 42 and not entry.is_symlink() and entry.is_dir()
    shutil.rmtree(cache / "c")
    (cache / "c").symlink_to(planted, target_is_directory=True)
    assert compile_c(GOOD, CDEF).lib.answer() == 42
    assert not (cache / "c").is_symlink()


def test_symlinked_lock_is_not_followed(cache, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    entry = cache / "t" / "k1"
    entry.mkdir(parents=True)
    (entry / ".lock").symlink_to(victim)
    art = cached_build("t", "k1", "a.bin", lambda work: b"data")
    assert art.data == b"data" and victim.read_text() == "precious"
    assert not (entry / ".lock").is_symlink()


def test_world_writable_root_is_repaired(cache):
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    compile_c(GOOD, CDEF)
    assert os.stat(cache).st_mode & 0o777 == 0o700


def test_foreign_root_is_refused(cache, monkeypatch):
    cache.mkdir()
    monkeypatch.setattr("tilehal.cache._uid", lambda: os.getuid() + 1)
    with pytest.raises(CacheError, match="owned by uid"):
        compile_c(GOOD, CDEF)


@pytest.mark.parametrize("name", ["../../../x", "a/b", ".hidden", "", "x" * 200, "nul\0", 7])
def test_names_that_leave_the_cache_are_refused(cache, tmp_path, name):
    with pytest.raises(ArgumentError, match="name"):
        compile_c(GOOD, CDEF, name=name)
    assert not (tmp_path / "x.so").exists() and not (tmp_path / "x").exists()


def test_stuck_lock_gives_an_error_naming_it(cache, monkeypatch):
    monkeypatch.setenv("TILESTACK_CACHE_LOCK_TIMEOUT", "0.3")
    entry = cache / "t" / "stuck"
    entry.mkdir(parents=True, mode=0o700)
    with open(entry / ".lock", "a+") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # another open file description: it conflicts
        holder.write(str(os.getpid()))
        holder.flush()
        t0 = time.monotonic()
        with pytest.raises(CacheError, match=r"stuck/\.lock: still held by pid"):
            cached_build("t", "stuck", "a.bin", lambda work: b"x")
        assert time.monotonic() - t0 < 5


def test_key_file_readable_by_others_is_rotated_and_one_inside_the_cache_refused(cache, tmp_path, monkeypatch):
    from tilehal.cache import _load_key

    first = compile_c(GOOD, CDEF)
    key = tmp_path / "config" / "cache.key"
    assert key.stat().st_mode & 0o777 == 0o600
    old = key.read_bytes()
    os.chmod(key, 0o644)
    _load_key.cache_clear()
    again = compile_c(GOOD, CDEF)
    assert not again.cache_hit and key.read_bytes() != old and first.path == again.path
    monkeypatch.setenv("TILESTACK_CACHE_KEY_FILE", str(cache / "cache.key"))
    with pytest.raises(CacheError, match="outside the cache"):
        compile_c(GOOD, CDEF)


# ----------------------------------------------------------------------------- item 3: the C key

SHOW = """
#define S(x) #x
#define STR(x) S(x)
const char *value(void) { return STR(A); }
"""


def test_flags_are_hashed_as_a_list(cache):
    one = compile_c(SHOW, "const char *value(void);", flags=["-DA=1 -DB=2"])  # A is "1 -DB=2"
    two = compile_c(SHOW, "const char *value(void);", flags=["-DA=1", "-DB=2"])  # A is 1
    assert one.path != two.path and not two.cache_hit
    assert one.ffi.string(one.lib.value()) == b"1 -DB=2"
    assert two.ffi.string(two.lib.value()) == b"1"


def test_headers_under_include_dirs_are_hashed(cache, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 1\n")
    src = '#include "v.h"\nint v(void) { return V; }'
    assert compile_c(src, "int v(void);", include_dirs=[inc]).lib.v() == 1
    (inc / "v.h").write_text("#define V 2\n")
    edited = compile_c(src, "int v(void);", include_dirs=[inc])
    assert not edited.cache_hit and edited.lib.v() == 2
    (inc / "v.h").write_text("#define V 3\n")  # also through -I in flags
    assert compile_c(src, "int v(void);", flags=[f"-I{inc}"]).lib.v() == 3


@pytest.mark.parametrize("flag", ["-E", "-S", "-c", "-o", "-o/tmp/x.so", "-fsyntax-only", "-M"])
def test_flags_that_make_a_non_library_are_refused(cache, flag):
    with pytest.raises(ArgumentError, match="flags"):
        compile_c(GOOD, CDEF, flags=[flag])
    assert not (cache / "c").exists() or not any((cache / "c").iterdir())


def test_a_build_that_is_not_a_library_is_never_cached(cache):
    from tilehal.jit.c import _check_shared_library

    with pytest.raises(CompileError, match="shared library"):
        cached_build("c", "garbage", "module.so", lambda work: b"int x;\n", validate=_check_shared_library)
    assert not (cache / "c" / "garbage" / "module.so").exists()


def test_flags_as_a_bare_string_are_refused(cache):
    with pytest.raises(ArgumentError, match="flags"):
        compile_c(GOOD, CDEF, flags="-O2")


def test_missing_cc_names_it(cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc-that-is-not-there")
    with pytest.raises(CompileError, match=r"\$CC"):
        compile_c(GOOD, CDEF)


def test_ptr_refuses_strided_views(cache):
    lib = compile_c("void fill(float *x, long n) { for (long i = 0; i < n; i++) x[i] = 1; }",
                    "void fill(float *x, long n);")
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(Exception) as info:
        lib.ptr(a[:, 1])
    assert "contiguous" in str(info.value) and type(info.value).__name__ == "ShapeError"
    assert lib.ptr(a[1]) is not None  # a row is contiguous


def test_checks_name_the_argument():
    from tilehal import Arg, bench, get_dtype

    for bad in (2**31, -(2**31) - 1, 1.5, True):
        with pytest.raises(ArgumentError, match="Arg.i32"):
            Arg.i32(bad)
    with pytest.raises(ArgumentError, match="Arg.u32"):
        Arg.u32(-1)
    assert Arg.u32(2**32 - 1).obj.value == 2**32 - 1
    with pytest.raises(ArgumentError, match="dtype"):
        get_dtype(None)
    with pytest.raises(ArgumentError, match="iters"):
        bench(lambda: None, iters=0, device="cpu")
    with pytest.raises(ArgumentError, match="warmup"):
        bench(lambda: None, warmup=-1, device="cpu")
    with pytest.raises(ArgumentError, match="fn"):
        bench(None, device="cpu")


def test_an_unusable_default_key_location_falls_back_to_a_private_temp_dir(cache, tmp_path, monkeypatch):
    from tilehal.cache import _load_key

    monkeypatch.delenv("TILESTACK_CACHE_KEY_FILE")
    ro = tmp_path / "ro-config"
    ro.mkdir()
    (ro / "tilestack").write_text("a file where the key directory should be")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(ro))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    _load_key.cache_clear()
    assert compile_c(GOOD, CDEF).lib.answer() == 42
    key = tmp_path / "tmp" / f"tilestack-{os.getuid()}" / "cache.key"
    assert key.stat().st_mode & 0o777 == 0o600 and (key.parent.stat().st_mode & 0o777) == 0o700
    monkeypatch.setenv("TILESTACK_CACHE_KEY_FILE", str(ro / "tilestack" / "cache.key"))  # explicit: no fallback
    _load_key.cache_clear()
    with pytest.raises(CacheError, match="TILESTACK_CACHE_KEY_FILE"):
        compile_c(GOOD, CDEF)
