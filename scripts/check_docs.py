"""Docs check (nox -s docs): each package has a guide page, each README's first Python example
runs as written, and READMEs hold no link that breaks: a relative link must resolve in the
checkout, and a package README (also its wheel's description on an index page) has no relative
link leaving its package folder, nor paths a clone lacks (`.venv/`, `../shared/`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tilestack.demo import run_example

ROOT = Path(__file__).resolve().parent.parent
GUIDES = {"hal": "tilehal", "tilelang": "tilelang", "deepgemm": "deepgemm", "deepep": "deepep",
          "kvpool": "kvpool", "dataengine": "dataengine"}
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
NOT_IN_A_CLONE = (".venv/", "../shared/")


def link_problems(readme: Path, package: bool) -> list[str]:
    text, rel = readme.read_text(), readme.relative_to(ROOT)
    out = [f"{rel} mentions {bad!r}, which a clone does not have" for bad in NOT_IN_A_CLONE if bad in text]
    for target in LINK.findall(text):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = (readme.parent / target.split("#")[0]).resolve()
        if not path.exists():
            out.append(f"{rel}: link {target!r} does not resolve")
        elif package and not path.is_relative_to(readme.parent.resolve()):
            out.append(f"{rel}: link {target!r} leaves the package folder (broken on an index page)")
    return out


def main() -> int:
    problems = []
    if not (ROOT / "docs" / "architecture.md").exists():
        problems.append("docs/architecture.md is missing")
    problems += link_problems(ROOT / "README.md", package=False)
    for folder, guide in GUIDES.items():
        problems += link_problems(ROOT / "packages" / folder / "README.md", package=True)
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
