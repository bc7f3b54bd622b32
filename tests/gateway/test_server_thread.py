"""The gateway's HTTP side runs on its own loop and thread: while a request is being templated there, the
engine's loop goes on (it runs a callback posted in the middle of the rendering), and the generation runs
on the engine's loop. With `server_thread=False` (the HTTP side on the engine's loop) the same callback
cannot run until the rendering is over: the test tells the two apart by order, not by time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hybridrl.agent.testing import ScriptedEngine, calculator_oracle
from hybridrl.data.trajectory import TrajectoryStatus
from hybridrl.gateway.capture import Template
from tests.gateway.helpers import run_agent

SAFETY_S = 60.0        # how long a rendering waits for the engine's loop (it answers at once when it is free)


class RecordingEngine(ScriptedEngine):
    """Notes the loop and thread every generation runs on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ran_on: list[tuple] = []

    async def generate(self, token_ids, sampling, request_id):
        self.ran_on.append((asyncio.get_running_loop(), threading.current_thread()))
        return await super().generate(token_ids, sampling, request_id)


@pytest.mark.parametrize("server_thread", [True, False])
def test_the_engine_loop_runs_while_a_request_is_templated(tiny_tokenizer, monkeypatch, server_thread):
    engine_loop: list[asyncio.AbstractEventLoop] = []
    renders: list[tuple[str, bool]] = []        # (the rendering's thread, whether the engine's loop ran meanwhile)
    original = Template.render

    def render(self, *args, **kwargs):
        if engine_loop:                          # a request's rendering (not the template's own set-up)
            ticked = threading.Event()
            engine_loop[0].call_soon_threadsafe(ticked.set)
            renders.append((threading.current_thread().name, ticked.wait(SAFETY_S if server_thread else 0.2)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Template, "render", render)

    async def agent(client, instance):
        engine_loop[:] = [asyncio.get_running_loop()]
        messages = [dict(m) for m in instance.messages]
        for _ in range(2):
            reply = await client.chat.completions.create(model="p", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        return 1.0

    engine = RecordingEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=0))
    trajs, runner = run_agent(engine, tiny_tokenizer, agent, n=2, server_thread=server_thread)
    assert [t.status for t in trajs] == [TrajectoryStatus.COMPLETED] * 2, [t.metadata for t in trajs]
    assert all(t.turns == 2 and t.metadata["token_drift"] == 0 for t in trajs)
    assert len(renders) >= 4 and len(engine.ran_on) == 4
    # generation always runs on the engine's loop, in the thread that runs it
    assert {loop for loop, _ in engine.ran_on} == set(engine_loop)
    assert {thread for _, thread in engine.ran_on} == {threading.main_thread()}
    if server_thread:
        assert {name for name, _ in renders} == {"hybridrl-gateway"}
        assert all(ran for _, ran in renders), renders          # the engine's loop was free every time
    else:
        assert {name for name, _ in renders} == {threading.main_thread().name}
        assert not any(ran for _, ran in renders), renders      # it waited for every rendering
