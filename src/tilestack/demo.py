"""`tilestack demo`: run every installed package's README example on this machine."""

from __future__ import annotations

import time
import traceback

from .packages import PACKAGES, installed_version, readme_examples


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
        print(f"== {pkg.module}: README example ({pkg.role})")
        t0 = time.perf_counter()
        try:
            exec(compile(blocks[0], f"<{pkg.dist} README>", "exec"), {"__name__": "__tilestack_demo__"})
        except Exception:
            failures += 1
            traceback.print_exc()
            print(f"== {pkg.module}: FAILED")
            continue
        print(f"== {pkg.module}: ok in {time.perf_counter() - t0:.2f} s")
    return 1 if failures else 0
