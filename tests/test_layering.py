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


@pytest.mark.parametrize("a,b", [("agent", "envs"), ("controller", "workers")])
def test_no_import_cycle_between(a, b):
    graph = package_graph()
    assert not (b in graph[a] and a in graph[b]), (
        f"hybridrl.{a} and hybridrl.{b} import each other: {a} -> {sorted(graph[a])}, {b} -> {sorted(graph[b])}")


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
    from hybridrl.envs.tasks.registry import _shipped, task_class

    for name in _shipped():
        assert task_class(name).name == name
