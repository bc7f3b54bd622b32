"""The recipe form of `hybridrl eval`: greedy and sampled accuracy on a task, and what they say for RL.

    hybridrl eval RECIPE [key=value ...] [--model DIR] [-n N] [--temperature T] [--json OUT]   (hybridrl/cli/eval.py)

Greedy accuracy is what training's validation reports. Sampled accuracy (at `agent.temperature`,
the temperature RL samples at) says whether RL has a signal: a group estimator learns only from
groups whose samples differ in reward, so a model that never succeeds when sampling gives every
group the same reward (nothing to learn), and one that always succeeds has nothing left to learn.

The episodes run through the agent loop (tools, budgets, the task's verifier) on the native
engine, the way `hybridrl agent rollout` runs them. SFT's validation (`sft.validate_every`) runs
the same code on every rank, each on its share of the validation split.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

# The sampled accuracy below which a group of 8 usually sees no success: 1 - (1 - p)^8 < 1/2.
RARE = 0.08


def run_episodes(cfg: Any, model_dir: str | Path, instances: Sequence[Any], *, temperature: float,
                 group_id: str, device: str = "cpu", engine: Any = None) -> list[Any]:
    """One episode per instance through the agent loop on `model_dir` (or on `engine`, when given)."""
    from transformers import AutoTokenizer

    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.envs.tasks import Task, get_task
    from hybridrl.agent.episodes import episode_runner

    task = get_task(cfg.task.name, cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    own = engine is None
    if own:
        from hybridrl.backends.native import NativeEngine

        engine = NativeEngine.from_pretrained(model_dir, cfg.rollout.native, device=device)
    envs = None
    if type(task).make_env is not Task.make_env:         # a task with a world: through the leased service
        from hybridrl.envs.client import LeasedEnvProvider
        from hybridrl.envs.service import EnvService

        envs = LeasedEnvProvider(EnvService.from_config(cfg.env), cfg.env)
    names = sorted({t for inst in instances for t in inst.tools})

    async def go():
        async with ToolBox.from_config(cfg.tools, names=names) as tools:
            runner = episode_runner(cfg, engine, tokenizer, tools=tools, envs=envs)
            attempts = [(inst, 0, f"{inst.task_id}@{group_id}") for inst in instances]
            try:
                return await runner.run_attempts(attempts, task=task, temperature=temperature)
            finally:
                await runner.close()

    try:
        return asyncio.run(go())
    finally:
        if own:
            engine.close()


def correct(trajectory: Any) -> float:
    return float(trajectory.rewards.get("correct", trajectory.reward))


def summarize(trajectories: Sequence[Any]) -> dict[str, float]:
    n = len(trajectories)
    return {"accuracy": sum(map(correct, trajectories)) / n if n else 0.0,
            "successes": float(sum(correct(t) > 0 for t in trajectories)),
            "reward": statistics.fmean(t.reward for t in trajectories) if n else 0.0,
            "tool_calls": statistics.fmean(len(t.tool_calls) for t in trajectories) if n else 0.0,
            "response_tokens": statistics.fmean(len(t.response_ids) for t in trajectories) if n else 0.0,
            "episodes": float(n)}


def verdict(greedy: float, sampled: float, *, successes: float | None = None,
            temperature: float = 1.0) -> str:
    """One line: what the greedy and sampled accuracies say about an RL run from this model."""
    head = f"greedy {100 * greedy:.1f}%, sampled {100 * sampled:.1f}% (T={temperature:g})"
    if sampled == 0 and (successes is None or successes == 0) and greedy == 0:
        return (f"{head}: no sample succeeded: warm start longer (sft.steps), or with more demonstrations that "
                "use the tool (task.sft_tool_use_fraction): RL has no signal to learn from")
    if sampled >= 1.0 and greedy >= 1.0:
        return (f"{head}: every sample already succeeds: RL has nothing left to learn here (a harder task, "
                "or a shorter warm start)")
    if sampled < RARE:
        return (f"{head}: RL has a weak signal (most groups will score all-equal): consider a longer warm start, "
                "larger trainer.group_size or trainer.dynamic_sampling=true")
    return f"{head}: RL has a signal"


def evaluate(cfg: Any, model_dir: str | Path, *, n: int | None = None, temperature: float | None = None,
             device: str = "cpu") -> dict[str, Any]:
    """Greedy and sampled accuracy of `model_dir` on the first `n` validation instances of the task."""
    from hybridrl.envs.tasks import get_task

    task = get_task(cfg.task.name, cfg.task)
    instances = task.validation_split(n) if n else task.validation_split()
    sampled_t = cfg.agent.temperature if temperature is None else temperature
    started = time.perf_counter()
    greedy = summarize(run_episodes(cfg, model_dir, instances, temperature=0.0, group_id="eval-greedy",
                                    device=device))
    sampled = summarize(run_episodes(cfg, model_dir, instances, temperature=sampled_t, group_id="eval-sampled",
                                     device=device))
    return {"model": str(model_dir), "task": task.name, "instances": len(instances), "temperature": sampled_t,
            "greedy": greedy, "sampled": sampled, "seconds": time.perf_counter() - started,
            "verdict": verdict(greedy["accuracy"], sampled["accuracy"], successes=sampled["successes"],
                               temperature=sampled_t)}
