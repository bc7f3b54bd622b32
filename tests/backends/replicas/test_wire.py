"""What crosses HTTP between the client and a replica reads back bit for bit: a bucket's views of one flat
buffer (bfloat16 and float32) with the version, digests and client; an output with a mixture-of-experts
routing record, per-token version starts and logprobs; the tokens a lost replica streamed, with their versions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.backends.replicas import wire
from hybridrl.rollout.protocol import FinishReason, GenerationOutput, GenerationTimings, SamplingParams


def test_a_bucket_of_views_of_one_buffer_reads_back_bit_for_bit():
    flat = torch.randn(64).to(torch.bfloat16)
    named = [("a.weight", flat[:24].view(4, 6)), ("b.weight", flat[24:40]),
             ("c.weight", torch.randn(3, 5, dtype=torch.float32))]
    payload = wire.weights_payload(named, 7, {"a.weight": "d1", "b.weight": "d2", "c.weight": "d3"}, client="x1")
    back, version, digests, client = wire.read_weights(payload)
    assert (version, digests, client) == (7, {"a.weight": "d1", "b.weight": "d2", "c.weight": "d3"}, "x1")
    assert [n for n, _ in back] == ["a.weight", "b.weight", "c.weight"]
    for (_, sent), (_, got) in zip(named, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.contiguous().view(-1).view(torch.uint8), sent.contiguous().view(-1).view(torch.uint8))
    assert wire.read_weights(wire.weights_payload(named[:1], 0, None))[2] is None


def test_an_output_and_its_sampling_read_back_the_same():
    out = GenerationOutput(request_id="r/1", token_ids=[5, 9, 2], logprobs=[-0.1234567890123, -2.5, -1e-9],
                           finish_reason=FinishReason.STOP, policy_version=3, prompt_tokens=11, cached_prompt_tokens=4,
                           timings=GenerationTimings(0.1, 0.2, 0.3), version_starts=((2, 4),),
                           routed_experts=torch.randint(0, 8, (13, 2, 2), dtype=torch.int8))
    back = wire.output_from_json(wire.output_to_json(out))
    assert torch.equal(back.routed_experts, out.routed_experts)
    assert dataclasses.replace(back, routed_experts=None) == dataclasses.replace(out, routed_experts=None)
    assert back.versions == [3, 3, 4]
    sampling = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=12, stop_token_ids=(3, 4))
    assert wire.sampling_from_json(wire.sampling_to_json(sampling)) == sampling


def test_saved_tokens_keep_the_versions_of_every_replica_that_generated_them():
    """A request streamed 5 tokens on a replica whose update landed at index 3 (v1, then v2), was lost, and
    another replica at v2 (an update landing at its index 8: v3) went on from the 5: one output, each token
    labelled with the version that sampled it, the saved logprobs kept."""
    from hybridrl.backends.replicas.engine import ReplicaLost, Saved

    saved = Saved()
    saved.add({"start": 0, "token_ids": [4, 5], "logprobs": [-0.1, -0.2], "policy_version": 1, "version_starts": []})
    saved.add({"start": 2, "token_ids": [6, 7, 8], "logprobs": [-0.3, -0.4, -0.5], "policy_version": 1,
               "version_starts": [[3, 2]]})
    with pytest.raises(ReplicaLost, match="from index 4, 5 were saved"):
        saved.add({"start": 4, "token_ids": [9], "logprobs": [-1.0], "policy_version": 1, "version_starts": []})
    out = GenerationOutput(request_id="r", token_ids=[4, 5, 6, 7, 8, 9, 10, 11, 12], logprobs=[-9.0] * 9,
                           finish_reason=FinishReason.LENGTH, policy_version=2, version_starts=((8, 3),))
    whole = saved.before(out)
    assert whole.policy_version == 1 and whole.version_starts == ((3, 2), (8, 3))
    assert whole.versions == [1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert whole.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -9.0, -9.0, -9.0, -9.0]
    with pytest.raises(RuntimeError, match="answered other ones in their place"):
        Saved([4, 5], [-0.1, -0.2], 1).before(dataclasses.replace(out, token_ids=[4, 6, 6, 7]))
