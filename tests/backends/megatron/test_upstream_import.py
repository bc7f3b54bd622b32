"""megatron-core is imported without torch's compiler stack, and what it compiles still compiles."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.launch import ROOT, env_with_repo


def test_importing_the_backend_leaves_the_compiler_unloaded_and_torch_compile_restored():
    probe = ("import sys, json, torch; real = torch.compile\n"
             "import hybridrl.backends.megatron.model\n"
             "import megatron.core.jit as jit\n"
             "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'inductor': 'torch._inductor' in sys.modules,"
             " 'restored': torch.compile is real, 'fuser_deferred': jit.jit_fuser is not real}))")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"dynamo": False, "inductor": False, "restored": True, "fuser_deferred": True}


def test_a_deferred_compile_compiles_once_at_the_first_call_with_its_options():
    from hybridrl.backends.megatron import upstream

    calls = []

    def fake_compile(fn, **options):
        calls.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    real, upstream._COMPILE = upstream._COMPILE, fake_compile
    try:
        @upstream._compile_on_first_call(dynamic=False)
        def double(x):
            return 2 * x

        assert calls == [] and double.__name__ == "double"        # nothing compiled at decoration
        assert double(3) == ("compiled", 6) and double(x=4) == ("compiled", 8)
        assert calls == [{"dynamic": False}]                        # once, with the decorator's options
        direct = upstream._compile_on_first_call(lambda x: x + 1, fullgraph=True)
        assert direct(1) == ("compiled", 2) and calls[-1] == {"fullgraph": True}
    finally:
        upstream._COMPILE = real
    assert torch.compile is real


def test_a_deferred_compile_runs_through_torch_compile():
    from hybridrl.backends.megatron import upstream

    fn = upstream._compile_on_first_call(lambda x: torch.sin(x) * 2, backend="eager")
    x = torch.linspace(0, 1, 7)
    torch.testing.assert_close(fn(x), torch.sin(x) * 2)
