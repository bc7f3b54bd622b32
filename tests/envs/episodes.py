"""Episodes of a task through the real agent loop, and the checks every integrated task passes:
the trajectory's policy tokens are exactly what the engine sampled, and the run ledger records the
reward's components as the episode scored them."""

from __future__ import annotations

import asyncio
import json
import sqlite3

from hybridrl.agent.chat import ChatFormat
from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.agent.tools.calculator import CalculatorTool


class RecordingEngine(ScriptedEngine):
    """A scripted engine that keeps the ids it returned for every request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled: dict[str, list[int]] = {}

    async def generate(self, token_ids, sampling, request_id):
        out = await super().generate(token_ids, sampling, request_id)
        self.sampled[request_id] = list(out.token_ids)
        return out


def run_scripted(tokenizer, task, instances, respond, *, max_turns: int = 3):
    """One episode per instance; `respond(instance, turn) -> text` is the policy. Returns (engine, trajectories)."""
    engine = RecordingEngine(tokenizer, _responder(ChatFormat(tokenizer), instances, respond), max_model_len=1 << 16)
    agent = AgentConfig(max_turns=max_turns, max_new_tokens_per_turn=256, max_response_tokens=1024)

    async def go():
        async with ToolBox([CalculatorTool()]) as box:
            runner = AgentRunner(engine, tokenizer, agent_cfg=agent, tools=box, run_id="it")
            return await runner.run(instances, task=task)

    return engine, asyncio.run(go())


def _responder(chat, instances, respond):
    prompts = [(chat.prompt_ids(list(i.messages)), i) for i in instances]

    def responder(ids, turn):
        inst = next(i for p, i in sorted(prompts, key=lambda x: -len(x[0])) if ids[:len(p)] == p)
        return respond(inst, turn)
    return responder


def policy_ids(traj) -> list[int]:
    return [i for i, m in zip(traj.response_ids, traj.response_mask) if m]


def check_tokens(engine, trajectories) -> None:
    """Each trajectory's policy tokens are the concatenation of what the engine sampled for its requests."""
    for t in trajectories:
        mine = [rid for rid in engine.sampled if rid.startswith(t.trajectory_id + "/")]
        assert mine, t.trajectory_id
        assert policy_ids(t) == [i for rid in mine for i in engine.sampled[rid]]


def ledger_rewards(tmp_path, trajectories) -> dict[str, dict[str, float]]:
    """Record the trajectories as step 1 of a run ledger; return trajectory id -> the components it stored."""
    from hybridrl.algo.config import AlgoConfig
    from hybridrl.algo.filters import filter_trajectories
    from hybridrl.data.trajectory import to_batch
    from hybridrl.store.config import StoreConfig
    from hybridrl.store.ledger import Ledger

    kept = filter_trajectories(trajectories, drop_all_equal_groups=False)
    ledger = Ledger(tmp_path, StoreConfig(), algo=AlgoConfig())
    ledger.record_step(1, trajectories=trajectories, kept=kept, batch=to_batch(kept.kept), switch=None,
                       rollout_version=0, version_after=1, metrics={})
    db = sqlite3.connect(tmp_path / "ledger" / "index.sqlite")
    return {row[0]: json.loads(row[1]) for row in db.execute("SELECT id, rewards FROM trajectories")}


def load_file(path, name: str):
    """The user's module at `path`, imported under `name` (as a recipe names it `file.py:ATTR`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
