"""The replica pool with real replica processes (each a subprocess running `hybridrl replica`): a replica
SIGKILLed while it generates loses none of its requests (the other replica goes on from the tokens each had
streamed back: the same tokens as an uninterrupted request), and a replica started afterwards joins at the
next publication, receives that whole version, then serves."""

from __future__ import annotations

import asyncio
import re
import signal

import pytest
import torch

from hybridrl.backends.replicas.config import ReplicasConfig
from hybridrl.backends.replicas.engine import ReplicasEngine
from hybridrl.publication.digest import tensor_digests
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.replicas.replica_procs import start_replica

NUM_REQUESTS = 6
NEW_TOKENS = 24
KILL_AFTER = 5              # tokens a request of the doomed replica (its 2nd on) streams back before it dies


def _weights(model_dir, shift: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    loaded = load_file(str(model_dir / "model.safetensors"))
    return [(name, loaded[name].float() + shift) for name in sorted(loaded)]


def _publish(engine: ReplicasEngine, weights, version: int) -> None:
    """Two buckets with the sender's digests, as the publisher sends them."""
    digests = tensor_digests(weights)
    half = len(weights) // 2

    async def go():
        for part in (weights[:half], weights[half:]):
            await engine.update_weights(part, version, digests={n: digests[n] for n, _ in part})

    asyncio.run(go())


def _generate(engine: ReplicasEngine, tag: str) -> list:
    """Sampled (temperature 1), each request with its own seed: the same seeds whatever the tag."""
    async def go():
        return await asyncio.gather(*[engine.generate([3, 5, 7 + i], SamplingParams(
            max_new_tokens=NEW_TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True), f"{tag}-{i}")
            for i in range(NUM_REQUESTS)])

    return asyncio.run(go())


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_models):
    """Two replicas, the second killing itself (SIGKILL) once one of its requests (the 2nd on) streamed KILL_AFTER
    tokens back, and a client over them that published v0; after the first requests, a third replica joins at v1."""
    base = tmp_path_factory.mktemp("replicas")
    model, registry = tiny_models("llama"), base / "registry"
    survivor = start_replica(model, registry, base / "a.log")
    doomed = start_replica(model, registry, base / "b.log", "--kill-at-request", "2",
                           "--kill-after-tokens", str(KILL_AFTER))
    procs = [survivor, doomed]
    try:
        for p in procs:
            p.wait_registered()
        engine = ReplicasEngine(ReplicasConfig(registry=str(registry), min_live=2, wait_s=30), registry=registry,
                                model=str(model))
        assert engine.policy_version == -1          # nothing serves before this trainer published
        _publish(engine, _weights(model), 0)
        first = _generate(engine, "first")
        doomed.proc.wait(timeout=60)
        after_loss = dict(engine.stats())
        reference = _generate(engine, "again")      # the same prompts on the survivor alone
        late = start_replica(model, registry, base / "c.log")
        procs.append(late)
        late.wait_registered()
        served_before_joining = late.info()["served"]
        _publish(engine, _weights(model, shift=0.01), 1)
        joined = _generate(engine, "joined")
        yield {"engine": engine, "first": first, "reference": reference, "after_loss": after_loss,
               "doomed": doomed, "late": late, "survivor": survivor, "joined": joined,
               "served_before_joining": served_before_joining}
    finally:
        for p in procs:
            p.stop()


def test_a_replica_killed_mid_request_loses_no_request_and_no_token_it_streamed(pool):
    assert pool["doomed"].proc.returncode == -signal.SIGKILL
    assert re.search(r"request [23] \(\S+\) streamed \d+ tokens: killing myself", pool["doomed"].log.read_text())
    stats = pool["after_loss"]
    assert stats["replicas_lost"] == 1 and stats["replicas_live"] == 1 and stats["requests_resubmitted"] >= 1
    assert stats["requests"] == NUM_REQUESTS
    # the survivor went on from what the doomed replica had streamed: the dying request's KILL_AFTER tokens at least
    assert KILL_AFTER <= stats["tokens_resumed"] < stats["requests_resubmitted"] * NEW_TOKENS
    for out, ref in zip(pool["first"], pool["reference"]):
        assert out.policy_version == 0 and out.version_starts == () and len(out.token_ids) == NEW_TOKENS
        assert out.token_ids == ref.token_ids        # the same answer, wherever it ran (batch composition moves
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)   # a logprob's last bits)


def test_a_replacement_joins_at_the_next_publication_and_serves_that_version(pool):
    late = pool["late"]
    assert pool["served_before_joining"] == 0              # registered, but not used before it held a version
    info = late.info()
    assert info["policy_version"] == 1 and info["served"] > 0 and set(info["versions_served"]) == {"1"}
    assert "received policy version 1 from the trainer" in late.log.read_text()
    assert "received policy version 0" not in late.log.read_text()
    engine = pool["engine"]
    assert engine.policy_version == 1 and len(engine.live) == 2 and engine.stats()["replicas_joined"] == 3
    assert all(o.policy_version == 1 for o in pool["joined"])
    assert pool["survivor"].info()["versions_served"]["1"] > 0        # both served v1's requests
    # the same prompts as before the publication: v1's weights answer them, not v0's
    assert all(o.logprobs != r.logprobs for o, r in zip(pool["joined"], pool["reference"]))


