"""compile_cuda: CUDA C++ -> cubin (NVRTC, nvcc as fallback) -> Kernel launched via the driver API.

Compiling needs no GPU, so every kernel template in the stack is compile-tested in CI.
Launching takes torch CUDA tensors and scalars and runs on the caller's torch stream.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import cached_build, content_key
from ..errors import CompileError, DeviceError, LaunchError
from ..tensors import is_torch

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
    h = hashlib.sha256()
    for d in (str(include_dir()), *extra_dirs):
        h.update(_dir_digest(d, _dir_stamp(d)).encode())
    return h.hexdigest()


def _dir_stamp(d: str) -> tuple:
    root = Path(d)
    if not root.is_dir():
        return ()
    return tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                        for p in root.rglob("*") if p.suffix in (".cuh", ".h", ".hpp", ".cu")))


@functools.lru_cache(maxsize=64)
def _dir_digest(d: str, stamp: tuple) -> str:
    # `stamp` (paths, mtimes, sizes) keys the memo so an edit is noticed without rehashing every call.
    h = hashlib.sha256()
    for path, _, _ in stamp:
        p = Path(path)
        h.update(str(p.relative_to(d)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


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
        buf = b" " * log_size
        check(nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        text = buf.decode(errors="replace").rstrip("\x00").strip()
        if int(res[0]) != 0:
            raise CompileError(f"compile_cuda: {name}.cu failed to compile with NVRTC", log=text, source_name=f"{name}.cu")
        (size,) = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
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
    if not (arch.startswith("sm_") or arch.startswith("compute_")):
        raise ValueError(f"arch: expected like 'sm_90a', got {arch!r}")
    nvrtc = _nvrtc() if compiler in ("auto", "nvrtc") else None
    if compiler == "nvrtc" and nvrtc is None:
        raise CompileError("compile_cuda: compiler='nvrtc' but NVRTC is unavailable (pip install 'tilestack-hal[cuda]')")
    use = "nvrtc" if nvrtc is not None else "nvcc"
    if use == "nvcc" and name_expressions:
        raise CompileError("compile_cuda: name_expressions need NVRTC; wrap templates in extern \"C\" kernels for nvcc")
    incs = [str(include_dir()), *map(os.fspath, include_dirs), *cuda_include_dirs()]
    opts = [f"--gpu-architecture={arch}", *DEFAULT_OPTIONS, *options, *[f"-I{d}" for d in incs]]
    version = compiler_versions()[use] or "?"
    key = content_key("cuda", use, version, arch, source, " ".join(opts[:-len(incs)] if incs else opts),
                      "|".join(name_expressions), _headers_digest(tuple(map(os.fspath, include_dirs))))
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
    path, hit = cached_build("cuda", key, f"{name}.cubin.pack", build)
    cubin, lowered = _unpack(path.read_bytes())
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


# ----------------------------------------------------------------------------- driver


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise DeviceError("CUDA launch: cuda-bindings is not installed (pip install 'tilestack-hal[cuda]')") from e
    return driver


def _check(driver, res, what: str):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        _, msg = driver.cuGetErrorString(err)
        text = msg.decode() if msg else str(err)
        raise LaunchError(f"{what}: {text} ({int(err)})")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


_init_lock = threading.Lock()
_cuda_checked = False


def _torch_with_cuda():
    """torch, once it is known to see a GPU (checked once per process: launches are hot)."""
    global _cuda_checked
    try:
        import torch
    except ImportError as e:
        raise DeviceError("CUDA launch: torch is required to launch kernels") from e
    if not _cuda_checked:
        if not torch.cuda.is_available():
            raise DeviceError("CUDA launch: no CUDA GPU is available on this machine")
        _cuda_checked = True
    return torch


def ensure_context(device_index: int):
    """Make torch's (primary) context of `device_index` current on this thread; returns the
    cuda-bindings driver module for callers that need raw driver calls (IPC, allocations)."""
    driver = _driver()
    try:
        import torch
    except ImportError as e:
        raise DeviceError("CUDA launch: torch is required to launch kernels") from e
    if not torch.cuda.is_available():
        raise DeviceError("CUDA launch: no CUDA GPU is available on this machine")
    with _init_lock:
        torch.cuda.init()
        err = driver.cuInit(0)
        if int(err[0] if isinstance(err, tuple) else err) != 0:
            raise DeviceError(f"CUDA launch: cuInit failed ({err})")
        dev = _check(driver, driver.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _check(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver, driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return driver


class Arg:
    """A kernel argument with an explicit C type: `Arg.i64(n)`, `Arg.f32(x)`, `Arg.raw(bytes)`."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    @classmethod
    def i32(cls, v: int) -> Arg:
        return cls(ctypes.c_int32(int(v)))

    @classmethod
    def u32(cls, v: int) -> Arg:
        return cls(ctypes.c_uint32(int(v)))

    @classmethod
    def i64(cls, v: int) -> Arg:
        return cls(ctypes.c_int64(int(v)))

    @classmethod
    def u64(cls, v: int) -> Arg:
        return cls(ctypes.c_uint64(int(v)))

    @classmethod
    def f32(cls, v: float) -> Arg:
        return cls(ctypes.c_float(float(v)))

    @classmethod
    def f64(cls, v: float) -> Arg:
        return cls(ctypes.c_double(float(v)))

    @classmethod
    def ptr(cls, addr: int) -> Arg:
        return cls(ctypes.c_void_p(int(addr)))

    @classmethod
    def raw(cls, data: bytes) -> Arg:
        """A by-value struct, e.g. a 128-byte CUtensorMap passed as `__grid_constant__`."""
        return cls(_raw_type(len(data)).from_buffer_copy(data))


