"""No capability is found by probing: every `getattr(x, "literal", ...)` / `hasattr(x, "literal")` in
hybridrl/ is listed in tests/probe_allowlist.txt (third-party objects only),
and no class forwards unknown attributes to another object (`def __getattr__` in a class body; a
module's PEP 562 `__getattr__` of lazy exports is not a proxy)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.launch import ROOT

ALLOWLIST = ROOT / "tests" / "probe_allowlist.txt"


def probes(path: Path, relative: str) -> Counter:
    """'relative | call' -> how many times, for each getattr/hasattr of a string literal in the file."""
    found: Counter = Counter()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            found[f"{relative} | {ast.unparse(node)}"] += 1
    return found


def allowed() -> Counter:
    lines = [line for line in ALLOWLIST.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return Counter(" | ".join(part.strip() for part in line.split(" | ")[:2]) for line in lines)


def test_no_probe_of_the_projects_own_types():
    found: Counter = Counter()
    for path in sorted((ROOT / "hybridrl").rglob("*.py")):
        found += probes(path, str(path.relative_to(ROOT)))
    new = found - allowed()
    assert not new, ("getattr/hasattr of a literal name not in tests/probe_allowlist.txt: make the capability a "
                     "field of its row or a method of its protocol; list it only if the object is not one of the "
                     "project's types:\n" + "\n".join(sorted(new)))


def test_no_class_forwards_attributes():
    proxies = []
    for path in sorted((ROOT / "hybridrl").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                proxies += [f"{relative}:{f.lineno} {node.name}" for f in node.body
                            if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"]
    assert not proxies, "classes that forward attributes (`__getattr__`): " + ", ".join(proxies)


def test_the_walk_finds_a_probe(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(engine, n):\n    return getattr(engine, 'writable_views', None), getattr(engine, n), "
                   "hasattr(engine, 'x')\n")
    assert probes(src, "m.py") == Counter({"m.py | getattr(engine, 'writable_views', None)": 1,
                                           "m.py | hasattr(engine, 'x')": 1})
