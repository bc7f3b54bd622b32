"""Publishing into the native engine in this process: flat buckets land with one copy per run, the
engine verifies its own storage after the copy, and a corrupted copy is caught (never served)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.backends.megatron.adapters import adapter_for
from hybridrl.backends.model_spec import ModelSpec
from hybridrl.publication.buckets import Staging
from hybridrl.publication.config import PublishConfig
from hybridrl.publication.manifest import PublicationError, PublicationRefused
from hybridrl.publication.publish import TensorGroups, publish
from hybridrl.publication.transport_inprocess import InProcessTransport
from hybridrl.rollout.protocol import SamplingParams

TARGET = "model.layers.1.self_attn.k_proj.weight"
HASHES = {"model_config_hash": "m", "tokenizer_hash": "t", "chat_template_hash": "c"}


def source_groups(model_dir, scale: float) -> TensorGroups:
    """The model's tensors (+ seeded noise) in fused groups, in model order, as Megatron yields them."""
    hf = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    adapter = adapter_for(ModelSpec.from_dir(model_dir), tp=1)
    return TensorGroups([[(n, hf[n] + scale * torch.randn(hf[n].shape, generator=g)) for n in slot.hf_names]
                         for slot in adapter.slots() if slot.exported])


def corrupt_after_copy(engine, name: str, times: float) -> dict:
    """The engine's storage of `name` is damaged right after the engine copied it (`times` times)."""
    core, state = engine.core, {"left": times, "copies": 0}
    real = core.copy_into_storage

    def faulty(items):
        real(items)
        state["copies"] += 1
        if any(n == name for n, _ in items) and state["left"] > 0:
            core.views[name].view(-1)[3] += 1.0
            state["left"] -= 1

    core.copy_into_storage = faulty
    return state


def run_publish(engine, source, version, **cfg):
    return asyncio.run(publish(source, engine=engine, transport=InProcessTransport(engine),
                               cfg=PublishConfig(**cfg), version=version, step=version, hashes=HASHES,
                               staging=Staging("cpu")))


@pytest.fixture
def setup(tiny_models):
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    model_dir = tiny_models("qwen2", init_std=0.1)
    engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=4, driver="loop"))
    yield engine, model_dir
    engine.close()


def test_flat_buckets_land_in_place_verified(setup):
    engine, model_dir = setup
    source = source_groups(model_dir, 0.05)
    state = corrupt_after_copy(engine, TARGET, times=0)       # only counts the copies
    release, stats = run_publish(engine, source, 1, bucket_mb=1)
    assert engine.policy_version == 1 and release.ready and stats.retries == 0
    assert stats.num_buckets == state["copies"] >= 1
    views = asyncio.run(engine.run_in_engine(lambda core: {n: v.clone() for n, v in core.views.items()}))
    for group in source.groups:
        for name, t in group:
            assert torch.equal(views[name], t), name
    assert release.tensor_hashes.keys() == views.keys()
    # one copy per bucket: a bucket's tensors lie back to back in the engine's flat storage too
    from hybridrl.backends.native.core import _runs
    from hybridrl.publication.buckets import plan_buckets

    plan = plan_buckets(source.hf_group_specs(), 1 << 30)[0]
    bucket = Staging("cpu").bucket(plan, 0)
    assert len(_runs([(engine.core.views[n], t) for n, t in bucket.named()])) == 1


def test_a_corrupted_copy_is_copied_again_then_fails_naming_the_tensor(setup):
    engine, model_dir = setup
    source = source_groups(model_dir, 0.05)
    corrupt_after_copy(engine, TARGET, times=1)               # a one-off fault: the retry repairs it
    release, stats = run_publish(engine, source, 1, bucket_mb=1)
    assert engine.policy_version == 1 and stats.retries == 1
    view = asyncio.run(engine.run_in_engine(lambda core: core.views[TARGET].clone()))
    assert torch.equal(view, next(t for g in source.groups for n, t in g if n == TARGET))

    corrupt_after_copy(engine, TARGET, times=math.inf)        # a fault on every copy of that tensor
    with pytest.raises(PublicationError, match=TARGET) as info:
        run_publish(engine, source_groups(model_dir, 0.1), 2, bucket_mb=1)
    assert "twice" in str(info.value)
    assert engine.policy_version == 1                         # never switched to unverified weights
    assert engine.stats()["pending_version"] == 2 and engine.stats()["weight_tensors_mismatched"] == 3

    async def nothing_is_served():
        task = asyncio.create_task(engine.generate([3, 4, 5], SamplingParams(max_new_tokens=2), "blocked"))
        await asyncio.sleep(0.2)
        assert not task.done()                                # the half-updated model serves nothing
        task.cancel()

    asyncio.run(nothing_is_served())


