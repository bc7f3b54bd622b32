"""A gateway to attack: `hybridrl gateway check` starts it in a process of its own (`python -m
hybridrl.gateway.check_target GATEWAY_JSON [MODEL_DIR]`).

It serves one held episode of an agent that asks the model once and then waits (its key is what the
attacker is given, as an agent's leaked key would be), on a scripted engine (no model weights: the
gateway's own defences are under test, not the model) with the tokenizer of MODEL_DIR or the tiny one
built here. It prints one JSON line (where it listens, the key, its pid) and then reads stdin: at `end`
(or EOF) the agent returns and it prints a report (the episode's status, the server's counters) and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from typing import Any

from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.envs.tasks import get_task
from hybridrl.gateway.agent import Outcome
from hybridrl.gateway.config import GatewayConfig
from hybridrl.gateway.runner import GatewayRunner


def tokenizer_of(model_dir: str | None) -> Any:
    """The tokenizer of `model_dir`, or the tiny ChatML one (trained here in under a second, nothing read)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if model_dir:
        return AutoTokenizer.from_pretrained(model_dir)
    from hybridrl.assets.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, train_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


class HeldAgent:
    """Asks once, says where the gateway is, waits for `release`; names the completion it ends on (the
    attacker's requests add others to its episode)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.runner: GatewayRunner | None = None

    async def run(self, client: Any, instance: Any) -> Outcome:
        reply = await client.chat.completions.create(model="policy", messages=list(instance.messages))
        server = self.runner.server
        where = {"socket": str(server.socket_path)} if server.socket_path is not None else \
            {"host": server.host, "port": server.port}
        print(json.dumps({**where, "key": client.api_key, "pid": os.getpid(),
                          "read_timeout_s": self.runner.gateway_cfg.read_timeout_s}), flush=True)
        await self.release.wait()
        return Outcome(answer="4", completion=reply.id, choice=0)


async def serve(gateway_cfg: GatewayConfig, model_dir: str | None) -> dict[str, Any]:
    tokenizer = tokenizer_of(model_dir)
    engine = ScriptedEngine(tokenizer, lambda ids, turn: "<answer>4</answer>")
    agent = HeldAgent()
    runner = GatewayRunner(engine, tokenizer, agent_cfg=AgentConfig(max_turns=100_000, max_episode_s=3600,
                                                                    max_response_tokens=100_000),
                           gateway_cfg=gateway_cfg, tools=ToolBox(cfg=ToolsConfig(kill_switch="", audit_log="")), run_id="gateway-check", agent=agent.run)
    agent.runner = runner
    task = get_task("calculator")
    episodes = asyncio.ensure_future(runner.run(task.validation_split(1), task=task))
    try:
        await _wait_for_end(episodes)
        agent.release.set()
        trajs = await episodes
        protocol = runner.server.protocol
        return {"statuses": [t.status.value for t in trajs], "end_reasons": [t.metadata.get("end_reason", "")
                                                                          for t in trajs],
                "service": dict(runner.service.counts), "timed_out": protocol.timed_out,
                "agent_errors": runner.counts["agent_errors"]}
    finally:
        await runner.close()


async def _wait_for_end(episodes: asyncio.Future) -> None:
    """Until stdin says `end` (or closes); an episode that ended early (a fault) ends the wait too."""
    line = asyncio.get_running_loop().create_future()
    threading.Thread(target=_read_line, args=(line,), daemon=True).start()
    await asyncio.wait({line, episodes}, return_when=asyncio.FIRST_COMPLETED)


def _read_line(done: asyncio.Future) -> None:
    """A daemon thread's blocking read of stdin (it must not hold the process open when the episode ends)."""
    sys.stdin.readline()
    done.get_loop().call_soon_threadsafe(_settle, done)


def _settle(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)


def main(argv: list[str]) -> int:
    cfg = GatewayConfig(**json.loads(argv[0]))
    report = asyncio.run(serve(cfg, argv[1] if len(argv) > 1 else None))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
