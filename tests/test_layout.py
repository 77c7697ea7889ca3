"""The package's layout rules, checked statically: no import cycle between its files (function-level imports
included), and the TVM adapter ``tvmfuse._tvm`` is a leaf that imports nothing of tvmfuse."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tvmfuse"


def _graph() -> dict[str, set[str]]:
    files = {p: ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in PKG.rglob("*.py")}
    mods = set(files.values())

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for path, me in files.items():
        base = me if path.name == "__init__.py" else me.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + ([mod] if mod else []))
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for n in names if n.startswith("tvmfuse") and (t := owner(n)) not in (None, me, "tvmfuse")}
        graph[me] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_tvm_adapter_imports_nothing_of_tvmfuse():
    assert _graph()["tvmfuse._tvm"] == set()


def test_the_scan_finds_a_cycle_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
