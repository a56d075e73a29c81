"""The layout rules of docs/architecture.md, checked on the source: floors import only downwards,
no import circles, workers import no dataset converter. A module's size follows its concern."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("common", "worker", "pserver", "launch")  # each may import only the ones before it
ALLOWED = {"common": set(), "worker": {"common"}, "pserver": {"common"}, "launch": set(FLOORS)}


def _modules() -> dict[str, Path]:
    found = {}
    for floor in FLOORS:
        for path in (ROOT / floor).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path], everywhere: bool) -> set[str]:
    """Project modules ``path`` imports (at module level, or anywhere with ``everywhere``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = ast.walk(tree) if everywhere else iter(tree.body)
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
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
            node, edges = work[-1]
            child = next(edges, None)
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


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules, False) - {name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_floors_import_only_downwards() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        floor = name.split(".")[0]
        for target in _imports(path, modules, True):
            other = target.split(".")[0]
            if other != floor and other not in ALLOWED[floor]:
                wrong.append(f"{name} imports {target}")
    assert wrong == []


def test_workers_import_no_dataset_converter() -> None:
    modules = _modules()
    seen: set[str] = set()
    todo = [name for name in modules if name.startswith("worker")]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _imports(modules[name], modules, False)
    assert sorted(n for n in seen if n.startswith("common.data.convert")) == []
