"""The environment report any TileStack package can print: `python -m tilehal doctor`.

Devices, compilers, the backends tilehal can drive, which TileStack distributions are installed,
and import-name clashes: another distribution (PyPI's `tilelang` is the public TileLang,
`dataengine` an unrelated project) shipping files under one of our import names. pip installs
both into the same folder without a warning, the second overwriting the first's files, so the
import then runs a mix of the two. `tilestack doctor` extends this report with the umbrella's checks.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import sys
from dataclasses import dataclass

from .devices import cuda_devices, cuda_unavailable_reason, devices
from .jit.c import c_compiler, c_compiler_version
from .jit.cuda import compiler_versions, cuda_include_dirs

# Our distributions and the top-level import name each owns (a static table: tilehal imports none of them).
DISTRIBUTIONS: dict[str, str] = {
    "tilestack-hal": "tilehal", "tilestack-tilelang": "tilelang", "tilestack-deepgemm": "deepgemm",
    "tilestack-deepep": "deepep", "tilestack-kvpool": "kvpool", "tilestack-dataengine": "dataengine",
    "tilestack": "tilestack",
}


@dataclass(frozen=True)
class Clash:
    module: str
    ours: str
    others: tuple[str, ...]  # "name version" of every other distribution shipping files under `module`

    def describe(self) -> str:
        return (f"{self.module}: files also belong to {', '.join(self.others)}; one install overwrote the "
                f"other's files. Fix: pip uninstall -y {' '.join(o.split()[0] for o in self.others)} {self.ours} "
                f"&& pip install {self.ours} (or use separate virtual environments)")


def installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _top_level_names(dist: md.Distribution) -> set[str]:
    names = set()
    for f in dist.files or ():
        parts = f.parts
        if len(parts) > 1 and not parts[0].endswith((".dist-info", ".egg-info", ".data")) and parts[0] != "..":
            names.add(parts[0])
        elif len(parts) == 1 and parts[0].endswith(".py"):
            names.add(parts[0][:-3])
    top = dist.read_text("top_level.txt")
    if top:
        names |= {line.strip() for line in top.splitlines() if line.strip()}
    return names


def clashes() -> list[Clash]:
    """Our import names that some other installed distribution also ships files for (from each
    distribution's RECORD / top_level.txt)."""
    owners: dict[str, set[str]] = {m: set() for m in DISTRIBUTIONS.values()}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in DISTRIBUTIONS:
            continue
        for top in _top_level_names(dist) & owners.keys():
            owners[top].add(f"{dist.metadata['Name']} {dist.version}")
    by_module = {m: d for d, m in DISTRIBUTIONS.items()}
    return [Clash(m, by_module[m], tuple(sorted(o))) for m, o in owners.items() if o]


def where(module: str) -> str | None:
    """The folder an import name resolves to, without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locs = list(spec.submodule_search_locations or []) or [spec.origin]
    return str(locs[0]) if locs and locs[0] else None


def check_line(ok: bool, label: str, why: str = "") -> str:
    return f"  [{'x' if ok else ' '}] {label}" + ("" if ok or not why else f"  -- {why}")


def backend_status() -> list[tuple[str, bool, str]]:
    """(backend, usable, why not) for what tilehal drives: the C JIT and the CUDA JIT."""
    cc = c_compiler()
    has_cffi = importlib.util.find_spec("cffi") is not None
    out = [("cpu (C + OpenMP via compile_c)", bool(cc) and has_cffi,
            "no C compiler on PATH" if not cc else "" if has_cffi else "cffi is not installed")]
    out.append(("cuda compile (sm_90a cubins)", any(compiler_versions().values()),
                "neither NVRTC (pip install 'tilestack-hal[cuda]') nor nvcc found"))
    reason = cuda_unavailable_reason()
    out.append(("cuda launch", reason is None, reason or ""))
    torch_v = installed("torch")
    out.append((f"torch {torch_v}" if torch_v else "torch", torch_v is not None,
                "not installed (CPU wheel: pip install torch --index-url https://download.pytorch.org/whl/cpu)"))
    return out


def sections(title: str = "TileStack environment") -> list[str]:
    """The report's lines up to and including the package table (callers append their own sections)."""
    from .cache import cache_dir

    lines = [f"{title} — Python {sys.version.split()[0]} on {platform.platform()}", "", "Devices:"]
    for d in devices():
        lines.append(f"  {d.describe()}")
    if not cuda_devices():
        lines.append(f"  (no CUDA GPU: {cuda_unavailable_reason()})")
    lines += ["", "Compilers:"]
    cc = c_compiler()
    lines.append(f"  cc     {c_compiler_version(cc) if cc else 'not found'}")
    for name, v in compiler_versions().items():
        lines.append(f"  {name:<6} {v or 'not found'}")
    incs = cuda_include_dirs()
    lines.append(f"  CUDA headers: {incs[0] if incs else 'not found (cuda_bf16.h)'}")
    lines.append(f"  compile cache: {cache_dir()}")
    lines += ["", "Packages:"]
    for dist, module in DISTRIBUTIONS.items():
        v = installed(dist)
        loc = where(module)
        state = v if v is not None else "from source" if loc else "not installed"
        lines.append(f"  {dist:<22} {state:<13}" + (f" {module} -> {loc}" if loc else ""))
    return lines


def clash_lines() -> list[str]:
    found = clashes()
    lines = ["", "Import-name clashes:"]
    lines += [f"  [!] {c.describe()}" for c in found] or ["  none"]
    return lines


def report() -> str:
    lines = sections()
    lines += ["", "Backends:"] + [check_line(ok, name, why) for name, ok, why in backend_status()]
    return "\n".join(lines + clash_lines())


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit status 1 when an import-name clash was found."""
    print(report())
    return 1 if clashes() else 0
