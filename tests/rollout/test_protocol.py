"""The rollout protocol's own types: sampling parameter validation and the contract's version."""

from __future__ import annotations

import pytest

from hybridrl.rollout.protocol import (
    SAMPLER_CONTRACT,
    SAMPLER_CONTRACT_VERSION,
    FinishReason,
    GenerationOutput,
    SamplingParams,
)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_k": 0}, "top_k must be -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_greedy_flag_and_defaults():
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    out = GenerationOutput(request_id="r", token_ids=[1], logprobs=[-0.5], finish_reason=FinishReason.STOP,
                           policy_version=3)
    assert out.sampler_contract == SAMPLER_CONTRACT_VERSION
    assert f"v{SAMPLER_CONTRACT_VERSION}" in SAMPLER_CONTRACT
    assert FinishReason("weights_updated") is FinishReason.WEIGHTS_UPDATED
