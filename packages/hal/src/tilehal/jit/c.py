"""compile_c: C source -> shared library (system compiler) -> functions callable through cffi."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache import cached_build, check_name, content_key, flag_list, headers_digest
from ..errors import ArgumentError, CacheError, CompileError, ShapeError
from ..tensors import data_ptr, device_of, dtype_of, is_array, is_contiguous, is_torch

log = logging.getLogger("tilehal.jit.c")

DEFAULT_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")

# Flags that make the compiler emit something other than a shared library (or write elsewhere).
_REFUSED_FLAGS = frozenset({"-E", "-S", "-c", "-M", "-MM", "-fsyntax-only", "-###", "--preprocess", "--assemble",
                            "--compile", "-save-temps", "-o", "--output"})
_REFUSED_PREFIXES = ("-o", "--output=", "-save-temps=", "-MF", "-dump")


def _check_flags(flags: list[str]) -> None:
    for f in flags:
        if f in _REFUSED_FLAGS or f.startswith(_REFUSED_PREFIXES) and not f.startswith("-openmp"):
            raise ArgumentError(f"flags: expected flags that still build a shared library, got {f!r} "
                                "(compile_c always emits one .so; -E/-S/-c/-o and friends are refused)")


def _include_dirs_in(flags: list[str]) -> list[str]:
    """Directories named by -I/-isystem/-iquote/-idirafter in `flags` (their headers join the key)."""
    out, take = [], False
    for f in flags:
        if take:
            out.append(f)
            take = False
        elif f in ("-I", "-isystem", "-iquote", "-idirafter"):
            take = True
        elif f.startswith("-I"):
            out.append(f[2:])
        else:
            for p in ("-isystem", "-iquote", "-idirafter"):
                if f.startswith(p) and len(f) > len(p):
                    out.append(f[len(p):])
    return out


def _check_shared_library(data: bytes) -> None:
    """Refuse build output that is not a shared library (ELF ET_DYN or Mach-O MH_DYLIB)."""
    if data[:4] == b"\x7fELF" and len(data) >= 18:
        e_type = int.from_bytes(data[16:18], "little" if data[5] == 1 else "big")
        if e_type == 3:  # ET_DYN
            return
    elif data[:4] in (b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe") and len(data) >= 16:
        if int.from_bytes(data[12:16], "little") == 6:  # MH_DYLIB
            return
    raise CompileError(f"compile_c: the compiler did not produce a shared library ({len(data)} bytes starting "
                       f"{data[:8]!r}); check `flags`")


def c_compiler() -> str | None:
    """The C compiler to use: $CC (may carry words, e.g. "ccache gcc"), else cc/gcc/clang on PATH.

    A $CC that names no executable raises CompileError rather than falling back silently.
    """
    env = os.environ.get("CC")
    if env and env.strip():
        words = shlex.split(env)
        if shutil.which(words[0]) is None:
            raise CompileError(f"$CC: expected an executable C compiler, got {env!r} ({words[0]!r} is not on PATH)")
        return env
    for cand in ("cc", "gcc", "clang"):
        if shutil.which(cand):
            return cand
    return None


@functools.cache
def c_compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"


@functools.lru_cache(maxsize=1)
def cpu_target() -> str:
    """What -march=native resolves to, approximated by the machine and its CPU flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"


@dataclass
class CLibrary:
    """A loaded shared library: call `lib.<function>(...)`; `ptr(x)` passes an array's data."""

    ffi: Any  # cffi.FFI
    lib: Any
    path: Path
    cache_hit: bool
    compile_seconds: float
    _keepalive: list = field(default_factory=list, repr=False)

    def ptr(self, x: Any, ctype: str | None = None) -> Any:
        """A typed C pointer to the data of a C-contiguous numpy array or CPU torch tensor (no copy).

        Strided views are refused (C code indexing `p[i]` would walk outside them), as are
        tensors off the CPU.
        """
        if not is_array(x):
            raise ShapeError(f"x: expected a numpy array or CPU torch tensor, got {type(x).__name__}")
        if device_of(x) != "cpu":
            raise ShapeError(f"x: expected a CPU tensor, got device {device_of(x)}")
        if not is_contiguous(x):
            strides = tuple(x.stride()) if is_torch(x) else tuple(s // x.itemsize for s in x.strides)
            raise ShapeError(f"x: expected a C-contiguous array, got shape {tuple(x.shape)} with strides {strides} "
                             "(pass a contiguous copy)")
        ctype = ctype or dtype_of(x).c_name
        return self.ffi.cast(f"{ctype} *", data_ptr(x))


_load_lock = threading.Lock()


def _same_file(art: Any, when: str) -> None:
    held = os.fstat(art.fd)
    try:
        now = os.stat(art.path, follow_symlinks=False)
    except OSError as e:
        raise CacheError(f"{art.path}: vanished {when}: {e}") from e
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino) or not stat.S_ISREG(now.st_mode):
        raise CacheError(f"{art.path}: replaced {when} (not the file whose integrity was checked); refusing it")


