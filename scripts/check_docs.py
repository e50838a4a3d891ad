"""Docs check (nox -s docs): each package has a guide page, and each README's first Python
example runs as written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tilestack.demo import run_example

ROOT = Path(__file__).resolve().parent.parent
GUIDES = {"hal": "tilehal", "tilelang": "tilelang", "deepgemm": "deepgemm", "deepep": "deepep",
          "kvpool": "kvpool", "dataengine": "dataengine"}
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def main() -> int:
    problems = []
    if not (ROOT / "docs" / "architecture.md").exists():
        problems.append("docs/architecture.md is missing")
    for folder, guide in GUIDES.items():
        if not (ROOT / "docs" / f"{guide}.md").exists():
            problems.append(f"docs/{guide}.md is missing")
        readme = ROOT / "packages" / folder / "README.md"
        blocks = BLOCK.findall(readme.read_text())
        if not blocks:
            problems.append(f"{readme.relative_to(ROOT)} has no ```python example")
            continue
        print(f"running the example of {readme.relative_to(ROOT)}")
        try:
            run_example(blocks[0], folder)
        except Exception as e:  # report every failing example, not just the first
            problems.append(f"{readme.relative_to(ROOT)} example failed: {type(e).__name__}: {e}")
    for p in problems:
        print(f"docs: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
