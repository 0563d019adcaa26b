"""The layering holds: only fxpipe/runtime/ imports torch.distributed, imports only go down
(core < sim < passes < front door; runtime imports core only) and no import cycle exists, counting
lazy (function-level) and TYPE_CHECKING imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("fxpipe", "passes", "models")
# Source folder -> the package it installs as (pyproject's package-dir); the import graph covers these.
GRAPH_PACKAGES = {"fxpipe": "fxpipe", "passes": "fxpipe.passes"}
# Layer rank by module prefix, most specific first; anything else under fxpipe is the front door.
LAYERS = (("fxpipe.core", 0), ("fxpipe.sim", 1), ("fxpipe.passes", 2), ("fxpipe.runtime", 3))
FRONT_DOOR = 4
RUNTIME_MAY_IMPORT = ("fxpipe.core", "fxpipe.runtime")
# fxpipe/runtime's rooms by floor: a room imports only rooms on lower floors (and itself); the modules at the
# runtime's root (the operations api.py calls on a running pipeline) sit on top.
RUNTIME_FLOORS = {
    "faults": 0,
    "transport": 1, "autograd": 1, "numerics": 1,
    "compile": 2, "parallel": 2,
    "gradients": 3,  # sums over replica groups, which tensor-parallel stages (parallel/) define
    "execution": 4,
    "calibration": 5,
}
RUNTIME_ROOT_FLOOR = 6


def _imports_torch_distributed(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
            lines.append(node.lineno)
    return lines


def _source_files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of fxpipe/ and passes/ under ``root``."""
    modules = {}
    for folder, package in GRAPH_PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imported_names(tree: ast.AST) -> Iterator[tuple[str, int]]:
    # ast.walk sees every import: top level, inside functions and under `if TYPE_CHECKING:`.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported module of ours: first line}. `from a import b` counts as importing a.b when
    a.b is a module, else as importing a; a module importing its own package is not an edge."""
    modules = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for imported, line in _imported_names(ast.parse(path.read_text(), filename=str(path))):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                edges.setdefault(imported, line)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return FRONT_DOOR


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def upward_edges(graph: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Edges that point up the layer order, or out of the runtime to anything but core."""
    bad = []
    for module, edges in sorted(graph.items()):
        for imported, line in sorted(edges.items()):
            runtime_escape = _within(module, ("fxpipe.runtime",)) and not _within(imported, RUNTIME_MAY_IMPORT)
            if layer_of(imported) > layer_of(module) or runtime_escape:
                bad.append(f"{module} (line {line}) -> {imported}")
    return bad


def runtime_room(module: str) -> str | None:
    """The room of a runtime module (``fxpipe.runtime.execution.driver`` -> ``execution``), ``""`` for the
    runtime's root modules, None outside the runtime."""
    if not _within(module, ("fxpipe.runtime",)):
        return None
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in RUNTIME_FLOORS) else ""


def runtime_upward_edges(graph: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Runtime imports from a room to a room on the same or a higher floor (a room's own modules excepted)."""
    bad = []
    for module, edges in sorted(graph.items()):
        room = runtime_room(module)
        for imported, line in sorted(edges.items()):
            target = runtime_room(imported)
            if room is None or target is None or target == room:
                continue
            floor = RUNTIME_FLOORS.get(room, RUNTIME_ROOT_FLOOR)
            if RUNTIME_FLOORS.get(target, RUNTIME_ROOT_FLOOR) >= floor:
                bad.append(f"{module} (line {line}) -> {imported}")
    return bad


def test_runtime_rooms_import_only_lower_floors() -> None:
    rooms = {p.name for p in (ROOT / "fxpipe" / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(RUNTIME_FLOORS), f"runtime rooms {sorted(rooms)}; give each a floor in RUNTIME_FLOORS"
    planted = {"fxpipe.runtime.faults.errors": {"fxpipe.runtime.execution.stage": 3},
               "fxpipe.runtime.execution.driver": {"fxpipe.runtime.faults.errors": 1, "fxpipe.runtime.sync": 2}}
    assert runtime_upward_edges(planted) == ["fxpipe.runtime.execution.driver (line 2) -> fxpipe.runtime.sync",
                                             "fxpipe.runtime.faults.errors (line 3) -> fxpipe.runtime.execution.stage"]
    bad = runtime_upward_edges(import_graph(ROOT))
    assert not bad, "runtime imports that point up its floors (" + ", ".join(
        f"{room} {floor}" for room, floor in sorted(RUNTIME_FLOORS.items(), key=lambda item: item[1])) + \
        f", root {RUNTIME_ROOT_FLOOR}); move the shared code down:\n" + "\n".join(bad)


def import_cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next((s for s in successors if s in graph), None)
            if successor is not None and successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph[successor]))))
            elif successor is not None:
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                        components.append(sorted(component))
    return sorted(components)


