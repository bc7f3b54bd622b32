"""The SGLang glue that needs no sglang: request parameters, response parsing, checkpoint spec."""

from __future__ import annotations

import pytest
import torch

from hybridrl.backends.sglang import convert
from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.config import ConfigValueError
from hybridrl.rollout.protocol import FinishReason, GenerationTimings, SamplingParams


def test_sampling_params_keep_stop_token_and_full_vocab_semantics():
    p = convert.sampling_params(SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, seed=3,
                                               stop_token_ids=(5,)), eos_token_ids=(2,))
    assert p["no_stop_trim"] is True and p["skip_special_tokens"] is False
    assert p["stop_token_ids"] == [2, 5] and p["top_k"] == -1 and p["sampling_seed"] == 3
    q = convert.sampling_params(SamplingParams(temperature=0.0, ignore_eos=True), eos_token_ids=(2,))
    assert q["stop_token_ids"] == [] and q["temperature"] == 0.0 and "sampling_seed" not in q


def _out(records, reason, output_ids=None):
    out = {"meta_info": {"output_token_logprobs": records, "finish_reason": reason, "cached_tokens": 4}}
    if output_ids is not None:
        out["output_ids"] = output_ids
    return out


def test_generation_output_from_logprob_records():
    out = convert.generation_output(
        _out([(-0.5, 11, None), (-1.25, 2, None)], {"type": "stop", "matched": 2}, [11, 2]),
        request_id="r1", policy_version=4, prompt_tokens=9, max_new_tokens=8, timings=GenerationTimings())
    assert out.token_ids == [11, 2] and out.logprobs == [-0.5, -1.25]
    assert out.finish_reason == FinishReason.STOP and out.policy_version == 4 and out.cached_prompt_tokens == 4
    length = convert.generation_output(_out([(-0.1, 3, None)] * 2, {"type": "length", "length": 2}),
                                       request_id="r", policy_version=1, prompt_tokens=1, max_new_tokens=2,
                                       timings=GenerationTimings())
    assert length.finish_reason == FinishReason.LENGTH
    ctx = convert.generation_output(_out([(-0.1, 3, None)], {"type": "length", "length": 1}),
                                    request_id="r", policy_version=1, prompt_tokens=1, max_new_tokens=2,
                                    timings=GenerationTimings())
    assert ctx.finish_reason == FinishReason.CONTEXT   # stopped by the context, not our budget
    with pytest.raises(ValueError, match="disagree"):
        convert.generation_output(_out([(-0.1, 3, None)], {"type": "stop"}, [3, 4]), request_id="r",
                                  policy_version=1, prompt_tokens=1, max_new_tokens=2, timings=GenerationTimings())
    assert convert.finish_reason({"finish_reason": {"type": "abort"}}, 0, 1) == FinishReason.ABORT


def test_checkpoint_spec_reads_headers(tiny_models):
    from hybridrl.backends.sglang.engine import checkpoint_spec

    spec = checkpoint_spec(tiny_models("qwen2"), torch.bfloat16)
    assert "model.layers.0.self_attn.q_proj.bias" in spec
    assert all(dtype == torch.bfloat16 for _, dtype in spec.values())


def test_config_validation():
    with pytest.raises(ConfigValueError):
        SGLangConfig(mem_fraction_static=1.5)
    assert SGLangConfig().load_format == "dummy"
