"""`tilestack demo`: run every installed package's README example on this machine."""

from __future__ import annotations

import os
import runpy
import tempfile
import time
import traceback

from .packages import PACKAGES, installed_version, readme_examples


def run_example(code: str, label: str) -> None:
    """Run one example as a script file (tilelang reads kernel source with inspect, which needs one)."""
    fd, path = tempfile.mkstemp(prefix=f"{label}_example_", suffix=".py")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(code)
        runpy.run_path(path, run_name="__main__")
    finally:
        os.unlink(path)


def main() -> int:
    failures = 0
    for pkg in PACKAGES:
        if installed_version(pkg) is None:
            print(f"== {pkg.module}: not installed, skipped")
            continue
        blocks = readme_examples(pkg)
        if not blocks:
            print(f"== {pkg.module}: no example in its README")
            continue
        print(f"== {pkg.module}: README example ({pkg.role})", flush=True)
        t0 = time.perf_counter()
        try:
            run_example(blocks[0], pkg.module)
        except Exception:
            failures += 1
            traceback.print_exc()
            print(f"== {pkg.module}: FAILED")
            continue
        print(f"== {pkg.module}: ok in {time.perf_counter() - t0:.2f} s", flush=True)
    return 1 if failures else 0
