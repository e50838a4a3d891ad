"""Loading and launching cubins through the CUDA driver API (cuda-bindings), on torch's streams.

Launching takes torch CUDA tensors and scalars and runs on the caller's torch stream; without a
GPU it raises DeviceError.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError, DeviceError, LaunchError, check_int
from ..tensors import is_torch
from . import fastlaunch
from .fastlaunch import MISS

log = logging.getLogger("tilehal.jit.launch")


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


# Arg's scalar kinds: C type, and for the integers the range [lo, hi] a value must lie in
# (check_int: no wrap-around, floats and bools refused, ArgumentError). Floats convert with
# float(), pointers with int().
_SCALAR_KINDS: dict[str, tuple[type, tuple[int, int] | None]] = {
    "i32": (ctypes.c_int32, (-(2**31), 2**31 - 1)),
    "u32": (ctypes.c_uint32, (0, 2**32 - 1)),
    "i64": (ctypes.c_int64, (-(2**63), 2**63 - 1)),
    "u64": (ctypes.c_uint64, (0, 2**64 - 1)),
    "f32": (ctypes.c_float, None),
    "f64": (ctypes.c_double, None),
    "ptr": (ctypes.c_void_p, None),
}


def _scalar(kind: str) -> classmethod:
    ctype, bounds = _SCALAR_KINDS[kind]

    def make(cls, v: Any) -> Arg:
        if bounds is not None:
            return cls(ctype(check_int(v, f"Arg.{kind}", *bounds)))
        try:
            return cls(ctype(int(v) if kind == "ptr" else float(v)))
        except (TypeError, ValueError, OverflowError):
            raise ArgumentError(f"Arg.{kind}: expected a {'pointer (int)' if kind == 'ptr' else 'number'}, "
                                f"got {v!r}") from None

    make.__name__ = make.__qualname__ = kind
    make.__doc__ = f"A `{ctype.__name__}` argument" + (" (range-checked)." if bounds else ".")
    return classmethod(make)


class Arg:
    """A kernel argument with an explicit C type: `Arg.i64(n)`, `Arg.f32(x)`, `Arg.raw(bytes)`."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    # One constructor per row of _SCALAR_KINDS.
    i32 = _scalar("i32")
    u32 = _scalar("u32")
    i64 = _scalar("i64")
    u64 = _scalar("u64")
    f32 = _scalar("f32")
    f64 = _scalar("f64")
    ptr = _scalar("ptr")

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


DEFAULT_SMEM_LIMIT = 48 * 1024  # static + dynamic shared memory a block gets without the opt-in attribute