def test_cycle_finder_and_layer_rules_on_a_planted_graph() -> None:
    graph = {
        "fxpipe.core.a": {"fxpipe.sim.b": 3},  # upward, and a cycle with sim.b
        "fxpipe.sim.b": {"fxpipe.core.a": 1},
        "fxpipe.runtime.c": {"fxpipe.passes.d": 2, "fxpipe.core.a": 4},  # runtime -> passes is banned
        "fxpipe.passes.d": {"fxpipe.core.a": 1},
        "fxpipe.api": {"fxpipe.runtime.c": 1, "fxpipe.passes.d": 2},
    }
    assert import_cycles(graph) == [["fxpipe.core.a", "fxpipe.sim.b"]]
    assert upward_edges(graph) == ["fxpipe.core.a (line 3) -> fxpipe.sim.b",
                                   "fxpipe.runtime.c (line 2) -> fxpipe.passes.d"]


def test_import_graph_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "fxpipe" / "core").mkdir(parents=True)
    (tmp_path / "passes").mkdir()
    (tmp_path / "fxpipe" / "__init__.py").write_text("")
    (tmp_path / "fxpipe" / "core" / "__init__.py").write_text("")
    (tmp_path / "passes" / "__init__.py").write_text("")
    (tmp_path / "passes" / "x.py").write_text("")
    (tmp_path / "fxpipe" / "core" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fxpipe.passes.x import thing\n"
        "def f():\n    from fxpipe.passes import x\n    import fxpipe.api\n")
    (tmp_path / "fxpipe" / "api.py").write_text("from fxpipe.core import a\n")
    graph = import_graph(tmp_path)
    assert graph["fxpipe.core.a"] == {"fxpipe.passes.x": 3, "fxpipe.passes": 5, "fxpipe.api": 6}
    assert import_cycles(graph) == [["fxpipe.api", "fxpipe.core.a"]]


def test_imports_only_go_down_the_layers() -> None:
    bad = upward_edges(import_graph(ROOT))
    assert not bad, "imports that point up the layers (core < sim < passes < front door; runtime imports " \
        "core only); move the shared code down a layer:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(ROOT))
    assert not cycles, "import cycles (lazy and TYPE_CHECKING imports count): " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_runtime_imports_torch_distributed(path: Path) -> None:
    if path.is_relative_to(ROOT / "fxpipe" / "runtime"):
        return
    lines = _imports_torch_distributed(path)
    assert not lines, f"{path.relative_to(ROOT)} imports torch.distributed at lines {lines}; move that code to fxpipe/runtime/"


def test_planning_import_does_not_load_torch_distributed_modules_of_ours() -> None:
    code = (
        "import sys, fxpipe, fxpipe.core.plan, fxpipe.core.schedule, fxpipe.core.cluster, fxpipe.core.chain\n"
        "import fxpipe.sim.simulate, fxpipe.passes.partition.dapple\n"
        "bad = [m for m in sys.modules if m.startswith('fxpipe.runtime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_light_imports_stay_light() -> None:
    """Core data and the simulator load without torch; fxpipe.passes and the runtime's step timer
    load neither the planner nor the tracer."""
    code = (
        "import sys, fxpipe.core.chain, fxpipe.core.planfile, fxpipe.sim.simulate\n"
        "assert 'torch' not in sys.modules, 'core/sim pulled in torch'\n"
        "import fxpipe.passes, fxpipe.runtime.autograd.measure\n"
        "heavy = [m for m in sys.modules if m.startswith(('fxpipe.passes.', 'fxpipe.api', 'fxpipe.planning'))]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_fxpipe_module_imports_first_in_a_fresh_interpreter() -> None:
    """No import cycle depends on which module a user imports first (the latency model once did)."""
    names = sorted(name for name in module_files(ROOT) if not name.endswith("__main__"))
    code = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
            "    for loaded in [m for m in sys.modules if m == 'fxpipe' or m.startswith('fxpipe.')]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except ImportError as error:\n        failed.append(f'{name}: {error}')\n"
            "assert not failed, failed\n")
    subprocess.run([sys.executable, "-c", code, *names], check=True)
