"""An adversarial suite through the gateway with the real `openai` client (AsyncOpenAI over the gateway's
socket, its HTTP side in a thread of its own): n > 1 choices, concurrent requests of one episode, a client
that hangs up while its stream is being generated, lone surrogates and 1200-deep nesting in the model's tool
calls, an agent that raises. Each checks what trains: the tokens the loss sees (mask 1) are exactly the
engine's outputs of the completion the reward belongs to, and no episode is INFRA_INVALID for what the policy
wrote or the agent did with it. Last, a real run whose every episode fails stops with exit code 1."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from hybridrl.agent.testing import ScriptedEngine
from hybridrl.data.trajectory import TrajectoryStatus
from hybridrl.envs.arithmetic import evaluate, format_value
from hybridrl.gateway import Outcome
from tests.gateway.helpers import cfg, gateway, run_agent
from tests.gateway.test_openai_client import CALCULATOR, answer_of


class ByRequest(ScriptedEngine):
    """A scripted engine whose responder also sees the request id (`self.current`): choice i of n, or the
    k-th request of an episode, gets a script of its own."""

    current = ""

    async def generate(self, token_ids, sampling, request_id):
        self.current = request_id
        return await super().generate(token_ids, sampling, request_id)


class Paired(ByRequest):
    """Holds each episode's first request until its second has reached the engine: two requests of one
    episode in flight at once, whatever the machine's timing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting: dict[str, asyncio.Event] = {}

    async def generate(self, token_ids, sampling, request_id):
        episode = request_id.rsplit("/", 1)[0]
        if episode not in self.waiting:
            self.waiting[episode] = asyncio.Event()
            await self.waiting[episode].wait()
        else:
            self.waiting[episode].set()
        return await super().generate(token_ids, sampling, request_id)


def trained(t) -> list[int]:
    """The ids the loss sees."""
    return [i for i, m in zip(t.response_ids, t.response_mask) if m]


def outputs(engine, t, pick=lambda r: True) -> list[list[int]]:
    """The engine's output ids of the episode's requests that `pick` keeps, in order."""
    return [list(r.output.token_ids) for r in engine.requests
            if r.request_id.startswith(t.trajectory_id + "/") and r.output is not None and pick(r)]


def right_answer(tokenizer, ids) -> str:
    question = re.findall(r"What is (.*)\?", tokenizer.decode(ids))[-1]
    return format_value(evaluate(question))


# ------------------------------------------------------------------------------------------------- n > 1


def two_answers(engine, tokenizer):
    """Choice 0 answers right, choice 1 wrong (its value + 1)."""
    def respond(ids, turn):
        value = right_answer(tokenizer, ids)
        return f"<answer>{value}</answer>" if ".c1" not in engine.current else f"<answer>{value}1</answer>"
    return respond


def picks(k: int):
    async def agent(client, instance):
        reply = await client.chat.completions.create(model="policy", messages=list(instance.messages), n=2)
        assert [c.index for c in reply.choices] == [0, 1]
        return Outcome(answer=answer_of(reply.choices[k].message.content), completion=reply.id, choice=k)
    return agent


async def names_nothing(client, instance):
    await client.chat.completions.create(model="policy", messages=list(instance.messages), n=2)
    return Outcome(reward=1.0)


def test_n_choices_train_the_choice_the_reward_belongs_to(tiny_tokenizer):
    for k, reward in ((0, 1.0), (1, 0.0)):
        engine = ByRequest(tiny_tokenizer, None)
        engine.responder = two_answers(engine, tiny_tokenizer)
        trajs, _ = run_agent(engine, tiny_tokenizer, picks(k), n=2)
        for t in trajs:
            chosen = outputs(engine, t, lambda r: (".c1" in r.request_id) == bool(k))
            assert t.status == TrajectoryStatus.COMPLETED and t.reward == reward, t.metadata
            assert trained(t) == chosen[0]                               # the choice the agent answered from
            assert t.metadata["untrained_policy_tokens"] == len(outputs(engine, t, lambda r: (".c1" in r.request_id) != bool(k))[0])
    engine = ByRequest(tiny_tokenizer, None)
    engine.responder = two_answers(engine, tiny_tokenizer)
    trajs, runner = run_agent(engine, tiny_tokenizer, names_nothing, n=2)
    for t in trajs:                                     # a reward of unknown completion trains nothing
        assert t.status == TrajectoryStatus.ABORTED and t.metadata["end_reason"].startswith("ambiguous_final")
    assert runner.counts["ambiguous_final"] == 2


# ------------------------------------------------------------------------------------------------- concurrent requests


SIDE = [{"role": "user", "content": "What is 1 + 1?"}]


