"""One vLLM engine per test module (its start-up is tens of seconds): `shared_engine(model_dir)`.

Tests that need an engine at version 0 on the checkpoint's weights get it through `reset`: the
checkpoint is published again (verified) and the engine's version tracker restarted at 0, with vLLM's
own weight-version label, so the shared engine looks freshly loaded to the next test.
"""

from __future__ import annotations

import os

import pytest

MODEL_SPEC = {"init_std": 0.1, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}   # head size 32


@pytest.fixture(scope="module")
def vllm_model(tiny_models):
    return tiny_models("qwen2", **MODEL_SPEC)


@pytest.fixture(scope="module")
def shared_engine(vllm_model):
    from hybridrl.backends.vllm.config import VLLMConfig
    from hybridrl.backends.vllm.engine import VLLMEngine

    # the tests send functions to vLLM's worker (collective_rpc with a callable: damage after a copy)
    old = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = VLLMEngine(vllm_model, VLLMConfig(kv_cache_mb=16, max_model_len=2048), seed=0)
    yield engine
    engine.close()
    if old is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = old


def reset(engine, model_dir):
    """The shared engine back on `model_dir`'s weights at version 0 (see the module doc)."""
    from hybridrl.publication.digest import tensor_digests
    from hybridrl.rollout.versions import Publication
    from tests.rollout.engine_contract import checkpoint_tensors, on_loop

    dtype = next(iter(engine.weight_spec().values()))[1]
    items = [(n, t) for n, t in checkpoint_tensors(model_dir, dtype, "cpu") if n in engine.weight_spec()]
    version = max(engine.policy_version, engine._publication.pending or 0) + 1
    on_loop(engine, engine.update_weights(items, version, digests=tensor_digests(items)))
    engine._publication = Publication(engine.weight_spec(), 0)
    engine._call(engine._llm.update_weight_version("0"))
    return engine
