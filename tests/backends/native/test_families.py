"""The native engine on Qwen3, Qwen3-MoE and llama3-scaled Llama built with transformers alone:
greedy ids and logprobs equal transformers (whole and chunked prefill), the MoE engine's routing
record equals transformers' own expert choice and survives prefix-cache hits, `hybridrl generate`
end to end."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from hybridrl.rollout.protocol import SamplingParams
from tests.backends.families import FAMILIES, hf_routing, load
from tests.backends.native.conftest import generate_all, hf_greedy, hf_logprobs, prompts_of

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_and_logprobs_equal_transformers(family, kernels, family_models, make_engine):
    path = family_models(family)
    model = load(path)
    engine = make_engine(path, max_num_batched_tokens=16, block_size=4, max_num_seqs=8,   # chunked prefill
                         kernels=kernels)
    prompts = prompts_of([3, 21, 40, 9], vocab=300, seed=1)
    outs = generate_all(engine, prompts, SamplingParams(max_new_tokens=20, temperature=0.0))
    expected = hf_greedy(model, prompts, 20, set(engine.eos_token_ids))
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.token_ids == ref
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs(model, prompt, out.token_ids),
                                   atol=1e-4, rtol=0)
    assert engine.stats()["kernels"] == kernels
    if family == "llama3":   # the scaling matters at these lengths: transformers without it is far off
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        lp = hf_logprobs(plain.eval(), prompts[2], outs[2].token_ids)
        assert float((lp - torch.tensor(outs[2].logprobs)).abs().max()) > 0.05


def test_moe_routing_record_is_transformers_choice_and_rides_the_prefix_cache(family_models, make_engine):
    path = family_models("qwen3_moe")
    model = load(path)
    engine = make_engine(path, max_num_batched_tokens=16, block_size=4, max_num_seqs=8)
    prompt = prompts_of([22], vocab=300, seed=2)[0]
    first = generate_all(engine, [prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    # a second request extends the first one's whole sequence: its prefix comes from the cache
    second_prompt = prompt + first.token_ids + [7, 8]
    second = generate_all(engine, [second_prompt], SamplingParams(max_new_tokens=6, temperature=0.9, seed=3),
                          tag="s")[0]
    assert second.cached_prompt_tokens >= 16
    for p, out in ((prompt, first), (second_prompt, second)):
        ids = torch.tensor(p + out.token_ids)
        record = out.routed_experts
        assert record.dtype == torch.int8
        assert tuple(record.shape) == (len(ids) - 1, 2, 2)          # every computed token, both sparse layers
        assert torch.equal(record.long().sort(dim=-1).values, hf_routing(model, ids[:-1]))
    assert torch.equal(second.routed_experts[: len(prompt) + len(first.token_ids) - 1], first.routed_experts)


def test_moe_weight_spec_is_the_checkpoint(family_models, make_engine):
    path = family_models("qwen3_moe")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = {n: (tuple(f.get_slice(n).get_shape()), torch.float32) for n in f.keys()}
    assert make_engine(path).weight_spec() == saved
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in saved and "model.layers.1.mlp.gate.weight" not in saved


def test_generate_cli_on_a_moe_model(family_models, tmp_path):
    from hybridrl.cli import main

    path = family_models("qwen3_moe")
    prompts = prompts_of([5, 14], vocab=300, seed=4)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "token_ids": p}) + "\n" for i, p in enumerate(prompts)))
    assert main(["generate", "--model", str(path), "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--greedy", "--max-new-tokens", "10", "rollout.native.kv_cache_mb=8"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model = load(path)
    expected = hf_greedy(model, prompts, 10, {2})
    for prompt, row, ref in zip(prompts, rows, expected):
        assert row["token_ids"] == ref
        torch.testing.assert_close(torch.tensor(row["logprobs"]), hf_logprobs(model, prompt, ref), atol=1e-4, rtol=0)


def test_a_two_turn_episode_carries_the_routing_of_every_token_but_the_last(family_models, make_engine):
    """Turn 1, an observation, turn 2 (whose context is the whole episode so far), as the agent loop
    builds it: the trajectory's record covers every token but the last, turn 1's positions keep turn
    1's record, and it survives to_batch -> from_batch."""
    from hybridrl.data.trajectory import Trajectory, from_batch, to_batch

    path = family_models("qwen3_moe")
    model = load(path)
    engine = make_engine(path, block_size=4)
    prompt = prompts_of([9], vocab=300, seed=6)[0]
    traj = Trajectory(run_id="r", task_id="t", group_id="g", attempt=0, prompt_ids=prompt)
    first = generate_all(engine, [prompt], SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))[0]
    traj.append(first.token_ids, policy=True, logprobs=first.logprobs, version=0, routed_experts=first.routed_experts)
    traj.append([17, 18, 19], policy=False)                                       # the tool's answer
    second = generate_all(engine, [traj.prompt_ids + traj.response_ids],
                          SamplingParams(max_new_tokens=4, temperature=1.0, seed=2), tag="t2")[0]
    traj.append(second.token_ids, policy=True, logprobs=second.logprobs, version=0,
                routed_experts=second.routed_experts)
    ids = torch.tensor(traj.prompt_ids + traj.response_ids)
    assert len(traj.routed_experts) == len(ids) - 1
    assert torch.equal(traj.routed_experts[: len(first.routed_experts)], first.routed_experts)
    assert torch.equal(traj.routed_experts.long().sort(dim=-1).values, hf_routing(model, ids[:-1]))
    batch = to_batch([traj, Trajectory(run_id="r", task_id="t", group_id="g", attempt=1, prompt_ids=[5, 6])])
    assert batch["routed_experts"].shape == (2, len(ids), 2, 2) and batch["routed_experts"].dtype == torch.int8
    assert bool((batch["routed_experts"][0, -1] == -1).all()) and bool((batch["routed_experts"][1] == -1).all())
    back = from_batch(batch)
    assert torch.equal(back[0].routed_experts, traj.routed_experts) and len(back[1].routed_experts) == 0
