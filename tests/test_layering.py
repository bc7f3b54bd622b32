"""The package layering holds: no import cycle between the packages named below, and a config
loads without importing every task.

The graph counts every `import` of a hybridrl module anywhere in a file (deferred imports inside
functions too: a cycle through a function body is still a cycle in the design), except those
under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.launch import ROOT

PACKAGE = ROOT / "hybridrl"


def _imported_modules(tree: ast.AST) -> list[str]:
    out: list[str] = []
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def package_graph() -> dict[str, set[str]]:
    """hybridrl sub-package (or top-level module) -> the sub-packages it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module in _imported_modules(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            if parts[0] == "hybridrl" and len(parts) > 1 and parts[1] != source:
                graph[source].add(parts[1])
    return graph


# The documented layering (docs/architecture.md, "Layering"), lowest first: a package imports packages of
# its own layer or below. Top-level modules not named here are entry points (the CLI, the torchrun entry,
# the demo, ...), which may import anything.
LAYERS = (
    ("foundations", {"config", "data", "telemetry", "registry"}),
    ("algorithms and protocols", {"algo", "reward", "distributed", "training", "rollout"}),
    ("components", {"envs", "store", "publication", "agent", "gateway", "backends", "assets"}),
    ("assembly", {"workers", "jobs", "host_memory", "shipped"}),
    ("loops and checks", {"controller", "preflight", "evaluate", "bench", "inspect", "cost"}),
)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_the_package_graph_has_no_cycle():
    graph = package_graph()
    found = cycles(graph)
    assert not found, "packages that import each other (directly or through others): " + "; ".join(
        f"{c}: " + ", ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) for c in found)


def test_every_package_imports_only_its_layer_or_below():
    level = {pkg: i for i, (_, pkgs) in enumerate(LAYERS) for pkg in pkgs}
    graph = package_graph()
    upward = [(a, b) for a, bs in graph.items() if a in level for b in bs if level.get(b, len(LAYERS)) > level[a]]
    assert not upward, "imports from a lower layer into a higher one: " + ", ".join(
        f"{a} ({LAYERS[level[a]][0]}) -> {b} ({LAYERS[level[b]][0] if b in level else 'entry points'})"
        for a, b in sorted(upward))


def test_a_cycle_is_found_wherever_it_closes():
    graph = {"config": set(), "data": set(), "workers": {"config", "data"}, "controller": {"workers"}}
    assert cycles(graph) == []
    graph["config"].add("controller")        # a schema that imported a controller module
    assert cycles(graph) == [["config", "controller", "workers"]]


def test_the_episode_records_are_a_leaf():
    """TaskInstance / EpisodeOutcome / Transition import nothing of hybridrl."""
    tree = ast.parse((PACKAGE / "data" / "episode.py").read_text())
    assert not [m for m in _imported_modules(tree) if m.startswith("hybridrl")]


def test_loading_a_config_imports_only_the_named_task():
    """Checking `task.options` imports the named task's module, and no other task."""
    code = ("import sys; from hybridrl.config import load_config; load_config(None, ['task.name=guess_number', 'task.options.max_value=50']); "
            "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('hybridrl.envs.tasks.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['base', 'guess_number', 'registry']"


def test_shipped_task_modules_are_named_after_their_task():
    from hybridrl.envs.tasks.registry import TASKS, task_class

    for name in TASKS.shipped():
        assert task_class(name).name == name
