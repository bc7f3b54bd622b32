"""The dead-name check: nothing in hybridrl/ is unused (vulture, 60% confidence and up) unless
tests/dead_code_allowlist.py lists it. Tests, benchmarks and examples count as users."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import ROOT

ALLOWLIST = "tests/dead_code_allowlist.py"


def _vulture(*paths: str, cwd=ROOT) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "vulture", *paths, "--min-confidence", "60"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert "No module named vulture" not in proc.stderr, "vulture is missing: pip install -e '.[test]'"
    return proc.stdout.splitlines()


def test_no_dead_name_in_the_package():
    found = [line for line in _vulture("hybridrl", "tests", "benchmarks", "examples", ALLOWLIST)
             if line.startswith("hybridrl/")]
    assert not found, ("unused names in hybridrl/ (delete them, or list one in tests/dead_code_allowlist.py with "
                       "why something vulture cannot see uses it):\n" + "\n".join(found))


def test_the_check_finds_a_dead_function(tmp_path):
    (tmp_path / "mod.py").write_text("def used():\n    return 1\n\n\ndef forgotten():\n    return 2\n\n\nused()\n")
    found = _vulture("mod.py", cwd=tmp_path)
    assert len(found) == 1 and "unused function 'forgotten'" in found[0]
