"""The package's imports run one way: no module reaches itself through others (every import counted, those inside
functions and under TYPE_CHECKING too), the leaf modules import nothing of ours, and the engine never reaches the
jobs above it (tuning, training, benchmarks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "turbospec"
LEAVES = ("turbospec.host", "turbospec.draft")  # what every layer may import


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = _module_names()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Our modules an import statement loads (a `from package import name` may name a module)."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = module.split(".")
        if node.level:
            is_package = MODULES[module].name == "__init__.py"
            base = base[: len(base) - node.level + is_package]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        candidates = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
    found = []
    for name in candidates:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != "turbospec":  # the root only re-exports the public API
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _imported(name, node) if t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


GRAPH = import_graph()


def test_the_walk_sees_lazy_and_type_checking_imports():
    # known edges of each kind, so a walk that missed them could not pass the tests below by seeing nothing
    assert "turbospec.determinism.batch_invariant" in GRAPH["turbospec.engine"]  # inside __init__
    assert "turbospec.engine" in GRAPH["turbospec.training.dart"]  # under TYPE_CHECKING
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    found = circles(GRAPH)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_ours(leaf: str):
    allowed = {"turbospec.verification.tree"} if leaf == "turbospec.draft" else set()  # (a Draft may be a tree)
    assert GRAPH[leaf] <= allowed


def test_the_engine_never_reaches_the_jobs_above_it():
    above = ("turbospec.tuning", "turbospec.training", "turbospec.bench", "turbospec.server", "turbospec.cli",
             "turbospec.sim", "turbospec.llm")
    reached = sorted(m for m in reachable(GRAPH, "turbospec.engine") if m.startswith(above))
    assert not reached, f"the engine imports, directly or not: {reached}"