async def side_conversation(client, instance):
    """The main question and a side one at once; the main one continued, the side one left."""
    main, _ = await asyncio.gather(client.chat.completions.create(model="policy", messages=list(instance.messages)),
                                   client.chat.completions.create(model="policy", messages=SIDE))
    messages = [*instance.messages, main.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Sure?"}]
    final = await client.chat.completions.create(model="policy", messages=messages)
    return Outcome(answer=answer_of(final.choices[0].message.content))


async def names_the_side(client, instance):
    """Two at once, neither continued: the agent says its reward is the side conversation's."""
    main, side = await asyncio.gather(client.chat.completions.create(model="policy", messages=list(instance.messages)),
                                      client.chat.completions.create(model="policy", messages=SIDE))
    return Outcome(reward=0.25, completion=side.id, metadata={"ids": [main.id, side.id]})


def test_concurrent_requests_of_one_episode_train_only_the_chain_the_reward_belongs_to(tiny_tokenizer):
    def is_side(r):
        return "1 + 1" in tiny_tokenizer.decode(r.input_ids)

    engine = Paired(tiny_tokenizer, lambda ids, turn: f"<answer>{right_answer(tiny_tokenizer, ids)}</answer>")
    trajs, _ = run_agent(engine, tiny_tokenizer, side_conversation, n=2)
    for t in trajs:
        main, side = outputs(engine, t, lambda r: not is_side(r)), outputs(engine, t, is_side)
        assert t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0 and len(main) == 2 and len(side) == 1
        assert trained(t) == main[0] + main[1]
        assert t.metadata["untrained_policy_tokens"] == len(side[0])
        assert "1 + 1" not in tiny_tokenizer.decode(t.prompt_ids + t.response_ids)
    engine = Paired(tiny_tokenizer, engine.responder)
    trajs, _ = run_agent(engine, tiny_tokenizer, names_the_side, n=2)
    for t in trajs:
        side = outputs(engine, t, is_side)
        main_id, side_id = t.metadata["agent"]["ids"]
        assert main_id != side_id                           # each completion can be named
        assert t.status == TrajectoryStatus.COMPLETED and t.reward == 0.25 and trained(t) == side[0]
        assert "1 + 1" in tiny_tokenizer.decode(t.prompt_ids)


# ------------------------------------------------------------------------------------------------- disconnect


async def hangs_up(client, instance):
    """Streams a long turn and goes away before it arrives; then asks again and answers."""
    try:
        await asyncio.wait_for(client.chat.completions.create(model="policy", messages=list(instance.messages),
                                                              stream=True), 0.3)
    except asyncio.TimeoutError:
        pass
    reply = await client.chat.completions.create(model="policy", messages=list(instance.messages))
    return Outcome(answer=answer_of(reply.choices[0].message.content))


def test_a_client_that_hangs_up_mid_stream_trains_nothing_of_it(tiny_tokenizer):
    engine = ByRequest(tiny_tokenizer, None, step_latency_s=0.01)
    engine.responder = lambda ids, turn: "x " * 150 if engine.current.endswith("/t0") else \
        f"<answer>{right_answer(tiny_tokenizer, ids)}</answer>"
    trajs, runner = run_agent(engine, tiny_tokenizer, hangs_up, n=1,
                              agent_cfg=cfg(max_new_tokens_per_turn=400, max_response_tokens=500))
    t = trajs[0]
    first, second = [r for r in engine.requests if r.request_id.startswith(t.trajectory_id + "/")]
    assert first.request_id.endswith("/t0") and second.request_id.endswith("/t1")
    assert t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0 and t.metadata["disconnected"] == 1
    assert trained(t) == list(second.output.token_ids)             # nothing of the undelivered turn
    assert t.metadata["untrained_policy_tokens"] == 0 and t.metadata["gateway_requests"] == 1
    assert first.output is None or len(first.output.token_ids) < 300   # its generation was aborted
    assert runner.service.counts["client_closed"] == 1 and runner.service.counts["errors"] == 0



def test_asking_whether_the_client_has_gone_never_waits_and_leaves_no_waiter_behind():
    """ClientWatch() answers from what the server already holds: a receive() that would wait is closed at
    once (no waiter left on the server's event), one that answers at once is read; wait() ends on the
    disconnect and later polls say gone without asking again."""
    from types import SimpleNamespace

    from hybridrl.gateway.server import ClientWatch

    async def main():
        event, asked = asyncio.Event(), []

        async def receive():
            asked.append(1)
            if not event.is_set():
                await event.wait()
            return {"type": "http.disconnect"}

        watch = ClientWatch(SimpleNamespace(scope={}, receive=receive))
        assert await watch() is False and len(event._waiters) == 0 and len(asked) == 1
        waiting = asyncio.ensure_future(watch.wait())
        await asyncio.sleep(0)
        assert not waiting.done() and len(event._waiters) == 1
        event.set()
        await waiting
        assert await watch() is True and len(asked) == 2          # known gone: not asked again
        assert await ClientWatch(SimpleNamespace(scope={}, receive=receive))() is True

    asyncio.run(main())

def test_a_lost_connection_calls_back_through_the_protocol_or_a_watch_without_it():
    """on_lost(cb): under the gateway's protocol (the scope's ClientLost) the connection's loss calls cb
    once, with no task; a callback removed first is not called; one added after the loss runs at once.
    Under another ASGI server (no extension) a task waits for http.disconnect and calls cb."""
    from types import SimpleNamespace

    from hybridrl.gateway.http_limits import ClientLost
    from hybridrl.gateway.server import CLIENT_LOST, ClientWatch

    async def main():
        hooks, called = ClientLost(), []
        watch = ClientWatch(SimpleNamespace(scope={"extensions": {CLIENT_LOST: hooks}}))
        assert await watch() is False                        # asked of the connection's record, no receive()
        watch.on_lost(lambda: called.append("a"))
        forget = watch.on_lost(lambda: called.append("b"))
        forget()
        tasks = len(asyncio.all_tasks())
        hooks.fire()
        assert called == ["a"] and watch.gone and len(asyncio.all_tasks()) == tasks
        assert await ClientWatch(SimpleNamespace(scope={"extensions": {CLIENT_LOST: hooks}}))() is True
        watch.on_lost(lambda: called.append("late"))
        assert called == ["a", "late"]

        event = asyncio.Event()

        async def receive():
            await event.wait()
            return {"type": "http.disconnect"}

        plain = ClientWatch(SimpleNamespace(scope={}, receive=receive))
        plain.on_lost(lambda: called.append("plain"))
        forgotten = ClientWatch(SimpleNamespace(scope={}, receive=receive))
        forgotten.on_lost(lambda: called.append("forgotten"))()
        await asyncio.sleep(0)
        assert called == ["a", "late"]
        event.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert called == ["a", "late", "plain"] and plain.gone and not forgotten.gone

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------- the model's output


BAD_CALLS = ['<tool_call>{"name": "calculator", "arguments": {"expression": "1\\ud800"}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "[" * 1200 + "]" * 1200
             + '}}</tool_call>']


async def retries(client, instance):
    """Asks until an answer; a call it is handed must carry valid JSON of valid Unicode."""
    messages = [dict(m) for m in instance.messages]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if answer_of(message.content):
            return Outcome(answer=answer_of(message.content))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            json.loads(call.function.arguments.encode("utf-8"))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "error"})
        messages += [] if message.tool_calls else [{"role": "user", "content": "again"}]
    return Outcome()


