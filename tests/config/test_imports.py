"""Every component config imports on its own, first, in a fresh interpreter (no import cycle)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch import ROOT

MODULES = ["hybridrl.distributed.config", "hybridrl.backends.rollout_config", "hybridrl.agent.config", "hybridrl.envs.config",
           "hybridrl.backends.megatron.config", "hybridrl.backends.sglang.config", "hybridrl.algo.config",
           "hybridrl.config.schema"]


@pytest.mark.parametrize("module", MODULES)
def test_config_module_imports_first_and_light(module):
    code = f"import sys, {module}; heavy = [m for m in ('torch', 'megatron') if m in sys.modules]; print(heavy)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{module} imports {proc.stdout.strip()} (configs must stay light)"
