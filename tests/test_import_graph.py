"""The stack's import graph, read from the source (nothing is imported): layers point down only,
and no modules import each other in a circle (tilelang included).

Every import statement counts, wherever it stands: at module level, inside a function (a lazy
import), or under `if TYPE_CHECKING:` (a circle hidden from the interpreter is still one for
the reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "packages").glob("*/src")), ROOT / "src"]
PEERS = {"tilelang", "deepgemm", "deepep", "kvpool", "dataengine"}
STACK = PEERS | {"tilehal", "tilestack"}
# Circles known and owned elsewhere: each entry names the issue that removes it.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for src in SOURCES:
        for f in src.rglob("*.py"):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in mods]
        # `from pkg import sub` loads pkg's __init__ too, but as an edge it names only the submodules.
        names = subs if len(subs) == len(node.names) else [prefix, *subs]
    out = []
    for name in names:
        while name and name not in mods:  # `import a.b.c` where c is a name: the module a.b
            name = name.rpartition(".")[0]
        if name and name != mod:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[mod] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                      for t in _targets(mod, path.name == "__init__.py", node, mods)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def test_the_graph_sees_every_package():
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == STACK
    assert "kvpool.pool" in graph["kvpool.cuda_decode"]  # a relative import resolves


def test_layers_point_down():
    graph = import_graph()
    wrong = []
    for mod, targets in graph.items():
        top = mod.split(".")[0]
        for t in targets:
            other = t.split(".")[0]
            if other == top or other not in STACK:
                continue
            if top == "tilehal" or other == "tilestack" or (top in PEERS and other != "tilehal"):
                wrong.append(f"{mod} -> {t}")
    assert not wrong, "imports against the layering (DESIGN.md: peers never import each other):\n" + "\n".join(wrong)


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"modules importing each other in a circle: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"listed as known but no longer a circle (remove from KNOWN_CYCLES): {gone}"


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
