"""compile_c: C source -> shared library (system compiler) -> functions callable through cffi."""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache import cached_build, content_key
from ..errors import CompileError
from ..tensors import data_ptr, dtype_of

log = logging.getLogger("tilehal.jit.c")

DEFAULT_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")


def c_compiler() -> str | None:
    """The C compiler to use: $CC, else cc/gcc/clang on PATH."""
    env = os.environ.get("CC")
    if env:
        return env
    for cand in ("cc", "gcc", "clang"):
        if shutil.which(cand):
            return cand
    return None


@functools.cache
def c_compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
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
        """A typed C pointer to the data of a numpy array or CPU torch tensor (no copy)."""
        ctype = ctype or dtype_of(x).c_name
        return self.ffi.cast(f"{ctype} *", data_ptr(x))


_load_lock = threading.Lock()


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
    cc = c_compiler()
    if cc is None:
        raise CompileError("compile_c: no C compiler found (set $CC or install gcc/clang)")
    all_flags = [*DEFAULT_FLAGS, *(["-fopenmp"] if openmp else []), *flags]
    all_flags += [f"-I{os.fspath(d)}" for d in include_dirs]
    libs = [f"-l{lib}" for lib in libraries]
    key = content_key("c", source, cdef, " ".join(all_flags), " ".join(libs), c_compiler_version(cc), cpu_target())

    def build(work: Path) -> bytes:
        src = work / f"{name}.c"
        out = work / f"{name}.so"
        src.write_text(source)
        cmd = [cc, *all_flags, str(src), "-o", str(out), *libs, "-lm"]
        log.debug("compile_c: %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"compile_c: {cc} failed on {name}.c (exit {proc.returncode})",
                               log=proc.stderr + proc.stdout, source_name=f"{name}.c")
        return out.read_bytes()

    import cffi  # imported here so CUDA-only machines without cffi can still import tilehal

    t0 = time.perf_counter()
    path, hit = cached_build("c", key, f"{name}.so", build)
    ffi = cffi.FFI()
    try:
        ffi.cdef(cdef)
    except cffi.CDefError as e:
        raise CompileError(f"compile_c: bad cdef for {name}: {e}") from e
    with _load_lock:
        lib = ffi.dlopen(str(path))
    return CLibrary(ffi=ffi, lib=lib, path=path, cache_hit=hit, compile_seconds=time.perf_counter() - t0)
