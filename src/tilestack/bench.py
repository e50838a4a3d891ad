"""`tilestack bench`: run the CPU benchmark scripts of a checkout (packages/*/benchmarks/*.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def find_scripts(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("packages/*/benchmarks/*.py") if not p.name.startswith("_"))


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path.cwd()
    scripts = find_scripts(root)
    if not scripts:
        print(f"tilestack bench: no packages/*/benchmarks/*.py under {root}; run it from a TileStack checkout")
        return 2
    failed = 0
    for i, script in enumerate(scripts, 1):
        print(f"[{i}/{len(scripts)}] {script.relative_to(root)}", flush=True)
        rc = subprocess.call([sys.executable, str(script)], cwd=root)
        failed += rc != 0
    return 1 if failed else 0