def needs_smem_optin(dynamic_bytes: int, static_bytes: int) -> bool:
    """Whether a launch with `dynamic_bytes` of dynamic shared memory must first raise the function's
    MAX_DYNAMIC_SHARED_SIZE_BYTES: its default lets static + dynamic reach 48 KiB, so 48 KiB of dynamic
    shared memory in a kernel that also has static shared memory needs it too."""
    return dynamic_bytes > 0 and dynamic_bytes + static_bytes > DEFAULT_SMEM_LIMIT


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
    _static: dict[int, int] = field(default_factory=dict, repr=False)
    _plans: dict[tuple, list] = field(default_factory=dict, repr=False)

    def _function(self, device_index: int):
        fn = self._functions.get(device_index)
        if fn is None:
            driver = ensure_context(device_index)
            mod = self.module._loaded(device_index, driver)
            fn = _check(driver, driver.cuModuleGetFunction(mod, self.symbol.encode()), f"kernel {self.name!r} not found in module {self.module.name}")
            self._functions[device_index] = fn
        return fn

    def preload(self, device_index: int | None = None) -> None:
        """Load the kernel onto the device now. CUDA loads kernels lazily at first launch, and a
        lazy load may wait for the whole context to go idle: a kernel that spins until a kernel
        of another stream (or a peer) runs must have that kernel loaded beforehand."""
        import torch

        dev = torch.cuda.current_device() if device_index is None else device_index
        fn = self._function(dev)
        driver = _driver()
        if hasattr(driver, "cuFuncLoad"):  # CUDA 12.4+; older drivers load at cuModuleGetFunction
            _check(driver, driver.cuFuncLoad(fn), f"loading kernel {self.name}")

    def _static_smem(self, dev: int, fn: Any) -> int:
        """Bytes of static shared memory of the function (ptxas pads it to the alignment of an extern
        dynamic array), read once per device."""
        got = self._static.get(dev)
        if got is None:
            driver = _driver()
            a = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
            got = self._static[dev] = int(_check(driver, driver.cuFuncGetAttribute(a, fn), "attribute SHARED_SIZE_BYTES"))
        return got

    def attribute(self, attr: str, device_index: int | None = None) -> int:
        """A CUfunction attribute, e.g. 'NUM_REGS', 'LOCAL_SIZE_BYTES', 'MAX_THREADS_PER_BLOCK'."""
        import torch

        dev = torch.cuda.current_device() if device_index is None else device_index
        driver = ensure_context(dev)
        a = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
        return int(_check(driver, driver.cuFuncGetAttribute(a, self._function(dev)), f"attribute {attr}"))

    def max_active_clusters(self, block: Any, smem_bytes: int, cluster: Sequence[int],
                            device_index: int | None = None) -> int:
        """The driver's count (cuOccupancyMaxActiveClusters) of `cluster`-shaped thread-block clusters of this
        kernel, `block` threads and `smem_bytes` of dynamic shared memory per CTA, resident on the device at
        once: a grid of more clusters runs in waves (sm_90+; raises LaunchError where the driver cannot say)."""
        import torch

        dev = torch.cuda.current_device() if device_index is None else device_index
        driver = ensure_context(dev)
        fn = self._function(dev)
        if needs_smem_optin(smem_bytes, self._static_smem(dev, fn)) and self._smem_set.get(dev, 0) < smem_bytes:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver, driver.cuFuncSetAttribute(fn, attr, int(smem_bytes)),
                   f"kernel {self.name}: smem_bytes={smem_bytes} exceeds this device's opt-in limit")
            self._smem_set[dev] = smem_bytes
        c = _dims(cluster, "cluster")
        cfg = _cluster_config(driver, c, _dims(block, "block"), smem_bytes, c, driver.CUstream(0))
        return int(_check(driver, driver.cuOccupancyMaxActiveClusters(fn, cfg), f"max active clusters of {self.name}"))

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        smem_bytes: int = 0,
        stream: Any = None,
        cluster: int | Sequence[int] | None = None,
        pdl: bool = False,
    ) -> None:
        """Launch on `stream` (a torch.cuda.Stream or raw handle; default: torch's current stream).

        Tensors become device pointers, Python ints int32, floats float32; use `Arg` for other
        C types. `smem_bytes` that with the kernel's static shared memory exceeds 48 KiB is opted into
        automatically. `cluster` launches
        thread-block clusters (sm_90+). `pdl` launches with programmatic stream serialization
        (programmatic dependent launch, sm_90+): the grid may start before the stream's previous kernel
        has finished, so the kernel must execute `griddepcontrol.wait` before it touches memory that
        kernel writes (CUDA-graph capture keeps it as a programmatic edge).

        The first launch of a signature (grid, block, smem, cluster, device and the arguments'
        types) checks everything and builds a LaunchPlan (fastlaunch.py); later launches of it run
        the plan: per-argument type/device checks, one struct pack, one cuLaunchKernel.
        """
        torch = _torch_fast
        if torch is not None:
            if stream is None:
                dev = torch._C._cuda_getDevice()
                handle = torch._C._cuda_getCurrentRawStream(dev)
            elif hasattr(stream, "cuda_stream"):
                dev, handle = stream.device.index, stream.cuda_stream
            else:
                dev, handle = None, None
            if dev is not None:
                try:
                    plans = self._plans.get((grid, block, smem_bytes, cluster, dev, True) if pdl
                                            else (grid, block, smem_bytes, cluster, dev))
                except TypeError:  # unhashable grid/block (a list): the slow path every time
                    plans = None
                if plans:
                    for plan in plans:
                        rc = plan.go(args, dev, handle)
                        if rc == 0:
                            return
                        if rc != MISS:
                            self._raise_launch(rc, grid, block, smem_bytes)
        self._launch_slow(grid, block, args, smem_bytes, stream, cluster, pdl)

    def _raise_launch(self, rc: int, grid: Any, block: Any, smem_bytes: int) -> None:
        driver = _driver()
        _check(driver, driver.CUresult(rc), f"launch of {self.name} grid={_dims(grid, 'grid')} "
               f"block={_dims(block, 'block')} smem={smem_bytes}")

    def _launch_slow(self, grid, block, args, smem_bytes, stream, cluster, pdl=False) -> None:
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
        if needs_smem_optin(smem_bytes, self._static_smem(dev, fn)) and self._smem_set.get(dev, 0) < smem_bytes:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver, driver.cuFuncSetAttribute(fn, attr, int(smem_bytes)),
                   f"kernel {self.name}: smem_bytes={smem_bytes} exceeds this device's opt-in limit")
            self._smem_set[dev] = smem_bytes
        ptrs = (ctypes.c_void_p * max(1, len(params)))(*[ctypes.addressof(p) for p in params])
        stream_h = driver.CUstream(handle)
        if cluster is None and not pdl:
            res = driver.cuLaunchKernel(fn, *g, *b, int(smem_bytes), stream_h, ctypes.addressof(ptrs), 0)
        else:
            res = driver.cuLaunchKernelEx(_cluster_config(driver, g, b, smem_bytes, cluster, stream_h, pdl), fn,
                                          ctypes.addressof(ptrs), 0)
        _check(driver, res, f"launch of {self.name} grid={g} block={b} smem={smem_bytes}{' pdl' if pdl else ''}")
        self._remember(grid, block, args, smem_bytes, cluster, dev, fn, g, b, torch, pdl)

    def _remember(self, grid, block, args, smem_bytes, cluster, dev, fn, g, b, torch, pdl=False) -> None:
        """Build a plan for this (successful) launch's signature, unless one exists or it cannot be planned."""
        global _torch_fast
        try:
            key = (grid, block, smem_bytes, cluster, dev, True) if pdl else (grid, block, smem_bytes, cluster, dev)
            hash(key)
        except TypeError:
            log.debug("kernel %s: grid/block/cluster given as lists (unhashable): no launch plan, every launch "
                      "takes the checked slow path; pass ints or tuples", self.name)
            return
        sig = fastlaunch.signature_of(args, torch.Tensor, Arg)
        plans = self._plans.setdefault(key, [])
        if any(p.signature == sig for p in plans):
            return
        if len(self._plans) > _MAX_PLAN_KEYS:
            self._plans.clear()
            plans = self._plans.setdefault(key, [])
        driver = _driver()
        try:
            if cluster is None and not pdl:
                fast = fastlaunch.ctypes_cu_launch_kernel()
                if fast is not None:
                    launcher, handle = fast, int(fn)
                else:
                    def launcher(f, gx, gy, gz, bx, by, bz, sm, st, params, extra, _d=driver):
                        return int(_d.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sm, _d.CUstream(st), params, 0)[0])
                    handle = fn
                plan = fastlaunch.build_plan(args, handle, g, b, int(smem_bytes), launcher, torch.Tensor, Arg)
            else:
                cfg = _cluster_config(driver, g, b, smem_bytes, cluster, driver.CUstream(0), pdl)

                def launcher(c, st, params, _d=driver, _f=fn):
                    c.hStream = _d.CUstream(st)
                    return int(_d.cuLaunchKernelEx(c, _f, params, 0)[0])
                plan = fastlaunch.build_plan(args, None, g, b, int(smem_bytes), launcher, torch.Tensor, Arg,
                                             cluster_cfg=cfg)
        except fastlaunch.Unplannable as e:
            log.debug("kernel %s: no launch plan for an argument of type %s; launches take the slow path",
                      self.name, e)
            return
        if len(plans) >= _MAX_PLANS_PER_KEY:
            plans.pop(0)
        plans.append(plan)
        if _torch_fast is None:
            if hasattr(torch._C, "_cuda_getCurrentRawStream") and hasattr(torch._C, "_cuda_getDevice"):
                _torch_fast = torch
            else:
                log.debug("launch plans unused: this torch has no torch._C._cuda_getCurrentRawStream")


