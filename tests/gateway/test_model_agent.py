"""The real OpenAI client as the agent of a real model: a tiny model that learned one multi-turn
conversation with a tool call (a few seconds of training here), served by the native engine behind the
gateway. The agent's tool call and answer come from the model; the trajectory is one rendering of the
conversation; the captured logprobs are those a trainer recomputes (transformers, float32) on it."""

from __future__ import annotations

import shutil

import pytest
import torch

from hybridrl.agent.config import AgentConfig
from hybridrl.data.trajectory import TrajectoryStatus, to_batch
from tests.gateway.helpers import gateway
from tests.gateway.test_openai_client import tool_agent

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
CONVERSATION = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "408"}, {"role": "assistant", "content": "<answer>408</answer>"}]


@pytest.fixture(scope="module")
def learned(tiny_models, tmp_path_factory):
    """A tiny model trained until greedy decoding says the conversation's assistant turns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.agent.chat import ChatFormat

    base = tiny_models("qwen2", init_std=0.05)
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids, mask = ChatFormat(tokenizer).conversation_ids(CONVERSATION)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    x = torch.tensor([ids])
    targets = torch.tensor(ids[1:])
    where = torch.tensor(mask[1:]).bool()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(600):
        logits = model(x).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits[where], targets[where])
        if step % 10 == 0 and bool((logits[where].argmax(-1) == targets[where]).all()) and loss < 0.5:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        pytest.fail("the tiny model did not learn the conversation")
    out = tmp_path_factory.mktemp("learned")
    for f in base.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    model.save_pretrained(out)
    return out, tokenizer


def test_the_client_drives_a_real_model_and_the_capture_is_what_a_trainer_recomputes(learned):
    from transformers import AutoModelForCausalLM

    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    from tests.gateway.helpers import run_agent

    model_dir, tokenizer = learned
    engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=8), device="cpu")
    try:
        trajs, _ = run_agent(engine, tokenizer, tool_agent, n=0, instances=["12 * 34"], group_size=2,
                             agent_cfg=AgentConfig(max_turns=4, max_new_tokens_per_turn=48, max_response_tokens=200,
                                                   temperature=0.0),
                             gateway_cfg=gateway(render_tools=False))
    finally:
        engine.close()
    for t in trajs:
        assert t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0, t.metadata
        assert t.turns == 2 and [c.name for c in t.tool_calls] == ["calculator"] and t.metadata["template_drift"] == 0
        conversation = [CONVERSATION[0], {"role": "assistant", "content": CALL}, {"role": "tool", "content": "408"},
                        {"role": "assistant", "content": "<answer>408</answer>"}]
        rendered = tokenizer.encode(tokenizer.apply_chat_template(conversation, tokenize=False),
                                    add_special_tokens=False)
        ids = t.prompt_ids + t.response_ids
        assert rendered[:len(ids)] == ids and tokenizer.decode(rendered[len(ids):]) == "\n"
        assert 0 in t.response_mask and t.versions == {0}
    batch = to_batch(trajs, pad_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].bool()
    got, want = batch["behavior_logprobs"][:, 1:][mask], logp[mask]
    assert got.numel() == sum(sum(t.response_mask) for t in trajs) and (want < -1e-3).any()   # not all certain
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