_NP_TO_CTYPE = {
    np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
    np.dtype(np.int16): ctypes.c_int16, np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8,
}


@functools.cache
def _raw_type(n: int):
    return ctypes.c_ubyte * n


def _tensor_arg(i: int, a: Any, device_index: int) -> Any:
    if not a.is_cuda:
        raise LaunchError(f"args[{i}]: expected a CUDA tensor, got device {a.device}")
    if a.get_device() != device_index:
        raise LaunchError(f"args[{i}]: expected a tensor on cuda:{device_index}, got {a.device}")
    return ctypes.c_void_p(a.data_ptr())


def _int_arg(i: int, a: int, device_index: int) -> Any:
    if not -(2**31) <= a < 2**31:
        raise LaunchError(f"args[{i}]: Python int {a} does not fit int32; pass Arg.i64({a}) for a 64-bit parameter")
    return ctypes.c_int32(a)


# Exact-type dispatch keeps the per-launch cost low (a launch packs every argument each call).
_BY_TYPE: dict[type, Any] = {
    int: _int_arg,
    float: lambda i, a, d: ctypes.c_float(a),
    bool: lambda i, a, d: ctypes.c_bool(a),
    bytes: lambda i, a, d: _raw_type(len(a)).from_buffer_copy(a),
    bytearray: lambda i, a, d: _raw_type(len(a)).from_buffer_copy(a),
    type(None): lambda i, a, d: ctypes.c_void_p(0),
    Arg: lambda i, a, d: a.obj,
}


def _to_ctype(i: int, a: Any, device_index: int) -> Any:
    conv = _BY_TYPE.get(type(a))
    if conv is not None:
        return conv(i, a, device_index)
    if is_torch(a):
        return _tensor_arg(i, a, device_index)
    if isinstance(a, (ctypes._SimpleCData, ctypes.Array, ctypes.Structure)):
        return a
    if isinstance(a, np.generic):
        ct = _NP_TO_CTYPE.get(a.dtype)
        if ct is None:
            raise LaunchError(f"args[{i}]: unsupported numpy scalar type {a.dtype}")
        return ct(a.item())
    if isinstance(a, Arg):
        return a.obj
    if isinstance(a, bool):
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return _int_arg(i, int(a), device_index)
    if isinstance(a, float):
        return ctypes.c_float(a)
    raise LaunchError(f"args[{i}]: cannot pass {type(a).__name__} to a kernel (tensor, int, float, numpy scalar or Arg)")


