"""Short functions: no function in hybridrl/ is longer than 80 lines (from its `def` to its last line),
except today's offenders listed below with their length, which may only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.launch import ROOT

LIMIT = 80
# path:qualified name -> its length when listed (being shortened by their owners); none today
OFFENDERS: dict[str, int] = {}


def lengths(path: Path, relative: str) -> dict[str, int]:
    """'relative:Class.function' -> lines, for every function and method (nested ones too)."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{relative}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_function_is_over_80_lines():
    found: dict[str, int] = {}
    for path in sorted((ROOT / "hybridrl").rglob("*.py")):
        found.update(lengths(path, str(path.relative_to(ROOT))))
    long = {name: n for name, n in found.items() if n > max(LIMIT, OFFENDERS.get(name, 0))}
    assert not long, (f"functions over {LIMIT} lines (split them: one job each): "
                      + ", ".join(f"{name} ({n})" for name, n in sorted(long.items())))


def test_the_count_sees_methods_and_nested_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def f(self):\n        def g():\n            return 1\n        return g()\n")
    assert lengths(src, "m.py") == {"m.py:A.f": 4, "m.py:A.f.g": 2}
