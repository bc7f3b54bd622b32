"""Agent-loop overlap benchmark: do episodes keep the engine busy while tools wait?

    python benchmarks/agent_loop.py --engine scripted --json OUT.json
    python benchmarks/agent_loop.py --engine native --model DIR --json OUT.json
    python benchmarks/agent_loop.py --tool sandbox ...     # the 200 ms tool runs in the Python sandbox

Workload: `--episodes` calculator episodes, each making `--tool-calls` calls to a tool that
takes `--tool-latency` seconds, then answering. The same workload runs twice, side by side in
one process: concurrently (`--concurrency` episodes in flight) and sequentially (one at a
time). Printed and written as JSON: episodes, wall_s, sequential_s, speedup,
engine_busy_fraction (wall time with at least one generate request in flight / wall time),
tokens, statuses, per-episode latency percentiles, sandbox stats.

Engines: `scripted` (hybridrl.agent.testing.ScriptedEngine: a batched engine replaying a perfect
tool-using agent, `--step-latency` per decode step); `native` (the built-in torch engine on a
tiny model; its text is not a tool-using policy, so tool calls follow a fixed schedule: every
turn calls the tool until `--tool-calls` calls were made, then the episode answers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.agent.actions import ActionParser, ParsedTurn, ToolCall, ToolSpec  # noqa: E402
from hybridrl.agent.config import AgentConfig, ToolsConfig  # noqa: E402
from hybridrl.agent.loop import AgentRunner  # noqa: E402
from hybridrl.agent.testing import ScriptedEngine, SleepTool  # noqa: E402
from hybridrl.agent.tools.base import ToolBox, ToolResult  # noqa: E402
from hybridrl.envs.tasks import TaskInstance, get_task  # noqa: E402
from hybridrl.envs.tasks.calculator import CalculatorTask  # noqa: E402


class SandboxSleepTool:
    """The slow tool, run as a Python program in the sandbox pool (includes its overhead)."""

    def __init__(self, pool, latency_s: float):
        self.pool, self.latency_s = pool, latency_s
        self.spec = ToolSpec("sleep", "sleep in the sandbox", {"type": "object", "properties": {
            "text": {"type": "string"}}})

    async def __call__(self, arguments) -> ToolResult:
        r = await self.pool.run(f"import time\ntime.sleep({self.latency_s})\nprint('done')")
        return ToolResult(r.stdout, r.ok, None if r.ok else str(r.limit_hit),
                          infra_error=r.setup_error is not None)


class _ScheduleParser:
    """One per episode: the first `calls` turns call the sleep tool, then the episode answers."""

    def __init__(self, calls: int):
        self.left = calls

    def parse(self, text: str) -> ParsedTurn:
        if self.left > 0:
            self.left -= 1
            return ParsedTurn(calls=(ToolCall("sleep", {"text": "x"}, "<scheduled>", "json"),))
        return ParsedTurn(answer="0", num_answers=1)


class BenchTask(CalculatorTask):
    """The calculator task with the sleep tool allowed (and optionally the scheduled parser)."""

    schedule_calls: int | None = None

    def parser(self):
        return _ScheduleParser(self.schedule_calls) if self.schedule_calls is not None else ActionParser(["json"])


def oracle(tokenizer, calls: int):
    """A perfect agent for the scripted engine: `calls` JSON sleep calls, then the right answer."""
    from hybridrl.envs.arithmetic import evaluate, format_value

    def respond(ids, turn):
        if turn < calls:
            return "<tool_call>{\"name\": \"sleep\", \"arguments\": {}}</tool_call>"
        question = re.findall(r"What is (.*)\?", tokenizer.decode(ids))[-1]
        return f"<answer>{format_value(evaluate(question))}</answer>"

    return respond


def make_engine(args, tokenizer):
    if args.engine == "scripted":
        return ScriptedEngine(tokenizer, oracle(tokenizer, args.tool_calls), step_latency_s=args.step_latency)
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    return NativeEngine.from_pretrained(args.model, NativeEngineConfig(), device="cpu")


async def run_once(args, tokenizer, instances, task, concurrency: int) -> dict:
    engine = make_engine(args, tokenizer)
    pool = None
    if args.tool == "sandbox":
        from hybridrl.agent.sandbox.pool import SandboxPool

        pool = SandboxPool(ToolsConfig(pool_size=args.sandbox_pool, warm=min(4, args.sandbox_pool)))
        await pool.start()
        tool = SandboxSleepTool(pool, args.tool_latency)
    else:
        tool = SleepTool(args.tool_latency)
    box = ToolBox([tool], pool=pool)
    cfg = AgentConfig(max_turns=args.tool_calls + 1, max_new_tokens_per_turn=args.max_new_tokens,
                      max_response_tokens=(args.tool_calls + 1) * (args.max_new_tokens + 32),
                      max_concurrent_episodes=concurrency, temperature=1.0, max_episode_s=600.0)
    runner = AgentRunner(engine, tokenizer, agent_cfg=cfg, tools=box, run_id="bench", seed=args.seed)
    try:
        t0 = time.perf_counter()
        trajs = await runner.run(instances, task=task)
        wall = time.perf_counter() - t0
    finally:
        await box.close()
    stats = runner.stats(wall)
    statuses: dict[str, int] = {}
    for t in trajs:
        key = t.status.value + (f"/{t.truncation.value}" if t.truncation else "")
        statuses[key] = statuses.get(key, 0) + 1
    totals = sorted(t.timings["total_s"] for t in trajs)
    return {"wall_s": wall, "engine_busy_fraction": stats["engine_busy_fraction"],
            "engine_tokens": stats["engine_tokens"], "statuses": statuses,
            "tool_calls": sum(len(t.tool_calls) for t in trajs),
            "mean_reward": statistics.fmean(t.reward for t in trajs),
            "episode_s_p50": totals[len(totals) // 2], "episode_s_p90": totals[int(len(totals) * 0.9)],
            "sandbox": stats["tools"].get("sandbox")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["scripted", "native"], default=None,
                   help="default: native when hybridrl.backends.native exists, else scripted")
    p.add_argument("--model", default=None, help="HF model dir for --engine native (default: a tiny model)")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--tool-calls", type=int, default=3)
    p.add_argument("--tool-latency", type=float, default=0.2)
    p.add_argument("--tool", choices=["sleep", "sandbox"], default="sleep")
    p.add_argument("--sandbox-pool", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--step-latency", type=float, default=0.002,
                   help="scripted engine: seconds per decode step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sequential", action="store_true",
                   help="skip the sequential run (speedup is then null)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if args.engine is None:
        try:
            import hybridrl.backends.native  # noqa: F401

            args.engine = "native"
        except ImportError:
            args.engine = "scripted"
    if args.engine == "native" and args.model is None:
        from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

        args.model = str(build_tiny_model(ROOT / "runs" / "bench-tiny-qwen2", TinyModelSpec()))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else _tiny_tokenizer()
    task = BenchTask(get_task("calculator").cfg)
    if args.engine == "native":
        task.schedule_calls = args.tool_calls
    instances = [TaskInstance(task=i.task, task_id=i.task_id, messages=i.messages, reference=i.reference,
                              tools=("sleep",), metadata=i.metadata)
                 for i in task.train_split(args.episodes, seed=args.seed)]

    concurrent = asyncio.run(run_once(args, tokenizer, instances, task, args.concurrency))
    sequential = None if args.no_sequential else asyncio.run(run_once(args, tokenizer, instances, task, 1))
    result = {
        "engine": args.engine, "tool": args.tool, "episodes": args.episodes, "tool_calls_per_episode": args.tool_calls,
        "tool_latency_s": args.tool_latency, "concurrency": args.concurrency,
        "wall_s": round(concurrent["wall_s"], 3),
        "sequential_s": round(sequential["wall_s"], 3) if sequential else None,
        "speedup": round(sequential["wall_s"] / concurrent["wall_s"], 2) if sequential else None,
        "tool_time_floor_s": args.episodes * args.tool_calls * args.tool_latency,
        "engine_busy_fraction": round(concurrent["engine_busy_fraction"], 3),
        "sequential_engine_busy_fraction": round(sequential["engine_busy_fraction"],
                                                 3) if sequential else None,
        "tokens": concurrent["engine_tokens"], "tokens_per_s": round(concurrent["engine_tokens"] / concurrent["wall_s"], 1),
        "tool_calls": concurrent["tool_calls"], "statuses": concurrent["statuses"],
        "mean_reward": concurrent["mean_reward"],
        "episode_s_p50": round(concurrent["episode_s_p50"],
                               3), "episode_s_p90": round(concurrent["episode_s_p90"], 3),
        "sandbox": concurrent["sandbox"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _tiny_tokenizer():
    """The tiny models' tokenizer, built once under runs/ (no model weights needed)."""
    from transformers import AutoTokenizer

    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    path = ROOT / "runs" / "bench-tiny-qwen2"
    if not (path / "tokenizer.json").exists():
        build_tiny_model(path, TinyModelSpec())
    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    sys.exit(main())