def test_only_rank_0_uploads_and_the_other_ranks_take_its_word(pool, tiny_models):
    """Two clients of one job (two trainer ranks) publish v2 at once: only rank 0's uploads (each replica
    receives the version's bytes once, not twice); rank 1's waits for its word (`.published.json`), takes
    the replicas it names and serves v2 from them. A word left by another job is not taken."""
    from hybridrl.backends.replicas import handoff

    registry = pool["late"].registry
    cfg = ReplicasConfig(registry=str(registry), min_live=2, wait_s=30)
    rank0 = ReplicasEngine(cfg, registry=registry, uploads=True, job="job-a")
    rank1 = ReplicasEngine(cfg, registry=registry, uploads=False, job="job-a")
    stranger = ReplicasEngine(ReplicasConfig(registry=str(registry), wait_s=0, request_timeout_s=0.3),
                              registry=registry, uploads=False, job="job-b")
    weights = _weights(tiny_models("llama"), shift=0.03)
    before = [p.info()["weight_bytes"] for p in (pool["survivor"], pool["late"])]

    async def both():
        digests = tensor_digests(weights)
        half = len(weights) // 2

        async def publish(engine):
            for part in (weights[:half], weights[half:]):
                await engine.update_weights(part, 2, digests={n: digests[n] for n, _ in part})
        await asyncio.gather(publish(rank1), publish(rank0))           # rank 1 gets there first

    asyncio.run(both())
    received = [p.info()["weight_bytes"] - b for p, b in zip((pool["survivor"], pool["late"]), before)]
    model_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    assert all(model_bytes <= r < 1.5 * model_bytes for r in received), (received, model_bytes)
    assert rank0.policy_version == rank1.policy_version == 2 and len(rank1.live) == 2
    said = handoff.read_published(registry)
    assert said["job"] == "job-a" and said["version"] == 2 and len(said["replicas"]) == 2
    outs = [_generate(e, f"rank{i}") for i, e in enumerate((rank0, rank1))]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(o.policy_version == 2 for o in outs[1])
    with pytest.raises(RuntimeError, match=r"publication v2: the uploading rank \(rank 0\) did not say it "
                                           r"published it .* within 0.3 s"):
        asyncio.run(stranger.update_weights(weights, 2))


def test_no_replica_left_names_what_to_start(tmp_path):
    with pytest.raises(RuntimeError, match=r"no rollout replica is live .*python -m hybridrl replica --model M "
                                           r"--registry"):
        ReplicasEngine(ReplicasConfig(registry=str(tmp_path), wait_s=0), registry=tmp_path, model="M")


@pytest.mark.slow                 # waits out a 5 s request timeout
def test_two_clients_share_the_pool_and_a_hung_replica_is_lost_after_the_request_timeout(pool, tiny_models):
    """Two clients (two trainer ranks) publish the same version to the pool and send the same request ids at
    once: each gets its own answers. Then a replica that stops answering without closing its connections
    (SIGSTOP) is lost once a request waited request_timeout_s on it; its requests go to the other replica."""
    late, survivor, first = pool["late"], pool["survivor"], pool["engine"]
    registry = late.registry
    engine = ReplicasEngine(ReplicasConfig(registry=str(registry), min_live=2, wait_s=30, request_timeout_s=5),
                            registry=registry)
    weights = _weights(tiny_models("llama"), shift=0.02)
    _publish(first, weights, 2)
    _publish(engine, weights, 2)
    sampled = SamplingParams(max_new_tokens=6, ignore_eos=True)           # no seed: drawn from the request id

    async def both():
        return await asyncio.gather(*[e.generate([3, 5, 7], sampled, f"same-{i}") for e in (first, engine)
                                      for i in range(NUM_REQUESTS)])

    outs = asyncio.run(both())
    assert [o.request_id for o in outs] == [f"same-{i}" for i in range(NUM_REQUESTS)] * 2
    assert [o.token_ids for o in outs[:NUM_REQUESTS]] == [o.token_ids for o in outs[NUM_REQUESTS:]]
    late.proc.send_signal(signal.SIGSTOP)
    try:
        outs = _generate(engine, "hung")
    finally:
        late.proc.send_signal(signal.SIGCONT)
    assert [o.policy_version for o in outs] == [2] * NUM_REQUESTS
    assert engine.stats()["replicas_lost"] == 1 and late.wait_registered()["instance"] in engine.lost
    assert "no answer to /generate within 5 s" in engine.lost[late.wait_registered()["instance"]]
    assert survivor.wait_registered()["instance"] in engine.live


def test_a_trainer_started_again_publishes_from_an_earlier_version(pool, tiny_models):
    """A trainer resumed from an earlier checkpoint while the replicas lived on: a new client publishes v0 to
    replicas holding v1 or v2 (the tests before published them), and they take it (and serve v0's weights again)."""
    registry = pool["survivor"].registry
    engine = ReplicasEngine(ReplicasConfig(registry=str(registry), min_live=2, wait_s=30), registry=registry)
    _publish(engine, _weights(tiny_models("llama")), 0)
    again = _generate(engine, "resumed")
    assert engine.policy_version == 0 and all(o.policy_version == 0 for o in again)
    assert [o.token_ids for o in again] == [o.token_ids for o in pool["reference"]]
    for replica in (pool["survivor"], pool["late"]):
        assert re.search(r"a new trainer publishes v0, older than the v[12] held", replica.log.read_text())
        assert replica.info()["policy_version"] == 0
