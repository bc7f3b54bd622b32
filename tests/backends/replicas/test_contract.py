"""The replicas engine against the shared rollout-engine contract (tests/rollout/engine_contract.py): every
answer crosses HTTP from a real replica process (a subprocess). Each test gets a fresh replica (a replica's versions only
grow), and the client publishes the model directory's weights as v0 first: it serves nothing it did not
publish."""

from __future__ import annotations

import asyncio

import pytest

from hybridrl.backends.replicas.config import ReplicasConfig
from hybridrl.backends.replicas.engine import ReplicasEngine
from hybridrl.publication.digest import tensor_digests
from hybridrl.rollout.protocol import FinishReason, SamplingParams
from tests.backends.native.conftest import prompts_of
from tests.backends.replicas.replica_procs import start_replica
from tests.rollout.engine_contract import EngineContract, checkpoint_tensors, on_loop, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]     # a replica process per test: ~5 s each


@pytest.fixture
def make_engine(tmp_path):
    made: list = []

    def make(model_dir) -> ReplicasEngine:
        replica = start_replica(model_dir, tmp_path / "registry", tmp_path / "replica.log")
        made.append(replica)
        replica.wait_registered()
        engine = ReplicasEngine(ReplicasConfig(registry=str(tmp_path / "registry")), registry=tmp_path / "registry")
        made.append(engine)
        assert engine.policy_version == -1
        weights = checkpoint_tensors(model_dir, next(iter(engine.weight_spec().values()))[1], "cpu")
        on_loop(engine, engine.update_weights(weights, 0, digests=tensor_digests(weights)))
        return engine

    yield make
    for thing in made:
        if isinstance(thing, ReplicasEngine):
            thing.close()
        else:
            thing.stop()


class TestReplicasContract(EngineContract):
    def test_sleep_aborts_what_runs_and_wake_up_serves_the_same(self, make_engine, model_dir):
        """The replicas hold none of the trainer's memory: nothing to release (and it says so); `sleep(())`
        still ends the requests in flight with ABORT, and it serves the same afterwards."""
        engine = make_engine(model_dir)
        assert engine.releasable_tags == frozenset()
        with pytest.raises(ValueError, match="cannot release \\['kv_cache'\\]"):
            on_loop(engine, engine.sleep())
        prompt = prompts_of([12], seed=5)[0]
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        before = run(engine, [prompt], greedy)[0]

        async def sleep_during_a_request():
            task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=1500, ignore_eos=True),
                                                       "long"))
            await asyncio.sleep(0.5)
            await engine.sleep(())
            return await task

        aborted = on_loop(engine, sleep_during_a_request())
        assert aborted.finish_reason == FinishReason.ABORT and len(aborted.token_ids) < 1500
        on_loop(engine, engine.wake_up(()))
        assert run(engine, [prompt], greedy, tag="again")[0].token_ids == before.token_ids
