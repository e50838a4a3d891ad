"""`tilestack bench`: run the benchmark scripts of a checkout (packages/*/benchmarks/*.py).

A script that needs a GPU says so in a `# requires: cuda` (or `multi_gpu`) line near its top; it
is skipped, with the reason printed, where the machine lacks that. Scripts print their results;
with `--record` each also writes its JSON (and figure) into docs/benchmarks/.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_REQUIRES = re.compile(r"^#\s*requires:\s*(\w+)", re.M)


def find_scripts(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("packages/*/benchmarks/*.py") if not p.name.startswith("_"))


def requirement(script: Path) -> str | None:
    head = "\n".join(script.read_text().splitlines()[:30])
    m = _REQUIRES.search(head)
    return m.group(1) if m else None


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing(req: str | None, gpus: int) -> str | None:
    """Why a script with requirement `req` cannot run here, or None."""
    if req == "cuda" and gpus < 1:
        return "needs a CUDA GPU"
    if req == "multi_gpu" and gpus < 2:
        return f"needs two or more CUDA GPUs (found {gpus})"
    return None


def main(argv: list[str]) -> int:
    record = "--record" in argv
    argv = [a for a in argv if a != "--record"]
    root = Path(argv[0]) if argv else Path.cwd()
    scripts = find_scripts(root)
    if not scripts:
        print(f"tilestack bench: no packages/*/benchmarks/*.py under {root}; run it from a TileStack checkout")
        return 2
    gpus, failed = _gpu_count(), 0
    for i, script in enumerate(scripts, 1):
        why = missing(requirement(script), gpus)
        if why:
            print(f"[{i}/{len(scripts)}] {script.relative_to(root)}: skipped ({why})", flush=True)
            continue
        print(f"[{i}/{len(scripts)}] {script.relative_to(root)}", flush=True)
        rc = subprocess.call([sys.executable, str(script)] + (["--record"] if record else []), cwd=root)
        failed += rc != 0
    return 1 if failed else 0
