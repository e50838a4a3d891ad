"""`tilestack doctor`: `python -m tilehal doctor` extended with the whole stack's import and backend checks."""

from __future__ import annotations

import importlib.util

import tilehal
from tilehal import doctor as hal_doctor

from .packages import PACKAGES, import_error, installed_version


def _check(ok: bool, label: str, why: str = "") -> str:
    return hal_doctor.check_line(ok, label, why)


def backend_status() -> list[tuple[str, bool, str]]:
    """(backend, usable, why not) for every backend the stack can use: tilehal's, plus the
    distributed runtimes deepep and the umbrella's MoE layer use."""
    out = hal_doctor.backend_status()
    reason = tilehal.cuda_unavailable_reason()
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
    """tilehal's environment report (`python -m tilehal doctor`), plus an import check of every
    package and the stack-wide backends."""
    lines = hal_doctor.sections("TileStack doctor")
    lines += ["", "Imports:"]
    for p in PACKAGES:
        present = installed_version(p) is not None or hal_doctor.where(p.module) is not None
        err = import_error(p) if present else None
        state = "not installed" if not present else ("ok" if err is None else f"import failed: {err}")
        lines.append(f"  {p.module:<11} {state}")
    lines += ["", "Backends:"]
    for name, ok, why in backend_status():
        lines.append(_check(ok, name, why))
    return "\n".join(lines + hal_doctor.clash_lines())


def main() -> int:
    """Print the report; exit status 1 when an import-name clash was found."""
    print(report())
    return 1 if hal_doctor.clashes() else 0
