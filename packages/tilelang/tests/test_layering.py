"""The front end is built on the IR only; the language surface sits on top of it."""

import ast
from pathlib import Path

import tilelang

FRONTEND = Path(tilelang.__file__).parent / "frontend"


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_frontend_does_not_import_the_language():
    files = sorted(FRONTEND.glob("*.py"))
    assert {f.name for f in files} >= {"meta.py", "parser.py", "tileops.py"}
    for f in files:
        mods = _imported_modules(f)
        bad = {m for m in mods if m.lstrip(".").startswith("language") or m.startswith("tilelang.language")
               or m == ".." or m.endswith("..language")}
        assert not bad, f"{f.name} imports {bad}"


def test_language_recognized_by_marker():
    import tilelang.language as T

    assert T.__tl_language__ is True
    assert T.Macro is tilelang.frontend.meta.Macro
