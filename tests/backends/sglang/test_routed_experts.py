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


# ------------------------------------------------------------------ each turn asks only for the new rows

def _true_rows(tokens) -> np.ndarray:
    """What a fake server routes position p to: a function of the tokens up to p (every hidden layer)."""
    return np.array([[[(sum(tokens[:p + 1]) * 7 + layer * 3 + k) % 8 for k in range(2)] for layer in range(3)]
                     for p in range(len(tokens) - 1)], dtype=np.int32).reshape(-1, 3, 2)


class _Server:
    """`sglang.Engine.async_generate` with routing records as sglang 0.5.21 returns them: the rows of
    positions [routed_experts_start_len, seqlen - 1)."""

    def __init__(self):
        self.starts, self.rows_sent = [], []

    async def async_generate(self, *, input_ids, sampling_params, return_logprob, rid, return_routed_experts=False,
                             routed_experts_start_len=0):
        assert return_routed_experts and 0 <= routed_experts_start_len <= len(input_ids)
        output = [(sum(input_ids) + i) % 50 + 20 for i in range(sampling_params["max_new_tokens"])]
        rows = _true_rows(input_ids + output)[routed_experts_start_len:]
        self.starts.append(routed_experts_start_len)
        self.rows_sent.append(len(rows))
        return _response(len(input_ids), output, rows)


def _engine(server):
    from hybridrl.backends.sglang.engine import SGLangEngine
    from hybridrl.backends.sglang.routing import RoutingMemory
    from hybridrl.rollout.versions import Publication

    engine = SGLangEngine.__new__(SGLangEngine)
    engine._engine, engine._routing, engine._routes = server, SPEC, RoutingMemory()
    engine._publication, engine._released, engine._paused = Publication({}, 1), set(), False
    engine._bound, engine._seed_warned, engine._in_flight, engine.eos_token_ids = True, True, set(), ()
    return engine


def _episode(engine, turns=3):
    import asyncio

    from hybridrl.data.trajectory import Trajectory
    from hybridrl.rollout.protocol import SamplingParams

    traj = Trajectory(run_id="r", task_id="t", group_id="g", attempt=0, prompt_ids=list(range(1, 21)))
    for turn in range(turns):
        out = asyncio.run(engine.generate(traj.prompt_ids + traj.response_ids, SamplingParams(max_new_tokens=6),
                                          f"r/t{turn}"))
        traj.append(out.token_ids, policy=True, logprobs=out.logprobs, version=out.policy_version,
                    routed_experts=out.routed_experts)
        traj.append([5, 6, 7, 8], policy=False)                       # the tool's observation
    return traj


def test_each_turn_asks_only_for_the_rows_after_the_last_turn_and_the_record_is_whole():
    server = _Server()
    traj = _episode(_engine(server))
    whole = traj.prompt_ids + traj.response_ids[:-4]                  # the last observation was never computed
    expected = torch.from_numpy(_true_rows(whole)[:, [0, 2]]).to(torch.int8)
    assert torch.equal(traj.routed_experts, expected)
    turn_ends = [20 + 6, 20 + 6 + 4 + 6, 20 + 6 + 4 + 6 + 4 + 6]     # prompt + output of each turn
    assert server.starts == [0, turn_ends[0] - 1, turn_ends[1] - 1]
    assert server.rows_sent == [turn_ends[0] - 1, turn_ends[1] - turn_ends[0], turn_ends[2] - turn_ends[1]]


def test_a_prompt_that_extends_nothing_remembered_gets_the_whole_record_and_the_memory_is_bounded():
    import asyncio

    from hybridrl.backends.sglang.routing import RoutingMemory
    from hybridrl.rollout.protocol import SamplingParams

    server = _Server()
    engine = _engine(server)
    _episode(engine, turns=1)
    assert len(engine._routes) == 1
    other = _engine(server)
    other._routes = engine._routes
    out = asyncio.run(other.generate(list(range(2, 30)), SamplingParams(max_new_tokens=3), "x"))   # another prefix
    assert server.starts[-1] == 0 and len(out.routed_experts) == 28 + 3 - 1
    memory = RoutingMemory(max_entries=1)
    memory.remember(list(range(20)), torch.zeros(19, 2, 2))
    memory.remember(list(range(1, 21)), torch.zeros(19, 2, 2))
    assert len(memory) == 1 and memory.lookup(list(range(25)))[0] == 0      # the oldest went first
    assert memory.lookup(list(range(1, 25)))[0] == 19
    memory.clear()
    assert memory.lookup(list(range(1, 25))) == (0, None, None)
