"""Target "cuda_emu" (testing): the CUDA backend's generated C++ run on the CPU, threads as
std::threads (tl_cuda_emu.h), so every CUDA lowering is checked against the interpreter on a
machine without a GPU. Slow by design (one OS thread per CUDA thread): small problems only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CompileError
from ...ir.nodes import Const, PrimFunc, Var
from .backend import _eval
from .codegen import cuda_type, generate_cuda

log = logging.getLogger("tilelang.backends.cuda")


def _cache_dir() -> Path:
    root = Path(os.environ.get("TILESTACK_CACHE_DIR", Path.home() / ".cache" / "tilestack")) / "cuda_emu"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


class EmulatedCudaKernel:
    device = "cpu"

    def __init__(self, func: PrimFunc, options: dict) -> None:
        self.func = func
        # the emulator runs per-thread C++: warpgroup-collective wgmma is not emulated (mma.sync is)
        self.cuda_source, self.kernels = generate_cuda(func, f"tl_{func.name}", wgmma=False)
        header = resources.files(__package__).joinpath("tl_cuda_emu.h").read_text()
        src = self.cuda_source.replace("#include <tilehal/tilehal.cuh>", header)
        launch = []
        for name, k, _smem in self.kernels:
            args = []
            for i, p in enumerate(func.params):
                args.append(f"({cuda_type(p.dtype)}*)a[{i}]")
            for j, _ in enumerate(func.dynamic_vars):
                args.append(f"(int)d[{j}]")
            threads = 1
            for t in k.threads:
                threads *= int(t)
            launch.append(f'extern "C" void emu_{name}(void** a, long long* d, unsigned gx, unsigned gy, unsigned gz) '
                          f'{{ tl_emu_run(gx, gy, gz, {threads}, [=] {{ {name}({", ".join(args)}); }}); }}')
        self.emu_source = src + "\n" + "\n".join(launch) + "\n"
        digest = hashlib.sha256(self.emu_source.encode()).hexdigest()[:16]
        lib = _cache_dir() / f"{func.name}_{digest}.so"
        if not lib.exists():
            cxx = shutil.which("g++") or shutil.which("c++")
            if cxx is None:
                raise CompileError("target cuda_emu needs a C++20 compiler (g++)")
            with tempfile.TemporaryDirectory() as td:
                cpp = Path(td) / "k.cpp"
                cpp.write_text(self.emu_source)
                out = Path(td) / "k.so"
                proc = subprocess.run([cxx, "-std=c++20", "-O1", "-w", "-pthread", "-shared", "-fPIC", str(cpp), "-o",
                                       str(out)], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise CompileError("cuda_emu: the generated CUDA does not compile as C++ for emulation",
                                       log=proc.stderr[-6000:])
                os.replace(out, lib)
        self.lib = ctypes.CDLL(str(lib))
        self.compile_seconds = 0.0
        self.cache_hit = False

    def source(self) -> str:
        return self.cuda_source

    def __call__(self, arrays: list[np.ndarray], dyn: dict[Var, int]) -> None:
        ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
        sizes = (ctypes.c_longlong * max(1, len(self.func.dynamic_vars)))(
            *[int(dyn[v]) for v in self.func.dynamic_vars])
        for name, k, _ in self.kernels:
            g = [int(x.value) if isinstance(x, Const) else _eval(x, dyn) for x in k.grid] + [1, 1]
            if min(g[:3]) <= 0:
                continue
            getattr(self.lib, f"emu_{name}")(ptrs, sizes, ctypes.c_uint(g[0]), ctypes.c_uint(g[1]),
                                             ctypes.c_uint(g[2]))


def build_emulated(func: PrimFunc, options: dict) -> Any:
    return EmulatedCudaKernel(func, options)

