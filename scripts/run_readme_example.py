"""Run a README's first ```python example as a script, the way a reader pastes it into a file:
`python scripts/run_readme_example.py packages/kvpool/README.md` (nox -s readme_install runs it
from a scratch folder in a fresh environment, so only the installed wheels are importable)."""

from __future__ import annotations

import re
import runpy
import sys
import tempfile
from pathlib import Path

BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: run_readme_example.py README.md", file=sys.stderr)
        return 2
    readme = Path(argv[0])
    blocks = BLOCK.findall(readme.read_text())
    if not blocks:
        print(f"{readme}: no ```python example", file=sys.stderr)
        return 1
    # A real file: tilelang reads kernel source back with inspect.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "readme_example.py"
        path.write_text(blocks[0])
        print(f"== running the example of {readme}", flush=True)
        runpy.run_path(str(path), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
