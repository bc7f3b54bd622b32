"""On a CPU device without `hybrid.spill_optimizer`, a mode switch leaves the gradient buffers where
they are (with the optimizer state, which cannot leave either): nothing is freed for the rollout and
nothing is allocated again at the reload, and the next update is the one a switch that freed them
gives, to the bit. Real ranks, the same memory job as `test_hybrid.py`'s."""

from __future__ import annotations

import pytest

from tests.workers.test_hybrid import run_job


@pytest.mark.slow          # two hybrid runs of one rank: minutes on a loaded 2-core machine
def test_a_cpu_switch_keeps_the_gradient_buffers_and_trains_the_same(tmp_path, tiny_models):
    model = tiny_models("qwen2", init_std=0.1)
    args = ("distributed.nproc_per_node=1", "rollout.native.kv_cache_mb=4", "trainer.prompts_per_step=2")
    proc, kept = run_job(tmp_path / "kept", "MEMORY", model, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    grads = kept["train"]["grad_bytes_held"]
    assert grads > 0
    assert kept["rollout"]["grad_bytes_held"] == grads and kept["back"]["grad_bytes_held"] == grads
    assert kept["rollout"]["optimizer_bytes_held"] == kept["train"]["optimizer_bytes_held"] > 0
    assert kept["rollout"]["phases"]["offload"]["bytes"] == 0 and kept["back"]["phases"]["reload"]["bytes"] == 0

    proc, freed = run_job(tmp_path / "freed", "MEMORY", model, *args, "hybrid.spill_optimizer=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert freed["rollout"]["grad_bytes_held"] == 0 and freed["back"]["grad_bytes_held"] == grads
    assert freed["back"]["phases"]["reload"]["bytes"] >= grads
    assert kept["again"]["loss"] == freed["again"]["loss"] and kept["again"]["grad_norm"] == freed["again"]["grad_norm"]
