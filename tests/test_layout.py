"""The package's layout rules, checked statically (function-level imports included): no import cycle between its
files; the TVM adapter ``tvmfuse._tvm`` is a leaf that imports nothing of tvmfuse; imports go down the stages
(frontend -> plan -> kernels -> tune -> db -> compile -> runtime/inspect), never up; the kernel templates import
nothing of the tuner; and no file passes 600 lines."""
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
    graph = _graph()
    assert graph["tvmfuse._tvm"] == set()
    assert graph["tvmfuse._gpu_rules"] == {"tvmfuse._tvm"}   # the untuned GPU rules build on the adapter alone


def test_the_scan_finds_a_cycle_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The stages in the order data flows through them; a module may import its own stage and earlier ones. Stage 0 is
# what every stage may use: the TVM adapter, errors, logs, the targets and machines (and the RPC servers that
# measure on them), the runtime's thread count, the reference check; the library's entry points (api, cli) come
# last.
STAGES = [
    {"tvmfuse", "tvmfuse._tvm", "tvmfuse._gpu_rules", "tvmfuse.nvcc_cache", "tvmfuse.errors", "tvmfuse.logs", "tvmfuse.target",
     "tvmfuse.machine", "tvmfuse.rpc",
     "tvmfuse.data", "tvmfuse.verify", "tvmfuse.threads"},
    {"tvmfuse.frontend"},
    {"tvmfuse.plan"},
    {"tvmfuse.kernels"},
    {"tvmfuse.tune"},
    {"tvmfuse.db"},
    {"tvmfuse.compile"},
    {"tvmfuse.runtime", "tvmfuse.inspect"},
    {"tvmfuse.bench"},
    {"tvmfuse.api"},
    {"tvmfuse.cli"},
]

# Imports up the stages that stay, each with its reason.
KNOWN_UPWARD = {
    # the artifact's manifest (its name, the digest) and its signature are the loader's: runtime/ must load an
    # artifact on a machine without the compiler, so compile writes them with the loader's own code
    ("tvmfuse.compile.artifact", "tvmfuse.runtime.loaded"),
    ("tvmfuse.compile.artifact", "tvmfuse.runtime.signing"),
}

MAX_LINES = 600


def stage_of(module: str) -> int:
    for n, stage in enumerate(STAGES):
        if any(module == s or module.startswith(s + ".") for s in stage if s != "tvmfuse") or module in stage:
            return n
    raise AssertionError(f"{module} is in no stage: add it to STAGES in tests/test_layout.py")


def _upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, d) for m, deps in graph.items() for d in deps if stage_of(d) > stage_of(m)}


def test_imports_go_down_the_stages():
    upward = _upward(_graph())
    assert upward <= KNOWN_UPWARD, "imports up the stages: " + ", ".join(
        f"{m} -> {d}" for m, d in sorted(upward - KNOWN_UPWARD))
    assert not KNOWN_UPWARD - upward, f"known exceptions that are gone (drop them): {sorted(KNOWN_UPWARD - upward)}"


def test_the_stage_scan_finds_an_upward_import():
    assert _upward({"tvmfuse.plan.cost": {"tvmfuse.tune.spaces"}, "tvmfuse.tune.spaces": {"tvmfuse.plan.cost"}}) == {
        ("tvmfuse.plan.cost", "tvmfuse.tune.spaces")}


def test_the_kernel_templates_import_nothing_of_the_tuner():
    graph = _graph()
    found = {(m, d) for m, deps in graph.items() if m.startswith("tvmfuse.kernels") for d in deps
             if d == "tvmfuse.tune" or d.startswith("tvmfuse.tune.")}
    assert not found, found


def test_no_file_passes_600_lines():
    long = {str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
            if len(p.read_text().splitlines()) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by concept): {sorted(long)}"
