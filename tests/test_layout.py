"""The layout rules of docs/architecture.md, checked on the source: floors import only downwards,
no import circles, workers import no dataset converter; and every test module has a name of its
own (docs/testing.md). A module's size follows its concern."""

from __future__ import annotations

import ast
import dataclasses
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
    """Imports inside functions count too: a deferred import still closes a circle."""
    modules = _modules()
    graph = {name: _imports(path, modules, True) - {name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_every_test_module_has_a_name_of_its_own() -> None:
    names = [path.name for path in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


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


def _server_reach_ins(source: str) -> list[str]:
    """Where ``source`` imports ``ParameterServer`` or annotates anything as one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"imports {a.name}" for a in node.names if a.name == "ParameterServer"]
        elif isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            text = ast.unparse(node.annotation)
            if "ParameterServer" in text:
                found.append(f"annotation {text}")
    return found


def test_the_server_check_finds_a_reach_in() -> None:
    source = "from pserver.server import ParameterServer\n\ndef book(ps: 'ParameterServer'): ..."
    assert _server_reach_ins(source) == ["imports ParameterServer", "annotation 'ParameterServer'"]
    assert _server_reach_ins("from pserver.server import run_server\n") == []


def test_only_the_server_module_knows_the_server() -> None:
    """Components are built with the collaborators they use: no module but pserver.server
    imports ``ParameterServer`` or takes one (not even for type hints)."""
    found = [
        f"{name}: {what}"
        for name, path in _modules().items()
        if name != "pserver.server"
        for what in _server_reach_ins(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def _worker_writes(source: str, fields: set[str]) -> list[str]:
    """Where ``source`` assigns a ``WorkerInfo`` field of a ``worker`` or changes its queue."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            queue = node.func.value
            if isinstance(queue, ast.Attribute) and queue.attr == "tasks":
                targets = [queue] if node.func.attr != "copy" else []
        for target in targets:
            part = target
            while isinstance(part, ast.Attribute | ast.Subscript):  # down to worker.<field>
                base = part.value
                if (
                    isinstance(part, ast.Attribute)
                    and part.attr in fields
                    and isinstance(base, ast.Name)
                    and base.id in ("worker", "w", "member")
                ):
                    found.append(ast.unparse(part))
                part = base
    return found


def test_the_worker_write_check_finds_a_write() -> None:
    fields = {"tasks", "pushing", "samples"}
    source = "worker.pushing = None\nworker.samples += 3\nworker.tasks.appendleft(t)\nw.name = 1"
    assert _worker_writes(source, fields) == ["worker.pushing", "worker.samples", "worker.tasks"]
    assert _worker_writes("seen[worker.samples] = 1\nx = worker.tasks[0]", fields) == []


def test_only_the_roster_writes_a_worker() -> None:
    from pserver.membership import WorkerInfo

    fields = {f.name for f in dataclasses.fields(WorkerInfo)}
    found = [
        f"{name}: {what}"
        for name, path in _modules().items()
        if name.startswith("pserver") and name != "pserver.membership"
        for what in _worker_writes(path.read_text(encoding="utf-8"), fields)
    ]
    assert found == []


PLANNER_HOMES = ("common.training", "pserver.policies")
# What a plan is composed of; every other module asks ``WeightedPlanner``, ``async_batches``,
# ``plan_equal`` or ``plan_batches`` for one.
PLAN_PARTS = {"plan_by_model", "plan_by_speed", "at_least", "ProbeSchedule", "batch_sizes"}
NOT_PLANS = {"common.data.splits"}  # rounds class proportions of a split, not batches
FLOORS_OF = {"floor", "trunc", "floor_divide"}
ORDERS = {"argsort", "sorted", "argpartition"}


def _planner_arithmetic(source: str) -> list[str]:
    """Where ``source`` composes a plan itself: uses one of ``PLAN_PARTS``, or rounds shares
    to whole batches (a function that floors and orders, as largest-remainder rounding does)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if isinstance(node, ast.alias | ast.FunctionDef):
            name = node.name
        if name in PLAN_PARTS:
            found.append(name)
        if isinstance(node, ast.FunctionDef):
            calls = {
                c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
                for c in ast.walk(node)
                if isinstance(c, ast.Call)
            }
            if calls & FLOORS_OF and calls & ORDERS:
                found.append(f"{node.name} rounds shares")
    return found


def test_the_planner_check_finds_a_second_planner() -> None:
    copy = (
        "from common.training.planner import plan_by_model\n"
        "from common.training.probes import ProbeSchedule\n"
        "def plan(fits, total):\n    return plan_by_model(fits, total, ProbeSchedule().due(fits))"
    )
    assert sorted(set(_planner_arithmetic(copy))) == ["ProbeSchedule", "plan_by_model"]
    rounding = (
        "import numpy as np\n"
        "def split(share, total):\n"
        "    take = np.floor(share * total)\n"
        "    order = np.argsort(take - share * total)\n"
        "    return take, order"
    )
    assert _planner_arithmetic(rounding) == ["split rounds shares"]
    assert _planner_arithmetic("from common.training.planner import WeightedPlanner\n") == []


def test_plans_are_composed_only_by_the_planner_and_the_policies() -> None:
    """The simulator and the launchers plan with the server's own code, never a copy."""
    found = [
        f"{name}: {what}"
        for name, path in _modules().items()
        if not name.startswith(PLANNER_HOMES) and name not in NOT_PLANS
        for what in _planner_arithmetic(path.read_text(encoding="utf-8"))
    ]
    assert found == []
    tree = ast.parse((ROOT / "launch/simulate/engine.py").read_text(encoding="utf-8"))
    homes = ("common.training.planner", "pserver.policies.staleness")
    used = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in homes
        for alias in node.names
    }
    assert {"WeightedPlanner", "async_batches", "plan_equal", "lr_scale", "too_stale"} <= used


MAX_PARAMETERS, MAX_POSITIONAL = 8, 2
STORE_KINDS = {"StoreService", "RemoteStores", "SliceStore"}


def _sources() -> dict[str, Path]:
    """Every non-test module: the floors and the benches."""
    found = _modules()
    for path in (ROOT / "bench").rglob("*.py"):
        found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


def _wide_constructors(source: str) -> list[str]:
    """Classes whose ``__init__`` takes more than 8 parameters, or more than 2 that may be
    passed by position (``self`` not counted). A constructor that forwards ``*args`` to its
    base takes the base's signature, which is checked where it is defined; dataclasses are
    records, not wiring, and are not checked."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args
                positional = len(args.posonlyargs) + len(args.args) - 1
                total = positional + len(args.kwonlyargs)
                if total > MAX_PARAMETERS or positional > MAX_POSITIONAL:
                    found.append(f"{node.name}: {positional} positional of {total}")
    return found


def _store_kind_checks(source: str) -> list[str]:
    """Where ``source`` asks which kind of parameter store it has (``isinstance``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
            kinds = node.args[1] if len(node.args) > 1 else None
            names = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
            if any(isinstance(n, ast.Name | ast.Attribute) and ast.unparse(n).split(".")[-1]
                   in STORE_KINDS for n in names):  # fmt: skip
                found.append(ast.unparse(node))
    return found


def test_the_constructor_check_finds_wide_wiring() -> None:
    wide = (
        "class A:\n    def __init__(self, a, b, c): ...\n"
        "class B:\n    def __init__(self, a, b, *, c, d, e, f, g, h, i): ...\n"
        "class C:\n    def __init__(self, a, b, *, c, d, e, f, g, h): ...\n"
        "class D:\n    def __init__(self, *args, **kwargs): ...\n"
    )
    assert _wide_constructors(wide) == ["A: 3 positional of 3", "B: 2 positional of 9"]


def test_components_are_built_by_keyword_with_few_collaborators() -> None:
    """No constructor takes more than 8 parameters, and none beyond the first two by position."""
    found = [
        f"{name}: {what}"
        for name, path in _sources().items()
        for what in _wide_constructors(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_the_store_kind_check_finds_a_switch() -> None:
    source = (
        "if isinstance(stores, RemoteStores): ...\n"
        "ok = isinstance(s, (int, stores.StoreService))\n"
        "fine = isinstance(msg, PullRequest)\n"
    )
    assert _store_kind_checks(source) == [
        "isinstance(stores, RemoteStores)",
        "isinstance(s, (int, stores.StoreService))",
    ]


def test_no_caller_asks_which_store_it_has() -> None:
    """Outside the store package the parameter stores are used through ``ParameterStores``."""
    found = [
        f"{name}: {what}"
        for name, path in _sources().items()
        if not name.startswith("pserver.store")
        for what in _store_kind_checks(path.read_text(encoding="utf-8"))
    ]
    assert found == []