@pytest.mark.parametrize("parser", ["hermes", "actions"])
def test_surrogates_and_deep_nesting_in_the_models_calls_are_scored_calls_never_faults(tiny_tokenizer, parser):
    """hermes: both calls are malformed (counted, scored); actions (the built-in loop's parser): the lone
    surrogate is replaced (U+FFFD) and the call handed out, the 1200-deep one is malformed. Never a 500."""
    engine = ByRequest(tiny_tokenizer, None)
    engine.responder = lambda ids, turn: BAD_CALLS[turn] if turn < 2 else \
        f"<answer>{right_answer(tiny_tokenizer, ids)}</answer>"
    trajs, runner = run_agent(engine, tiny_tokenizer, retries, n=1, gateway_cfg=gateway(tool_parser=parser),
                              agent_cfg=cfg(max_new_tokens_per_turn=3000, max_response_tokens=8000))
    t = trajs[0]
    assert t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0, t.metadata
    malformed = [("?", False), ("?", False)] if parser == "hermes" else [("calculator", True), ("?", False)]
    assert [(c.name, c.ok) for c in t.tool_calls] == malformed
    assert runner.counts["malformed_actions"] == malformed.count(("?", False)) and runner.service.counts["errors"] == 0
    assert trained(t) == sum(outputs(engine, t), [])                # the calls are the policy's: trained, scored


# ------------------------------------------------------------------------------------------------- the agent raises


async def raises(client, instance):
    reply = await client.chat.completions.create(model="policy", messages=list(instance.messages))
    return Outcome(answer=str(int(reply.choices[0].message.content)))           # "<answer>..": ValueError


def test_an_agent_that_raises_is_a_scored_failure_of_its_tokens(tiny_tokenizer):
    engine = ByRequest(tiny_tokenizer, lambda ids, turn: f"<answer>{right_answer(tiny_tokenizer, ids)}</answer>")
    trajs, runner = run_agent(engine, tiny_tokenizer, raises, n=2)
    for t in trajs:
        assert t.status == TrajectoryStatus.FAILED and t.reward == 0.0 and "ValueError" in t.metadata["end_reason"]
        assert trained(t) == outputs(engine, t)[0]
    assert runner.counts["agent_errors"] == 2 and runner.service.counts["errors"] == 0


# ------------------------------------------------------------------------------------------------- a failing run


@pytest.mark.slow                # two steps of a 2-rank RL run: ~1-2 minutes
def test_a_run_whose_every_episode_fails_exits_1_saying_why(tmp_path, tiny_models):
    from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

    proc = hybridrl_train(RECIPE, f"model.path={tiny_models('qwen2')}", f"run.dir={tmp_path}",
                          "task.agent=tests.gateway.rl_agent:crash", "gateway.tool_parser=none",
                          "trainer.total_steps=6", "trainer.stop_after_failed_steps=2",
                          "distributed.heartbeat_timeout_s=120")
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "every episode of the last 2 steps failed (trainer.stop_after_failed_steps=2)" in proc.stderr
    assert "agent error" in proc.stderr and "ValueError" in proc.stderr
    from hybridrl.telemetry.metrics import read_metrics

    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["agent/agent_errors"] == r["episodes"] == 16 for r in rows), rows
