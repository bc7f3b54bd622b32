"""The OpenAI-compatible gateway's cost, side by side with what it replaces, interleaved in one run.

    python benchmarks/gateway.py overhead --json runs/bench/gateway_overhead.json [--agents 64] [--turns 4]
                                          [--max-tokens 16] [--repeats 4] [--model DIR] [--driver loop|thread]
    python benchmarks/gateway.py step --json runs/bench/gateway_step.json --model runs/demo/sft/hf
                                      [--steps 6] [--repeats 3]

`overhead`: `--agents` concurrent agents, each a multi-turn conversation of `--turns` requests of
`--max-tokens` tokens (greedy), on one native engine: once calling `engine.generate` with token ids
(the context grown by the template's delta, as the built-in loop does), once as OpenAI-client agents
through the gateway (chat template, token capture, HTTP over the Unix socket, the client's parsing).
Both modes do the same shape of work (greedy turns of at most `--max-tokens`; an EOS may end one early,
`tokens_per_request` says how many each mode generated); each (repeat, mode) has its own questions so
neither reuses the other's prefix cache; the modes alternate order every repeat. Reports per-request
latency medians (p10, p90) per mode, the gateway's added median (gateway - direct) per repeat, its median
and spread over the repeats and over all requests pooled, and requests/s.

`step`: the demo's GRPO recipe (`recipes/calc_grpo_cpu.yaml`, the built-in agent loop) against the same
work written as an OpenAI-client agent (`recipes/calc_grpo_agent_cpu.yaml`), `--steps` steps each from
the same model (no validation or checkpoints), alternating; reports the median step time (steps after
the first) and stage times per recipe, and the ratio agent / built-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridrl.demo import BASE_MODEL_ARGS  # noqa: E402  (the demo's base model)


# ---------------------------------------------------------------------------------------------------------
# overhead


def questions(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"What is {rng.randint(100, 999)} * {rng.randint(100, 999)}?" for _ in range(n)]


async def direct(engine, chat, prompts: list[str], turns: int, max_tokens: int, tag: str) -> tuple[list, list]:
    """Per-request latencies (s) and completion tokens of agents calling the engine with token ids."""
    from hybridrl.rollout.protocol import SamplingParams

    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    latencies: list[float] = []
    tokens: list[int] = []

    async def agent(i: int, prompt: str) -> None:
        ids = chat.prompt_ids([{"role": "user", "content": prompt}])
        for turn in range(turns):
            t0 = time.perf_counter()
            out = await engine.generate(ids, sampling, f"{tag}-{i}-{turn}")
            latencies.append(time.perf_counter() - t0)
            tokens.append(len(out.token_ids))
            ended = bool(out.token_ids) and out.token_ids[-1] in chat.eos_ids
            ids = ids + out.token_ids + chat.observation_ids([{"role": "user", "content": "Next."}], after_eos=ended)

    await asyncio.gather(*[agent(i, p) for i, p in enumerate(prompts)])
    return latencies, tokens


async def through_gateway(runner, task, prompts: list[str], turns: int, max_tokens: int) -> tuple[list, list]:
    """The same for OpenAI-client agents through the gateway (the client's own parsing included)."""
    from hybridrl.data.episode import TaskInstance

    latencies: list[float] = []
    tokens: list[int] = []

    async def agent(client, instance):
        messages = [dict(m) for m in instance.messages]
        for _ in range(turns):
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
            latencies.append(time.perf_counter() - t0)
            tokens.append(reply.usage.completion_tokens)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Next."}]
        return 0.0

    runner.agent = agent
    instances = [TaskInstance(task="calculator", task_id=f"q{i}", messages=({"role": "user", "content": p},),
                              reference="0") for i, p in enumerate(prompts)]
    trajs = await runner.run(instances, task=task)
    bad = [t.metadata.get("end_reason") for t in trajs if t.status.value != "completed"]
    if bad:
        raise SystemExit(f"gateway episodes did not run cleanly: {bad[:3]}")
    return latencies, tokens


def overhead(args) -> dict:
    from transformers import AutoTokenizer

    from hybridrl.agent.chat import ChatFormat
    from hybridrl.agent.config import AgentConfig, ToolsConfig
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    from hybridrl.envs.tasks import get_task
    from hybridrl.gateway.config import GatewayConfig
    from hybridrl.gateway.runner import GatewayRunner

    engine = NativeEngine.from_pretrained(args.model, NativeEngineConfig(kv_cache_mb=256, max_num_seqs=args.agents,
                                                                         driver=args.driver), device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    chat = ChatFormat(tokenizer, eos_token_ids=engine.eos_token_ids)
    agent_cfg = AgentConfig(max_turns=args.turns + 1, max_new_tokens_per_turn=args.max_tokens + 1,
                            max_response_tokens=100_000, max_episode_s=3600, temperature=0.0,
                            max_concurrent_episodes=args.agents)
    task = get_task("calculator")
    per_repeat: list[dict] = []

    async def go():
        runner = GatewayRunner(engine, tokenizer, agent_cfg=agent_cfg, gateway_cfg=GatewayConfig(),
                               tools=ToolBox(cfg=ToolsConfig(kill_switch="", audit_log="")), run_id="bench",
                               agent=lambda client, instance: None)
        await runner.start()
        await direct(engine, chat, questions(-1, 4), 1, args.max_tokens, "warm")          # warm-up, both paths
        await through_gateway(runner, task, questions(-2, 4), 1, args.max_tokens)
        for rep in range(args.repeats):
            row: dict = {"load_avg_1m": os.getloadavg()[0]}
            for mode in (("direct", "gateway") if rep % 2 == 0 else ("gateway", "direct")):
                prompts = questions(2 * rep + (mode == "gateway"), args.agents)
                t0 = time.perf_counter()
                lat, toks = (await direct(engine, chat, prompts, args.turns, args.max_tokens, f"r{rep}")
                             if mode == "direct" else await through_gateway(runner, task, prompts, args.turns,
                                                                            args.max_tokens))
                wall = time.perf_counter() - t0
                row[mode] = {"median_ms": 1e3 * statistics.median(lat), "p10_ms": 1e3 * _quantile(lat, 0.1),
                             "p90_ms": 1e3 * _quantile(lat, 0.9), "requests": len(lat),
                             "requests_per_s": len(lat) / wall, "tokens_per_request": statistics.fmean(toks),
                             "latencies_ms": [1e3 * x for x in lat]}
            row["added_median_ms"] = row["gateway"]["median_ms"] - row["direct"]["median_ms"]
            per_repeat.append(row)
            print(f"repeat {rep}: direct {row['direct']['median_ms']:.1f} ms, gateway {row['gateway']['median_ms']:.1f} "
                  f"ms (+{row['added_median_ms']:.2f} ms), load {row['load_avg_1m']:.1f}", flush=True)
        await runner.close()

    try:
        asyncio.run(go())
    finally:
        engine.close()
    pooled = {m: [x for r in per_repeat for x in r[m].pop("latencies_ms")] for m in ("direct", "gateway")}
    med = {m: statistics.median(v) for m, v in pooled.items()}
    added = [r["added_median_ms"] for r in per_repeat]
    tokens = {m: statistics.fmean(r[m]["tokens_per_request"] for r in per_repeat) for m in ("direct", "gateway")}
    return {"benchmark": "gateway overhead", "model": args.model, "driver": args.driver, "agents": args.agents,
            "turns": args.turns, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "median_ms": med, "added_median_ms": med["gateway"] - med["direct"],
            "added_median_ms_per_repeat": added, "added_median_ms_median_of_repeats": statistics.median(added),
            "added_median_ms_spread": [min(added), max(added)],
            # the modes' work: greedy turns of at most --max-tokens, ended early by EOS (different questions)
            "tokens_per_request": tokens,
            "target_added_ms": 5.0, "target_met": statistics.median(added) <= 5.0, "per_repeat": per_repeat}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------------------------------------------------
# step time


RECIPES = {"builtin": ROOT / "recipes" / "calc_grpo_cpu.yaml", "agent": ROOT / "recipes" / "calc_grpo_agent_cpu.yaml"}
STAGES = ("rollout", "reward", "prep", "train", "sync")


def one_run(recipe: Path, model: str, steps: int, run_dir: Path, overrides: list[str]) -> dict:
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "hybridrl", "train", str(recipe), f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.validate_every=0", "trainer.checkpoint_every=0",
           "trainer.export_hf=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe.name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["step"] >= 2 and "time/step_s" in r]
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in measured)  # noqa: E731
    return {"step_s": med("time/step_s"), "stage_times": {f"T_{s}": med(f"time/T_{s}") for s in STAGES},
            "reward_mean": statistics.fmean(r["reward/mean"] for r in measured), "steps_measured": len(measured),
            "load_avg_1m": [load, os.getloadavg()[0]]}


def step(args) -> dict:
    runs: dict[str, list[dict]] = {"builtin": [], "agent": []}
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-step-") as tmp:
        for rep in range(args.repeats):
            for side in (("builtin", "agent") if rep % 2 == 0 else ("agent", "builtin")):
                r = one_run(RECIPES[side], args.model, args.steps, Path(tmp) / f"{side}{rep}", args.overrides)
                runs[side].append(r)
                print(f"repeat {rep} {side}: step {r['step_s']:.3f}s  T_rollout {r['stage_times']['T_rollout']:.3f}s  "
                      f"load {r['load_avg_1m'][0]:.1f}", flush=True)
    med = {side: {"step_s": statistics.median(r["step_s"] for r in rs),
                  **{k: statistics.median(r["stage_times"][k] for r in rs) for k in rs[0]["stage_times"]}}
           for side, rs in runs.items()}
    paired = [a["step_s"] / b["step_s"] for a, b in zip(runs["agent"], runs["builtin"])]
    return {"benchmark": "gateway step time", "model": args.model, "steps": args.steps, "repeats": args.repeats,
            "overrides": args.overrides, "median": med, "ratio_step_agent_over_builtin": med["agent"]["step_s"]
            / med["builtin"]["step_s"], "ratio_per_repeat": paired, "target_ratio": 1.3, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--json", required=True)
    o.add_argument("--agents", type=int, default=64)
    o.add_argument("--turns", type=int, default=4)
    o.add_argument("--max-tokens", type=int, default=16)
    o.add_argument("--repeats", type=int, default=4)
    o.add_argument("--model", default=None, help="HF directory (default: the demo's base model, built for the run)")
    o.add_argument("--driver", default="loop", choices=("loop", "thread"), help="the native engine's driver")
    s = sub.add_parser("step")
    s.add_argument("--json", required=True)
    s.add_argument("--model", required=True, help="the warm start both recipes train from (runs/demo/sft/hf)")
    s.add_argument("--steps", type=int, default=6)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("overrides", nargs="*", help="overrides for both recipes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-bench-") as tmp:
        if args.what == "overhead" and args.model is None:
            args.model = str(Path(tmp) / "model")
            subprocess.run([sys.executable, "-m", "hybridrl", "assets", "tiny-model", *BASE_MODEL_ARGS, "--out",
                            args.model], check=True, capture_output=True, cwd=ROOT)
        result = overhead(args) if args.what == "overhead" else step(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_repeat", "runs")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
