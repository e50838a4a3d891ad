"""The hot launch path: one LaunchPlan per (kernel, grid, block, smem, cluster, device, argument signature).

A plan is built on the first launch of a signature, after Kernel.launch's full checks passed, and
holds everything that does not change between calls: the CUfunction handle, the launch
dimensions, one parameter buffer with a `void*` array pointing into it, and a `struct.Struct`
that packs every argument into that buffer in one C call. Its `go(args, dev, stream)` is
generated code (one function per signature, no loop over arguments) that

- checks each argument's exact type, a tensor's device and a bytes argument's length (anything
  else: it returns MISS and Kernel.launch takes the slow path, which raises the proper error or
  builds a plan for the new signature);
- packs data pointers and scalars (struct range-checks the integers: an out-of-range value is a
  MISS too, and the slow path raises its LaunchError);
- calls cuLaunchKernel straight through ctypes (libcuda), or through cuda-bindings where libcuda
  cannot be loaded that way, or cuLaunchKernelEx (cuda-bindings) for cluster launches.

The driver copies parameter values during cuLaunchKernel, so the buffer is reused; a lock per plan
keeps two threads from packing into it at once.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import sys
import threading
from typing import Any

import numpy as np

log = logging.getLogger("tilehal.jit.launch")

MISS = -1  # go() could not take this call: run the slow path

# struct codes for the C types an argument may take; "P"-like pointers are packed as u64.
_CTYPE_CODE: dict[type, str] = {
    ctypes.c_int8: "b", ctypes.c_uint8: "B", ctypes.c_int16: "h", ctypes.c_uint16: "H",
    ctypes.c_int32: "i", ctypes.c_uint32: "I", ctypes.c_int64: "q", ctypes.c_uint64: "Q",
    ctypes.c_float: "f", ctypes.c_double: "d", ctypes.c_bool: "?", ctypes.c_void_p: "Q",
}
_NP_CODE = {np.dtype(np.int32): "i", np.dtype(np.uint32): "I", np.dtype(np.int64): "q", np.dtype(np.uint64): "Q",
            np.dtype(np.float32): "f", np.dtype(np.float64): "d", np.dtype(np.int16): "h", np.dtype(np.int8): "b",
            np.dtype(np.uint8): "B"}


class Unplannable(Exception):
    """An argument type the plan builder does not handle (the slow path keeps launching it)."""


def _arg_spec(i: int, a: Any, torch_tensor: type | None, arg_cls: type) -> tuple[str, str | None, str, str]:
    """(struct code, value expression or None for a constant, checks, constant) for argument i."""
    t = type(a)
    v = f"a{i}"
    if torch_tensor is not None and isinstance(a, torch_tensor):
        return "Q", f"{v}.data_ptr()", f"{v}.get_device() != dev", ""
    if t is int:
        return "i", v, "", ""
    if t is float:
        return "f", v, "", ""
    if t is bool:
        return "?", v, "", ""
    if t is type(None):
        return "Q", None, "", "0"
    if t in (bytes, bytearray):
        return f"{len(a)}s", v, f"len({v}) != {len(a)}", ""
    if isinstance(a, np.generic):
        code = _NP_CODE.get(a.dtype)
        if code is None:
            raise Unplannable(f"numpy {a.dtype}")
        return code, f"{v}.item()", "", ""
    inner, expr = (a.obj, f"{v}.obj") if t is arg_cls else (a, v)
    it = type(inner)
    code = _CTYPE_CODE.get(it)
    if code is not None:
        value = f"({expr}.value or 0)" if it is ctypes.c_void_p else f"{expr}.value"
        return code, value, f"type({expr}) is not _I{i}", ""
    if isinstance(inner, (ctypes.Array, ctypes.Structure, ctypes.Union)):
        return f"{ctypes.sizeof(inner)}s", f"bytes({expr})", f"type({expr}) is not _I{i}", ""
    raise Unplannable(type(inner).__name__)


def _align(code: str) -> int:
    if code.endswith("s"):
        return 16
    return struct.calcsize("=" + code)


class LaunchPlan:
    """See the module docstring. Built by `build_plan`; call `go(args, dev, stream) -> 0 | MISS | CUresult`."""

    __slots__ = ("go", "signature", "nbytes", "_buf", "_ptrs", "_keep")

    def __init__(self) -> None:
        self.go: Any = None
        self.signature: tuple = ()
        self.nbytes = 0
        self._buf: Any = None
        self._ptrs: Any = None
        self._keep: list = []


def signature_of(args: Any, torch_tensor: type | None, arg_cls: type) -> tuple:
    """What a plan is specialized on (types, inner ctypes of Arg, bytes lengths)."""
    out = []
    for a in args:
        t = type(a)
        if t in (bytes, bytearray):
            out.append((t, len(a)))
        elif t is arg_cls:
            out.append((t, type(a.obj)))
        else:
            out.append(t if not (torch_tensor is not None and isinstance(a, torch_tensor)) else (torch_tensor, t))
    return tuple(out)


def build_plan(args: Any, fn_handle: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
               launcher: Any, torch_tensor: type | None, arg_cls: type, cluster_cfg: Any = None) -> LaunchPlan:
    """A plan for arguments shaped like `args`. `launcher(fn, gx, gy, gz, bx, by, bz, smem, stream,
    params, extra) -> int` is the cuLaunchKernel to call; with `cluster_cfg` (a cuda-bindings
    CUlaunchConfig whose hStream go() sets), launcher is `(cfg, stream, params) -> int`."""
    specs = [_arg_spec(i, a, torch_tensor, arg_cls) for i, a in enumerate(args)]
    fmt, offsets, off = ["="], [], 0
    for code, *_ in specs:
        al = _align(code)
        pad = (-off) % al
        if pad:
            fmt.append(f"{pad}x")
            off += pad
        offsets.append(off)
        fmt.append(code)
        off += struct.calcsize("=" + code)
    plan = LaunchPlan()
    plan.signature = signature_of(args, torch_tensor, arg_cls)
    plan.nbytes = max(off, 1)
    buf = (ctypes.c_ubyte * (plan.nbytes + 16))()
    base = ctypes.addressof(buf)
    shift = (-base) % 16  # 16-byte aligned parameter storage
    n = max(1, len(args))
    ptrs = (ctypes.c_void_p * n)(*[base + shift + o for o in offsets] or [0])
    plan._buf, plan._ptrs = buf, ptrs
    packer = struct.Struct("".join(fmt))
    ns: dict[str, Any] = dict(_pack=packer.pack_into, _buf=buf, _shift=shift, _launch=launcher, _lock=threading.Lock(),
                              _fn=fn_handle, _params=ctypes.addressof(ptrs), _struct_error=struct.error,
                              _cfg=cluster_cfg)
    checks, values = [], []
    for i, (a, (_code, expr, check, const)) in enumerate(zip(args, specs)):
        ns[f"_T{i}"] = type(a)
        checks.append(f"type(a{i}) is not _T{i}")
        if check:
            checks.append(check)
        if check and f"_I{i}" in check:
            ns[f"_I{i}"] = type(a.obj if type(a) is arg_cls else a)
        values.append(expr if expr is not None else const)
    lines = ["def go(args, dev, stream):", f"    if len(args) != {len(args)}: return -1"]
    if args:
        lines.append(f"    {', '.join(f'a{i}' for i in range(len(args)))}, = args")
    if checks:
        lines.append(f"    if {' or '.join(checks)}: return -1")
    if cluster_cfg is None:
        call = (f"_launch(_fn, {grid[0]}, {grid[1]}, {grid[2]}, {block[0]}, {block[1]}, {block[2]}, {smem}, stream, "
                "_params, None)")
    else:
        call = "_launch(_cfg, stream, _params)"
    lines += ["    with _lock:",
              "        try:",
              f"            _pack(_buf, _shift, {', '.join(values)})" if args else "            pass",
              "        except (_struct_error, OverflowError, TypeError, ValueError, AttributeError):",
              "            return -1",
              f"        return {call}"]
    src = "\n".join(lines) + "\n"
    code = compile(src, f"<tilehal launch plan {len(args)} args>", "exec")
    exec(code, ns)  # noqa: S102 - generated from argument kinds only, never from argument values
    plan.go = ns["go"]
    plan._keep = [ns]
    return plan


# ----------------------------------------------------------------------------- the driver entry points

_launch_fn: Any = None  # ctypes cuLaunchKernel, or False when libcuda cannot be loaded through ctypes
_lib_lock = threading.Lock()


def _libcuda_names() -> tuple[str, ...]:
    if sys.platform == "win32":
        return ("nvcuda.dll",)
    return ("libcuda.so.1", "libcuda.so")


def ctypes_cu_launch_kernel() -> Any:
    """libcuda's cuLaunchKernel as a ctypes function (None where it cannot be loaded: DEBUG says why)."""
    global _launch_fn
    if _launch_fn is None:
        with _lib_lock:
            if _launch_fn is None:
                fn: Any = False
                for name in _libcuda_names():
                    try:
                        lib = ctypes.CDLL(name)
                        f = lib.cuLaunchKernel
                    except (OSError, AttributeError) as e:
                        log.debug("fast launch: %s not usable through ctypes (%s)", name, e)
                        continue
                    f.restype = ctypes.c_int
                    f.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p]
                    fn = f
                    break
                if fn is False:
                    log.debug("fast launch: launching through cuda-bindings' cuLaunchKernel (libcuda not loadable "
                              "through ctypes)")
                _launch_fn = fn
    return _launch_fn or None
