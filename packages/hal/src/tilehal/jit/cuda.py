"""compile_cuda: CUDA C++ -> cubin with NVRTC (nvcc as fallback), cached on disk.

Compiling needs no GPU, so every kernel template in the stack is compile-tested in CI. What the
cubin is loaded and launched with lives in launch.py.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..cache import cached_build, check_name, content_key, flag_list, headers_digest
from ..errors import ArgumentError, CompileError
from .launch import CudaModule

log = logging.getLogger("tilehal.jit.cuda")

DEFAULT_ARCH = "sm_90a"
DEFAULT_OPTIONS = ("-std=c++17", "-DNDEBUG")


def include_dir() -> Path:
    """tilehal's own device headers (`#include <tilehal/...cuh>`)."""
    return Path(__file__).resolve().parent.parent / "include"


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding the CUDA toolkit headers (cuda_bf16.h, cuda_fp8.h, ...)."""
    cands: list[Path] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(Path(os.environ[env]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent / "include")
    cands.append(Path("/usr/local/cuda/include"))
    for site in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include"):
            cands.append(Path(site) / sub)
    found: list[str] = []
    for c in cands:
        if (c / "cuda_bf16.h").exists() and str(c) not in found:
            found.append(str(c))
    return tuple(found[:1])  # one toolkit's headers; mixing versions breaks builds


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except Exception:  # the shared library may be missing even though the bindings import
        return None
    return nvrtc if int(err) == 0 else None


@functools.lru_cache(maxsize=1)
def compiler_versions() -> dict[str, str | None]:
    """Versions of the CUDA compilers found here (None when absent)."""
    out: dict[str, str | None] = {"nvrtc": None, "nvcc": None}
    nvrtc = _nvrtc()
    if nvrtc is not None:
        _, major, minor = nvrtc.nvrtcVersion()
        out["nvrtc"] = f"{major}.{minor}"
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
            out["nvcc"] = text.strip().splitlines()[-1] if text.strip() else "unknown"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return out


def _headers_digest(extra_dirs: Sequence[str] = ()) -> str:
    """Digest of every header a compile can include (tilehal's and the caller's include dirs), so
    an edited header never loads a stale cubin."""
    return headers_digest((str(include_dir()), *extra_dirs))


# ----------------------------------------------------------------------------- compile


def _compile_nvrtc(nvrtc, source: str, name: str, options: list[str], name_expressions: Sequence[str]):
    def check(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise CompileError(f"compile_cuda: NVRTC {what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
        return res[1:] if isinstance(res, tuple) else ()

    (prog,) = check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "create")
    try:
        for expr in name_expressions:
            check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), f"add name {expr}")
        opts = [o.encode() for o in options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        (log_size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        # Output buffers are fresh bytearrays: `b" " * n` is the interpreter's shared one-byte
        # object when n == 1 (an empty log), and NVRTC's NUL would then turn every b" " in the
        # process, and every " " Python encodes, into b"\0".
        buf = bytearray(log_size)
        check(nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        text = bytes(buf).decode(errors="replace").rstrip("\x00").strip()
        if int(res[0]) != 0:
            raise CompileError(f"compile_cuda: {name}.cu failed to compile with NVRTC", log=text, source_name=f"{name}.cu")
        (size,) = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = bytearray(size)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        cubin = bytes(cubin)
        lowered = {}
        for expr in name_expressions:
            (low,) = check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), f"lowered name {expr}")
            lowered[expr] = low.decode()
        return cubin, text, lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile_nvcc(source: str, name: str, options: list[str], work: Path, arch: str):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CompileError("compile_cuda: neither NVRTC (pip install 'tilestack-hal[cuda]') nor nvcc was found")
    src = work / f"{name}.cu"
    out = work / f"{name}.cubin"
    src.write_text(source)
    opts = [o for o in options if not o.startswith("--gpu-architecture")]
    cmd = [nvcc, "-cubin", f"-arch={arch}", *opts, str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = (proc.stderr + proc.stdout).strip()
    if proc.returncode != 0:
        raise CompileError(f"compile_cuda: {name}.cu failed to compile with nvcc", log=text, source_name=f"{name}.cu")
    return out.read_bytes(), text


def compile_cuda(
    source: str,
    *,
    arch: str = DEFAULT_ARCH,
    name: str = "kernel",
    options: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike] = (),
    name_expressions: Sequence[str] = (),
    compiler: str = "auto",
) -> CudaModule:
    """Compile CUDA C++ for `arch` (e.g. "sm_90a") into a cached cubin; no GPU needed.

    `name_expressions` lists template instantiations (e.g. "gemm<128, 64>") to look up later
    with `module.get_kernel(expr)`; plain `extern "C"` kernels are found by name.
    `compiler` is "auto" (NVRTC, else nvcc), "nvrtc" or "nvcc".
    """
    if not isinstance(arch, str) or not (arch.startswith("sm_") or arch.startswith("compute_")):
        raise ArgumentError(f"arch: expected like 'sm_90a', got {arch!r}")
    if not isinstance(source, str):
        raise ArgumentError(f"source: expected CUDA C++ source as str, got {type(source).__name__}")
    check_name(name)
    options = flag_list(options, "options")
    name_expressions = flag_list(name_expressions, "name_expressions")
    if isinstance(include_dirs, (str, bytes)):
        raise ArgumentError(f"include_dirs: expected a sequence of directories, got {include_dirs!r}")
    if compiler not in ("auto", "nvrtc", "nvcc"):
        raise ArgumentError(f"compiler: expected 'auto', 'nvrtc' or 'nvcc', got {compiler!r}")
    nvrtc = _nvrtc() if compiler in ("auto", "nvrtc") else None
    if compiler == "nvrtc" and nvrtc is None:
        raise CompileError("compile_cuda: compiler='nvrtc' but NVRTC is unavailable (pip install 'tilestack-hal[cuda]')")
    use = "nvrtc" if nvrtc is not None else "nvcc"
    if use == "nvcc" and name_expressions:
        raise CompileError("compile_cuda: name_expressions need NVRTC; wrap templates in extern \"C\" kernels for nvcc")
    incs = [str(include_dir()), *map(os.fspath, include_dirs), *cuda_include_dirs()]
    opts = [f"--gpu-architecture={arch}", *DEFAULT_OPTIONS, *options, *[f"-I{d}" for d in incs]]
    version = compiler_versions()[use] or "?"
    key = content_key("cuda", use, version, arch, source, json.dumps(opts[:-len(incs)] if incs else opts),
                      json.dumps(list(name_expressions)), _headers_digest(tuple(map(os.fspath, include_dirs))))
    info: dict[str, Any] = {}

    def build(work: Path) -> bytes:
        if use == "nvrtc":
            cubin, text, lowered = _compile_nvrtc(nvrtc, source, name, opts, name_expressions)
            info["lowered"] = lowered
        else:
            cubin, text = _compile_nvcc(source, name, opts, work, arch)
        info["log"] = text
        return _pack(cubin, info.get("lowered", {}))

    t0 = time.perf_counter()
    art = cached_build("cuda", key, f"{name}.cubin.pack", build)
    path, hit = art.path, art.hit
    cubin, lowered = _unpack(art.data)
    return CudaModule(name=name, arch=arch, cubin=cubin, lowered_names=lowered, path=path, cache_hit=hit,
                      compile_seconds=time.perf_counter() - t0, log=info.get("log", ""), compiler=use)


# A cached entry holds the cubin plus the lowered names of template kernels.
def _pack(cubin: bytes, lowered: Mapping[str, str]) -> bytes:
    names = "\n".join(f"{k}\t{v}" for k, v in lowered.items()).encode()
    return len(names).to_bytes(8, "little") + names + cubin


def _unpack(blob: bytes) -> tuple[bytes, dict[str, str]]:
    n = int.from_bytes(blob[:8], "little")
    names = blob[8:8 + n].decode()
    lowered = dict(line.split("\t", 1) for line in names.splitlines() if line)
    return blob[8 + n:], lowered