_MAX_PLAN_KEYS = 256  # distinct (grid, block, smem, cluster, device) per kernel before the plans are dropped
_MAX_PLANS_PER_KEY = 4  # argument signatures kept per launch shape
_torch_fast: Any = None  # torch, once a launch has succeeded (the plan path needs no further checks)


def _cluster_config(driver, g, b, smem_bytes, cluster, stream_h, pdl=False):
    """cuLaunchKernelEx's config: a thread-block cluster shape (None: none) and / or programmatic
    stream serialization (`pdl`)."""
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
    cfg.sharedMemBytes = int(smem_bytes)
    cfg.hStream = stream_h
    attrs = []
    if cluster is not None:
        c = _dims(cluster, "cluster")
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = c
        attrs.append(attr)
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


PDL_VALUES = ("0", "1")
DEFAULT_PDL = "0"


def pdl_requested() -> bool:
    """TILESTACK_PDL (default DEFAULT_PDL): "1" makes the kernels that support it (kvpool's sparse decode,
    dataengine's block selection) launch with programmatic dependent launch; "0" plain launches."""
    v = os.environ.get("TILESTACK_PDL") or DEFAULT_PDL
    if v not in PDL_VALUES:
        from ..errors import ArgumentError

        raise ArgumentError(f"TILESTACK_PDL: expected one of {list(PDL_VALUES)}, got {v!r}")
    return v == "1"


@dataclass
class CudaModule:
    """A compiled cubin; kernels load lazily on first launch, once per device."""

    name: str
    arch: str
    cubin: bytes = field(repr=False)
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