def test_structure_mode_does_not_read_back_and_a_mismatched_model_is_refused(setup):
    engine, model_dir = setup
    corrupt_after_copy(engine, TARGET, times=math.inf)
    run_publish(engine, source_groups(model_dir, 0.05), 1, verify="structure")
    assert engine.policy_version == 1                         # structure mode cannot see a content fault
    bad = source_groups(model_dir, 0.05)
    bad.groups[0] = [(n, t[:-1]) for n, t in bad.groups[0]]
    with pytest.raises(PublicationRefused, match="has shape"):
        run_publish(engine, bad, 2)
    assert engine.policy_version == 1 and engine.stats()["pending_version"] is None


def test_the_parity_probe_checks_a_process_first_publication_and_every_nth_version():
    """`publish.parity_every`: the sender and every receiver decide from the version alone, so they agree."""
    from hybridrl.publication.parity import ProbeSchedule

    resumed = ProbeSchedule(3)                     # a run resumed at version 5: its first publication is checked
    assert [v for v in range(5, 13) if resumed.due(v)] == [5, 6, 9, 12]
    every = ProbeSchedule(1)
    assert all(every.due(v) for v in range(1, 6))


def test_an_asleep_engine_is_written_in_place_in_structure_mode_with_the_copy_paths_manifest(setup):
    """structure mode into an asleep native engine: the source writes into the engine's own storage (no
    bucket copied), the manifest is the one a copy through buckets makes of the same weights, and the
    engine serves them once awake. post_copy never writes in place (its check would read what it wrote)."""
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    engine, model_dir = setup
    source = source_groups(model_dir, 0.05)
    asyncio.run(engine.sleep())
    release, stats = run_publish(engine, source, 1, bucket_mb=1, verify="structure")
    counters = engine.stats()
    assert stats.in_place and stats.num_buckets >= 1 and engine.policy_version == 1
    assert counters["weight_tensors_copied"] == 0
    assert counters["weight_tensors_in_place"] == len(engine.weight_spec())
    views = asyncio.run(engine.run_in_engine(lambda core: {n: v.clone() for n, v in core.views.items()}))
    for group in source.groups:
        for name, t in group:
            assert torch.equal(views[name], t), name

    # the same weights through buckets into a second engine (awake: it takes copies) make the same manifest
    other = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=4, driver="loop"))
    try:
        copied, copy_stats = run_publish(other, source, 1, bucket_mb=1, verify="structure")
        assert not copy_stats.in_place and other.stats()["weight_tensors_copied"] == len(other.weight_spec())
        assert copied.checkpoint_hash == release.checkpoint_hash
        assert copied.tensor_hashes == release.tensor_hashes
    finally:
        other.close()

    asyncio.run(engine.wake_up())
    out = asyncio.run(engine.generate([3, 4, 5], SamplingParams(max_new_tokens=2), "served"))
    assert out.policy_version == 1 and len(out.token_ids) == 2

    asyncio.run(engine.sleep())                               # post_copy: copied from buckets, read back
    _, verified = run_publish(engine, source_groups(model_dir, 0.1), 2, bucket_mb=1, verify="post_copy")
    assert not verified.in_place and engine.stats()["weight_tensors_copied"] == len(engine.weight_spec())


def test_an_awake_engine_offers_no_storage_and_refuses_an_in_place_commit(setup):
    engine, model_dir = setup
    names = list(engine.weight_spec())[:2]
    assert engine.writable_views(names) is None               # awake: requests may be reading the weights
    with pytest.raises(RuntimeError, match="asleep"):
        asyncio.run(engine.commit_in_place(names, 1))
    asyncio.run(engine.sleep())
    unknown = "model.layers.99.mlp.up_proj.weight"
    assert engine.writable_views(names + [unknown]) is None   # not a tensor it holds
    with pytest.raises(ValueError, match="layers.99"):
        asyncio.run(engine.commit_in_place([unknown], 1))
    views = engine.writable_views(names)
    assert views is not None
    assert all(v.data_ptr() == engine.core.views[n].data_ptr() for n, v in views.items())
    asyncio.run(engine.commit_in_place(names, 1))             # two tensors of many: the version waits
    assert engine.policy_version == 0 and engine.stats()["pending_version"] == 1
