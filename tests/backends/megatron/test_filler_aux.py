"""Expert-parallel filler micro-batches add nothing to the routers' auxiliary losses (load balancing, z).

A rank with fewer packed micro-batches than its expert-parallel peers runs fillers (one padding token,
nothing trained). Before: the filler's token went through the routers' aux and z losses like a real one,
so the routers trained on padding. Here one micro-batch whose main loss is 0 runs once as a filler and
once as a real micro-batch (the control: the same token does move the routers), with and without
activation recomputation (the recomputed forward must know it is a filler's)."""

from __future__ import annotations

import json

import pytest

from tests.launch import run_torchrun


@pytest.fixture(scope="module")
def grads(tmp_path_factory, family_models):
    out = tmp_path_factory.mktemp("filler")
    proc = run_torchrun(["--standalone", "--nproc-per-node=1", "-m", "tests.backends.megatron.filler_jobs", str(out),
                         str(family_models("qwen3_moe"))], timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / "filler.json").read_text())


@pytest.mark.parametrize("recompute", [False, True])
def test_a_filler_adds_no_router_gradient(grads, recompute):
    assert grads[f"recompute={recompute},filler=False"] > 1e-6, grads     # the aux and z losses act on a real token
    assert grads[f"recompute={recompute},filler=True"] == 0.0, grads