def compile_c(
    source: str,
    cdef: str,
    *,
    flags: Sequence[str] = (),
    openmp: bool = False,
    include_dirs: Sequence[str | os.PathLike] = (),
    libraries: Sequence[str] = (),
    name: str = "module",
) -> CLibrary:
    """Build `source` into a shared library and load it; `cdef` declares what Python may call.

    Cached by (source, cdef, flags, compiler version, CPU target); a second call with the same
    inputs loads the cached library without running the compiler.
    """
    for arg, value in (("source", source), ("cdef", cdef)):
        if not isinstance(value, str):
            raise ArgumentError(f"{arg}: expected C source as str, got {type(value).__name__}")
    check_name(name)
    flags = flag_list(flags, "flags")
    _check_flags(flags)
    if isinstance(include_dirs, (str, bytes)) or not isinstance(include_dirs, (list, tuple)) or \
            not all(isinstance(d, (str, os.PathLike)) for d in include_dirs):
        raise ArgumentError(f"include_dirs: expected a sequence of directories, got {include_dirs!r}")
    if not isinstance(openmp, bool):
        raise ArgumentError(f"openmp: expected a bool, got {openmp!r}")
    inc = [os.fspath(d) for d in include_dirs]
    libraries = flag_list(libraries, "libraries")
    for lib in libraries:
        if not lib or lib.startswith("-") or "/" in lib:
            raise ArgumentError(f"libraries: expected library names like 'm' or 'pthread', got {lib!r}")
    cc = c_compiler()
    if cc is None:
        raise CompileError("compile_c: no C compiler found (set $CC or install gcc/clang)")
    all_flags = [*DEFAULT_FLAGS, *(["-fopenmp"] if openmp else []), *flags]
    all_flags += [f"-I{d}" for d in inc]
    libs = [f"-l{lib}" for lib in libraries]
    # Flags and libraries are hashed as lists (["-DA=1 -DB=2"] and ["-DA=1", "-DB=2"] differ), and the
    # headers under every include dir are hashed too, so an edited header rebuilds.
    key = content_key("c", source, cdef, json.dumps(all_flags), json.dumps(libs), c_compiler_version(cc),
                      cpu_target(), headers_digest([*inc, *_include_dirs_in(flags)]))

    def build(work: Path) -> bytes:
        src = work / f"{name}.c"
        out = work / f"{name}.so"
        src.write_text(source)
        cmd = [*shlex.split(cc), *all_flags, str(src), "-o", str(out), *libs, "-lm"]
        log.debug("compile_c: %s", " ".join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise CompileError(f"compile_c: could not run the C compiler {cc!r}: {e}") from e
        if proc.returncode != 0:
            raise CompileError(f"compile_c: {cc} failed on {name}.c (exit {proc.returncode})",
                               log=proc.stderr + proc.stdout, source_name=f"{name}.c")
        if not out.is_file():
            raise CompileError(f"compile_c: {cc} reported success but wrote no {name}.so; check `flags`",
                               log=proc.stderr + proc.stdout, source_name=f"{name}.c")
        return out.read_bytes()

    import cffi  # imported here so CUDA-only machines without cffi can still import tilehal

    t0 = time.perf_counter()
    ffi = cffi.FFI()
    try:
        ffi.cdef(cdef)
    except cffi.CDefError as e:
        raise CompileError(f"compile_c: bad cdef for {name}: {e}") from e
    art = cached_build("c", key, f"{name}.so", build, keep_fd=True, validate=_check_shared_library)
    try:
        # dlopen takes a path: make sure it names the very file whose HMAC was just checked, before
        # and after loading. (Not /proc/self/fd/N: glibc matches already-loaded libraries by name,
        # and descriptor numbers are reused.)
        with _load_lock:
            _same_file(art, "before loading")
            try:
                lib = ffi.dlopen(str(art.path))
            except OSError as e:
                raise CompileError(f"compile_c: could not load {art.path}: {e}") from e
            _same_file(art, "after loading")
    finally:
        art.close()
    return CLibrary(ffi=ffi, lib=lib, path=art.path, cache_hit=art.hit, compile_seconds=time.perf_counter() - t0)