def _dims(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (int(v),) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3 or any(x < 1 for x in t):
        raise LaunchError(f"{what}: expected 1 to 3 positive sizes, got {v!r}")
    return (t + (1, 1))[:3]


@dataclass
class Kernel:
    """One `__global__` function of a CudaModule."""

    module: CudaModule
    name: str  # as the user asked for it
    symbol: str  # mangled/lowered name in the cubin
    _functions: dict[int, Any] = field(default_factory=dict, repr=False)
    _smem_set: dict[int, int] = field(default_factory=dict, repr=False)

    def _function(self, device_index: int):
        fn = self._functions.get(device_index)
        if fn is None:
            driver = ensure_context(device_index)
            mod = self.module._loaded(device_index, driver)
            fn = _check(driver, driver.cuModuleGetFunction(mod, self.symbol.encode()), f"kernel {self.name!r} not found in module {self.module.name}")
            self._functions[device_index] = fn
        return fn

    def attribute(self, attr: str, device_index: int | None = None) -> int:
        """A CUfunction attribute, e.g. 'NUM_REGS', 'LOCAL_SIZE_BYTES', 'MAX_THREADS_PER_BLOCK'."""
        import torch

        dev = torch.cuda.current_device() if device_index is None else device_index
        driver = ensure_context(dev)
        a = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
        return int(_check(driver, driver.cuFuncGetAttribute(a, self._function(dev)), f"attribute {attr}"))

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        smem_bytes: int = 0,
        stream: Any = None,
        cluster: int | Sequence[int] | None = None,
    ) -> None:
        """Launch on `stream` (a torch.cuda.Stream or raw handle; default: torch's current stream).

        Tensors become device pointers, Python ints int32, floats float32; use `Arg` for other
        C types. `smem_bytes` above 48 KiB is opted into automatically. `cluster` launches
        thread-block clusters (sm_90+).
        """
        g, b = _dims(grid, "grid"), _dims(block, "block")
        torch = _torch_with_cuda()
        if stream is None:
            tstream = torch.cuda.current_stream()
            dev, handle = tstream.device.index, tstream.cuda_stream
        elif hasattr(stream, "cuda_stream"):
            dev, handle = stream.device.index, stream.cuda_stream
        else:
            dev, handle = torch.cuda.current_device(), int(stream)
        params = [_to_ctype(i, a, dev) for i, a in enumerate(args)]
        fn = self._function(dev)
        driver = _driver()
        if smem_bytes > 48 * 1024 and self._smem_set.get(dev, 0) < smem_bytes:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver, driver.cuFuncSetAttribute(fn, attr, int(smem_bytes)),
                   f"kernel {self.name}: smem_bytes={smem_bytes} exceeds this device's opt-in limit")
            self._smem_set[dev] = smem_bytes
        ptrs = (ctypes.c_void_p * max(1, len(params)))(*[ctypes.addressof(p) for p in params])
        stream_h = driver.CUstream(handle)
        if cluster is None:
            res = driver.cuLaunchKernel(fn, *g, *b, int(smem_bytes), stream_h, ctypes.addressof(ptrs), 0)
        else:
            c = _dims(cluster, "cluster")
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
            cfg.sharedMemBytes = int(smem_bytes)
            cfg.hStream = stream_h
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = c
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            res = driver.cuLaunchKernelEx(cfg, fn, ctypes.addressof(ptrs), 0)
        _check(driver, res, f"launch of {self.name} grid={g} block={b} smem={smem_bytes}")


@dataclass
class CudaModule:
    """A compiled cubin; kernels load lazily on first launch, once per device."""

    name: str
    arch: str
    cubin: bytes
    lowered_names: dict[str, str]
    path: Path
    cache_hit: bool
    compile_seconds: float
    log: str = ""
    compiler: str = "nvrtc"
    _modules: dict[int, Any] = field(default_factory=dict, repr=False)
    _kernels: dict[str, Kernel] = field(default_factory=dict, repr=False)

    def get_kernel(self, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            k = Kernel(module=self, name=name, symbol=self.lowered_names.get(name, name))
            self._kernels[name] = k
        return k

    def _loaded(self, device_index: int, driver):
        mod = self._modules.get(device_index)
        if mod is None:
            mod = _check(driver, driver.cuModuleLoadData(self.cubin), f"loading module {self.name} ({self.arch})")
            self._modules[device_index] = mod
        return mod
