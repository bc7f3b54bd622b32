"""Running a `GatewayRunner` in a test: a scripted or model engine, the calculator tool, an agent."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.tools.base import ToolBox
from hybridrl.envs.tasks import get_task
from hybridrl.gateway.config import GatewayConfig
from hybridrl.gateway.runner import GatewayRunner


def run_agent(engine: Any, tokenizer: Any, agent: Callable, *, n: int = 2, group_size: int = 1,
              agent_cfg: AgentConfig | None = None, gateway_cfg: GatewayConfig | None = None,
              inspect: Callable | None = None, instances: list[str] = (), server_thread: bool = True,
              **run_kwargs) -> tuple[list, GatewayRunner]:
    """`n` calculator validation instances (or the `instances` expressions) x `group_size` episodes of
    `agent` through a gateway on `engine` (its HTTP side in its own thread unless `server_thread=False`);
    `inspect(runner)` runs on the loop after the episodes, before the gateway closes."""
    task = get_task("calculator")
    chosen = [task.instance(e) for e in instances] or task.validation_split(n)
    agent_cfg = agent_cfg or AgentConfig(max_turns=4, max_new_tokens_per_turn=64, max_response_tokens=400)
    gateway_cfg = gateway_cfg or GatewayConfig()

    async def go():
        tools = await ToolBox.from_config(ToolsConfig(kill_switch="", audit_log=""), names=["calculator"]).start()
        engines = engine if isinstance(engine, list) else [engine]
        runner = GatewayRunner(engines, tokenizer, agent_cfg=agent_cfg, gateway_cfg=gateway_cfg, tools=tools,
                               run_id="test", agent=agent, server_thread=server_thread)
        try:
            trajs = await runner.run(chosen, task=task, group_size=group_size, **run_kwargs)
            if inspect is not None:
                await inspect(runner)
            return trajs, runner
        finally:
            await runner.close()
            await tools.close()

    return asyncio.run(go())


def cfg(**kwargs) -> AgentConfig:
    base = dict(max_turns=4, max_new_tokens_per_turn=64, max_response_tokens=400)
    return AgentConfig(**{**base, **kwargs})


def gateway(**kwargs) -> GatewayConfig:
    return dataclasses.replace(GatewayConfig(), **kwargs)
