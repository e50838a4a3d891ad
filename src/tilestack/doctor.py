"""`tilestack doctor`: what this machine offers and which TileStack backends are live here."""

from __future__ import annotations

import importlib.util
import platform
import sys

import tilehal

from .packages import PACKAGES, import_error, installed_version


def _check(ok: bool, label: str, why: str = "") -> str:
    return f"  [{'x' if ok else ' '}] {label}" + ("" if ok or not why else f"  -- {why}")


def backend_status() -> list[tuple[str, bool, str]]:
    """(backend, usable, why not) for every backend the stack can use."""
    out = []
    cc = tilehal.c_compiler()
    has_cffi = importlib.util.find_spec("cffi") is not None
    out.append(("cpu (C + OpenMP via compile_c)", bool(cc) and has_cffi,
                "no C compiler on PATH" if not cc else "" if has_cffi else "cffi is not installed"))
    versions = tilehal.compiler_versions()
    out.append(("cuda compile (sm_90a cubins)", any(versions.values()),
                "neither NVRTC (pip install 'tilestack-hal[cuda]') nor nvcc found"))
    reason = tilehal.cuda_unavailable_reason()
    out.append(("cuda launch", reason is None, reason or ""))
    has_torch = importlib.util.find_spec("torch") is not None
    dist_ok, why = False, "torch is not installed"
    if has_torch:
        import torch.distributed as dist

        dist_ok = dist.is_available()
        why = "" if dist_ok else "this torch build lacks torch.distributed"
        if dist_ok:
            nccl = dist.is_nccl_available()
            out.append(("torch.distributed gloo", dist.is_gloo_available(), "gloo not built in"))
            out.append(("torch.distributed nccl", nccl and reason is None,
                        "no CUDA GPU" if reason else "NCCL not built into torch"))
    if not dist_ok:
        out.append(("torch.distributed", False, why))
    has_mpi = importlib.util.find_spec("mpi4py") is not None
    out.append(("mpiexec bootstrap (mpi4py)", has_mpi, "pip install mpi4py mpich"))
    return out


def report() -> str:
    lines = [f"TileStack doctor — Python {sys.version.split()[0]} on {platform.platform()}", "", "Devices:"]
    for d in tilehal.devices():
        lines.append(f"  {d.describe()}")
    if not tilehal.cuda_devices():
        lines.append(f"  (no CUDA GPU: {tilehal.cuda_unavailable_reason()})")
    lines += ["", "Compilers:"]
    cc = tilehal.c_compiler()
    lines.append(f"  cc     {tilehal.c_compiler_version(cc) if cc else 'not found'}")
    for name, v in tilehal.compiler_versions().items():
        lines.append(f"  {name:<6} {v or 'not found'}")
    incs = tilehal.cuda_include_dirs()
    lines.append(f"  CUDA headers: {incs[0] if incs else 'not found (cuda_bf16.h)'}")
    lines.append(f"  compile cache: {tilehal.cache_dir()}")
    lines += ["", "Packages:"]
    for p in PACKAGES:
        v = installed_version(p)
        err = import_error(p) if v else None
        state = "not installed" if v is None else (f"{v}" if err is None else f"{v} (import failed: {err})")
        lines.append(f"  {p.dist:<22} {state}")
    lines += ["", "Backends:"]
    for name, ok, why in backend_status():
        lines.append(_check(ok, name, why))
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0
