"""Routing replay through SGLang (no sglang needed): its return-routed-experts record, as the pinned
release sends it, becomes our per-token record of the sparse layers; the engine asks for it only
for MoE models."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from hybridrl.backends.model_spec import ModelSpec
from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.backends.sglang.convert import generation_output
from hybridrl.backends.sglang.engine import engine_kwargs
from hybridrl.rollout.protocol import GenerationTimings
from tests.backends.families import hf_config

SPEC = ModelSpec.from_hf_config(hf_config("qwen3_moe"))     # 3 layers, layers 0 and 2 sparse, top-2


def _response(prompt: int, output: list[int], ids: np.ndarray, encode=True) -> dict:
    meta = {"output_token_logprobs": [(-0.5, t, None) for t in output], "finish_reason": {"type": "length"},
            "routed_experts": base64.b64encode(ids.astype(np.int32).tobytes()).decode() if encode else ids.tolist()}
    return {"output_ids": output, "meta_info": meta}


@pytest.mark.parametrize("encode", [True, False])
def test_sglang_record_becomes_the_sparse_layers_rows(encode):
    prompt, output = 5, [11, 12, 13]
    ids = np.random.default_rng(0).integers(0, 8, size=(prompt + len(output) - 1, 3, 2))   # every hidden layer
    out = generation_output(_response(prompt, output, ids, encode), request_id="r", policy_version=3,
                            prompt_tokens=prompt, max_new_tokens=3, timings=GenerationTimings(), routing=SPEC)
    assert out.routed_experts.dtype == torch.int8 and tuple(out.routed_experts.shape) == (7, 2, 2)
    assert torch.equal(out.routed_experts.long(), torch.from_numpy(ids[:, [0, 2]]))


def test_a_record_of_the_wrong_length_is_refused():
    ids = np.zeros((4, 3, 2))
    with pytest.raises(ValueError, match="expected 7 tokens x 3 layers x top-2"):
        generation_output(_response(5, [1, 2, 3], ids), request_id="r", policy_version=0, prompt_tokens=5,
                          max_new_tokens=3, timings=GenerationTimings(), routing=SPEC)


def test_dense_models_neither_ask_nor_read():
    out = generation_output(_response(5, [1, 2, 3], np.zeros((7, 3, 2))), request_id="r", policy_version=0,
                            prompt_tokens=5, max_new_tokens=3, timings=GenerationTimings())
    assert out.routed_experts is None
    kwargs = dict(tp_size=1, base_gpu_id=0, port_offset=0, seed=0)
    assert "enable_return_routed_experts" not in engine_kwargs("m", SGLangConfig(), **kwargs)
    assert engine_kwargs("m", SGLangConfig(), routed_experts=True, **kwargs)["enable_return_routed_experts"] is True
