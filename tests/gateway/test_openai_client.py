"""The real `openai` client (AsyncOpenAI, the PyPI package) as the agent, through the gateway on a scripted
engine: multi-turn tool calls with exact tokens and logprobs, streaming, budgets, keys, the endpoints."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.testing import ScriptedEngine, calculator_oracle, scripted_logprob
from hybridrl.data.trajectory import TrajectoryStatus, Truncation
from hybridrl.gateway import Outcome, call_tool, is_budget_error
from tests.gateway.helpers import cfg, gateway, run_agent

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def answer_of(text):
    return text.split("<answer>")[-1].split("</answer>")[0] if text and "<answer>" in text else None


async def tool_agent(client, instance):
    """Asks, runs every tool call, sends the results back as tool messages, until an answer."""
    messages = [dict(m) for m in instance.messages]
    while True:
        reply = await client.chat.completions.create(model="anything", messages=messages, tools=[CALCULATOR],
                                                     logprobs=True)
        message = reply.choices[0].message
        if not message.tool_calls:
            return Outcome(answer=answer_of(message.content), metadata={"finish": reply.choices[0].finish_reason})
        assert reply.choices[0].finish_reason == "tool_calls"
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = await call_tool(call.function.name, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def test_multi_turn_tool_calls_are_token_exact(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=2, call_format="json"))
    trajs, runner = run_agent(engine, tiny_tokenizer, tool_agent, n=3)
    for t in trajs:
        assert t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0, t.metadata
        assert t.turns == 3 and [c.name for c in t.tool_calls] == ["calculator", "calculator"]
        assert t.metadata["template_drift"] == 0 and t.metadata["token_drift"] == 0
        # the trajectory is one tokenization of the final conversation (the template is append-only)
        conversation = [dict(m) for m in _instance(t).messages]
        requests = [r for r in engine.requests if r.request_id.startswith(t.trajectory_id + "/")]
        for r in requests:
            conversation.append({"role": "assistant", "content": tiny_tokenizer.decode(r.output.token_ids[:-1])})
            if r is not requests[-1]:
                conversation.append({"role": "tool", "content": answer_value(conversation)})
        rendered = tiny_tokenizer.apply_chat_template(conversation, tools=[CALCULATOR], tokenize=False)
        ids = t.prompt_ids + t.response_ids
        assert tiny_tokenizer.encode(rendered, add_special_tokens=False)[:len(ids)] == ids
        # each request's context is the previous context + completion + the tool message's tokens
        for earlier, later in zip(requests, requests[1:]):
            assert later.input_ids[:len(earlier.input_ids) + len(earlier.output.token_ids)] == \
                earlier.input_ids + earlier.output.token_ids
        # logprobs and versions: exactly what the engine returned, on the generated ids only
        start = len(t.prompt_ids)
        for i, (tok, m, lp, v) in enumerate(zip(t.response_ids, t.response_mask, t.behavior_logprobs,
                                                t.policy_versions)):
            assert (lp, v) == ((scripted_logprob(start + i, tok), 0) if m else (0.0, -1))
        assert sum(t.response_mask) == sum(len(r.output.token_ids) for r in requests)
    assert runner.counts["tool_calls"] == 6 and runner.counts["agent_errors"] == 0


def _instance(t):
    from hybridrl.envs.tasks import get_task

    return next(i for i in get_task("calculator").validation_split(3) if i.task_id == t.task_id)


def answer_value(conversation):
    from hybridrl.envs.arithmetic import evaluate, format_value

    return format_value(evaluate(conversation[0]["content"][len("What is "):-1]))


async def streaming_agent(client, instance):
    messages = [dict(m) for m in instance.messages]
    while True:
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                      stream=True, stream_options={"include_usage": True})
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                finish = choice.finish_reason or finish
        assert usage is not None and usage.completion_tokens > 0
        if not calls:
            return Outcome(answer=answer_of(content), metadata={"finish": finish})
        assert finish == "tool_calls"
        messages.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()]})
        for c in calls.values():
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": await call_tool(c["name"], json.loads(c["arguments"]))})


def test_streaming_works_with_the_openai_client(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=1, call_format="json"))
    streamed, runner = run_agent(engine, tiny_tokenizer, streaming_agent, n=2)
    plain, _ = run_agent(ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=1, call_format="json")),
                         tiny_tokenizer, tool_agent, n=2)
    assert runner.service.counts["streamed"] == 4
    for s, p in zip(streamed, plain):
        assert s.status == TrajectoryStatus.COMPLETED and s.reward == 1.0 and s.metadata["agent"]["finish"] == "stop"
        assert s.prompt_ids + s.response_ids == p.prompt_ids + p.response_ids and s.metadata["template_drift"] == 0


async def greedy_caller(client, instance):
    """Keeps calling the tool and never answers: the budgets end it."""
    messages = [dict(m) for m in instance.messages]
    while True:
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except openai.BadRequestError as err:
            assert is_budget_error(err)
            return Outcome(metadata={"refused": err.code})
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "1"})


def test_a_request_past_max_turns_is_refused_and_the_episode_truncated(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=99, call_format="json"))
    trajs, runner = run_agent(engine, tiny_tokenizer, greedy_caller, agent_cfg=cfg(max_turns=2))
    for t in trajs:
        assert t.status == TrajectoryStatus.TRUNCATED and t.truncation == Truncation.MAX_TURNS
        assert t.turns == 2 and t.metadata["agent"] == {"refused": "max_turns"} and t.reward == 0.0
    assert runner.counts["budget_refusals"] == 2


def test_response_and_turn_token_budgets(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=99, call_format="json"))
    trajs, _ = run_agent(engine, tiny_tokenizer, greedy_caller, agent_cfg=cfg(max_turns=50, max_response_tokens=60))
    for t in trajs:
        assert t.status == TrajectoryStatus.TRUNCATED and t.truncation == Truncation.MAX_RESPONSE_TOKENS
        assert len(t.response_ids) <= 60
    trajs, _ = run_agent(ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=99, call_format="json")),
                         tiny_tokenizer, greedy_caller, agent_cfg=cfg(max_new_tokens_per_turn=5))
    for t in trajs:
        assert t.status == TrajectoryStatus.TRUNCATED and t.truncation == Truncation.MAX_NEW_TOKENS
        assert t.turns == 1 and sum(t.response_mask) == 5


async def uncaught(client, instance):
    """Does not handle the budget error: the episode is TRUNCATED all the same, not invalid."""
    messages = [dict(m) for m in instance.messages]
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "x", "content": "1"})


def test_an_uncaught_budget_error_still_truncates(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=99, call_format="json"))
    trajs, runner = run_agent(engine, tiny_tokenizer, uncaught, agent_cfg=cfg(max_turns=2))
    assert all(t.status == TrajectoryStatus.TRUNCATED and t.truncation == Truncation.MAX_TURNS for t in trajs)
    assert runner.counts["agent_errors"] == 0


def test_the_wall_clock_aborts_the_request_and_keeps_its_tokens(tiny_tokenizer):
    slow = ScriptedEngine(tiny_tokenizer, lambda ids, turn: "x" * 200, step_latency_s=0.01)
    trajs, _ = run_agent(slow, tiny_tokenizer, greedy_caller, n=1,
                         agent_cfg=cfg(max_episode_s=0.5, max_new_tokens_per_turn=400, max_response_tokens=500),
                         gateway_cfg=gateway(agent_grace_s=0.5))
    t = trajs[0]
    assert t.status == TrajectoryStatus.TRUNCATED and t.truncation == Truncation.WALL_CLOCK
    assert 0 < sum(t.response_mask) < 200 and t.timings["total_s"] < 10


def test_an_agent_that_never_returns_is_cut_at_its_clock_and_a_stop_aborts_it(tiny_tokenizer):
    """The agent's own wait after a request (none in flight): past agent.max_episode_s + gateway.agent_grace_s the
    episode is TRUNCATED(wall_clock); a stop requested while it waits ABORTs it, saying so."""
    engine = ScriptedEngine(tiny_tokenizer, lambda ids, turn: "x")
    stop = asyncio.Event()

    async def sleeper(client, instance):
        await client.chat.completions.create(model="policy", messages=list(instance.messages))
        await asyncio.sleep(30)

    async def stopped(client, instance):
        await client.chat.completions.create(model="policy", messages=list(instance.messages))
        asyncio.get_running_loop().call_later(0.2, stop.set)
        await asyncio.sleep(30)

    [late], _ = run_agent(engine, tiny_tokenizer, sleeper, n=1, agent_cfg=cfg(max_episode_s=2),
                          gateway_cfg=gateway(agent_grace_s=0.5))
    assert late.status == TrajectoryStatus.TRUNCATED and late.truncation == Truncation.WALL_CLOCK, late.metadata
    assert 2 < late.timings["total_s"] < 10
    [gone], _ = run_agent(engine, tiny_tokenizer, stopped, n=1, agent_cfg=cfg(max_episode_s=60), stop=stop)
    assert gone.status == TrajectoryStatus.ABORTED and gone.metadata["end_reason"] == "stop requested"
    assert gone.timings["total_s"] < 10


async def leaking(client, instance):
    LEAKED.append((client.api_key, client.base_url))
    reply = await client.chat.completions.create(model="policy", messages=list(instance.messages))
    return Outcome(answer=answer_of(reply.choices[0].message.content))


LEAKED: list = []


def test_keys_are_per_episode_and_die_with_it(tiny_tokenizer):
    LEAKED.clear()

    async def after(runner):
        key, _ = LEAKED[0]
        client = runner.client(key)
        with pytest.raises(openai.AuthenticationError, match="unknown or expired episode key"):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        for other in ("none", "hyb-" + "A" * 32):          # no key of an episode, a made-up one
            with pytest.raises(openai.AuthenticationError):
                await runner.client(other).chat.completions.create(model="p", messages=[{"role": "user",
                                                                                          "content": "hi"}])
            with pytest.raises(openai.AuthenticationError):
                await runner.client(other).models.list()
        assert len(runner.keys) == 0

    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=0))
    trajs, _ = run_agent(engine, tiny_tokenizer, leaking, n=2, inspect=after)
    assert len({k for k, _ in LEAKED}) == 2 and all(t.reward == 1.0 for t in trajs)


async def refused_parameters(client, instance):
    seen = {}
    for extra in ({"logit_bias": {"5": 10}}, {"top_logprobs": 2, "logprobs": True}, {"frequency_penalty": 0.5}):
        try:
            await client.chat.completions.create(model="policy", messages=list(instance.messages), **extra)
        except openai.BadRequestError as err:
            seen[next(iter(extra)) if "top_logprobs" not in extra else "top_logprobs"] = err.body["param"]
    reply = await client.chat.completions.create(model="policy", messages=list(instance.messages), temperature=0.3)
    return Outcome(answer=answer_of(reply.choices[0].message.content), metadata=seen)


def test_unsupported_sampling_is_refused_and_the_runs_temperature_applies(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=0))
    trajs, runner = run_agent(engine, tiny_tokenizer, refused_parameters, n=1, agent_cfg=cfg(temperature=0.7))
    t = trajs[0]
    assert t.metadata["agent"] == {"logit_bias": "logit_bias", "top_logprobs": "top_logprobs",
                                   "frequency_penalty": "frequency_penalty"}
    assert t.turns == 1 and t.metadata["sampling_overridden"] == 1
    assert [r.sampling.temperature for r in engine.requests] == [0.7]


async def two_choices(client, instance):
    reply = await client.chat.completions.create(model="policy", messages=list(instance.messages), n=2,
                                                 tools=[CALCULATOR])
    assert len(reply.choices) == 2
    chosen = reply.choices[1].message
    messages = [*instance.messages, chosen.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": await call_tool(c.function.name,
                                                                                   json.loads(c.function.arguments))}
                 for c in chosen.tool_calls]
    final = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    return Outcome(answer=answer_of(final.choices[0].message.content))


def test_n_choices_the_agent_continues_one(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=1, call_format="json"))
    trajs, _ = run_agent(engine, tiny_tokenizer, two_choices, n=1)
    t = trajs[0]
    first = [r for r in engine.requests if r.request_id.endswith("/t0")][0]
    assert t.reward == 1.0 and t.metadata["untrained_policy_tokens"] == len(first.output.token_ids)
    assert t.metadata["template_drift"] == 0 and t.turns == 2


async def completions_agent(client, instance):
    prompt = f"Q: {instance.messages[-1]['content']}\nA:"
    reply = await client.completions.create(model="policy", prompt=prompt, max_tokens=8, logprobs=1)
    choice = reply.choices[0]
    assert len(choice.logprobs.token_logprobs) == reply.usage.completion_tokens
    models = await client.models.list()
    return float(models.data[0].id == "policy")


def test_completions_and_models_endpoints(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda ids, turn: "1 2 3 4 5 6 7 8 9")
    trajs, _ = run_agent(engine, tiny_tokenizer, completions_agent, n=1)
    t = trajs[0]
    assert t.status == TrajectoryStatus.COMPLETED and t.rewards == {"agent": 1.0} and sum(t.response_mask) == 8
    assert tiny_tokenizer.decode(t.prompt_ids).startswith("Q: What is")


async def crashing(client, instance):
    await client.chat.completions.create(model="policy", messages=list(instance.messages))
    raise KeyError("the agent's own bug")


async def silent(client, instance):
    return 1.0


def test_an_agent_error_is_a_scored_failure_and_no_request_is_dropped(tiny_tokenizer):
    """The agent's own exception is its episode's failure (FAILED, scored by the task: no reward dodge), named
    as an agent error, never an infrastructure fault; with on_agent_error=drop it is left out of training. An
    agent that asks the model nothing has nothing to score: dropped, counted as an agent error."""
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=0))
    trajs, runner = run_agent(engine, tiny_tokenizer, crashing, n=1)
    t = trajs[0]
    assert t.status == TrajectoryStatus.FAILED and "KeyError" in t.metadata["end_reason"]
    assert t.metadata["end_reason"].startswith("agent error:") and t.rewards and t.reward == 0.0
    assert t.num_policy_tokens > 0 and runner.counts["agent_errors"] == 1
    trajs, runner = run_agent(engine, tiny_tokenizer, crashing, n=1, agent_cfg=AgentConfig(on_agent_error="drop"))
    assert trajs[0].status == TrajectoryStatus.ABORTED and runner.counts["agent_errors"] == 1
    trajs, runner = run_agent(engine, tiny_tokenizer, silent, n=1)
    assert trajs[0].status == TrajectoryStatus.ABORTED and trajs[0].metadata["end_reason"] == \
        "agent error: the agent made no request" and trajs[0].prompt_ids and runner.counts["agent_errors"] == 1

def test_the_first_agent_error_of_a_runner_prints_its_traceback_once(tiny_tokenizer, caplog):
    """Three episodes whose agent raises: the first one's traceback is logged (the user sees the bug), the
    later ones are counted as agent_errors without repeating it."""
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=0))
    with caplog.at_level("ERROR", logger="hybridrl.agent.episodes"):
        trajs, runner = run_agent(engine, tiny_tokenizer, crashing, n=3)
    assert runner.counts["agent_errors"] == 3 and all(t.status == TrajectoryStatus.FAILED for t in trajs)
    shown = [r for r in caplog.records if "the agent raised in episode" in r.getMessage()]
    assert len(shown) == 1
    assert "Traceback (most recent call last)" in shown[0].getMessage() and "KeyError" in shown[0].getMessage()
