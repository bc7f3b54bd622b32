"""Stragglers: synchronous collection vs partial rollouts on a heavy-tailed workload, side by side.

    python benchmarks/stragglers.py --json OUT.json [--repeats 3 --steps 8]
    python benchmarks/stragglers.py --stream --json OUT.json      # disaggregated: drain vs continue

Workload (scripted engine: `hybridrl.agent.testing.ScriptedEngine`, a batched engine whose decode
step takes `--step-latency` seconds whatever the batch; a colocated step = rollout, then a
simulated update of `--train-s` seconds during which nothing generates):
  - every episode makes one tool call, then answers after `--short-tokens` of reasoning; a
    fraction `--tail` of the prompts reason 10x longer (`--long-tokens`);
  - every tool call waits `--tool-latency` seconds, 10x longer with probability `--tail`;
  - `--prompts` groups of `--group-size` episodes per step.

    sync     each step launches `--prompts` groups and waits for every episode (the slowest one).
    partial  `ceil(prompts * oversample)` groups in flight; a step ends when `--prompts` groups are
             complete; the rest are interrupted at a token boundary and continue at the next step
             on the next version (`agent/collector.py`, the code the trainer runs).

The disaggregated placement on the same workload (`--stream`: one rollout "rank", the real producer of
`agent/producer.py` on a loop in a thread of its own, and the controller's sequence of
`StreamCollection` in the main thread, lag 1: publish (`--publish-s` on the wire), take step s, grant
step s+1, a `--train-s` update while step s+1 generates, then the counters are read):
    drain     today: the counters are read once nothing runs (the groups of step s+1 end on the version
              they started on), then the publication lands on an idle engine;
    continue  updates in flight (`rollout.native.on_weight_update=continue`): the publication lands on the
              running groups between two decode steps; each running request spends one step recomputing
              its prefix, then its tokens are a new segment of the new version.
Reported per stream mode: admitted action tokens/s, the rollout idle share (wall time the engine had no
request in flight, and time the producer had no group running), the trainer's wait, lag and the
multi-version trajectories.

The modes run interleaved (`--repeats` each, fresh engine each run); medians and their ratio.
Reported per mode: admitted action tokens/s (policy tokens of the trajectories a step returns,
per second of wall time: the effective yield), trained tokens/s under partial_policy=newest_segment
(older segments are context), rollout and trainer idle time, interrupted / continued episodes,
the lag histogram (versions between an admitted trajectory's oldest token and the update it
enters), the queue depth (episodes held across a step), launched-vs-admitted distributions of
length and reward (completion-time filtering prefers short episodes: see the admitted mean).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.agent.actions import ToolSpec  # noqa: E402
from hybridrl.agent.collector import PartialCollector  # noqa: E402
from hybridrl.agent.config import AgentConfig  # noqa: E402
from hybridrl.agent.loop import AgentRunner  # noqa: E402
from hybridrl.agent.testing import ScriptedEngine  # noqa: E402
from hybridrl.agent.tools.base import ToolBox, ToolResult  # noqa: E402
from hybridrl.envs.tasks import TaskInstance, get_task  # noqa: E402


class TailLatencyTool:
    """The `calculator` tool answering 5 after `base_s`, or 10x that with probability `tail`."""

    def __init__(self, base_s: float, tail: float, seed: int):
        self.base_s, self.tail, self.rng = base_s, tail, random.Random(seed)
        self.spec = ToolSpec("calculator", "slow calculator", {"type": "object", "properties": {
            "expression": {"type": "string"}}})

    async def __call__(self, arguments) -> ToolResult:
        await asyncio.sleep(self.base_s * (10 if self.rng.random() < self.tail else 1))
        return ToolResult("5", True)


def _prompt_draw(text: str, salt: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{salt}/{text}".encode()).digest()[:4], "little") / 2 ** 32


def responder(tokenizer, args):
    """Turn 0: a tool call; turn 1: reasoning of the prompt's length, then an answer (right or wrong
    by the prompt; long prompts are answered right more often, so that the admitted rewards show
    the bias of completion-time filtering)."""
    def respond(ids, turn):
        text = tokenizer.decode(ids)
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        if turn == 0:
            return "<calc>2 + 3</calc>"
        long = _prompt_draw(question, "len") < args.tail
        right = _prompt_draw(question, "ok") < (0.7 if long else 0.3)
        words = args.long_tokens if long else args.short_tokens
        return " ".join(["hm"] * words) + f" <answer>{5 if right else 4}</answer>"
    return respond


def instances(n: int, offset: int) -> list[TaskInstance]:
    return [TaskInstance(task="calculator", task_id=f"p{offset + i}", reference="5", tools=("calculator",),
                         messages=({"role": "user", "content": f"Problem {offset + i}: what is 2 + 3?"},),
                         metadata={}) for i in range(n)]


def _setup(args, tokenizer, seed):
    engine = ScriptedEngine(tokenizer, responder(tokenizer, args), step_latency_s=args.step_latency)
    cfg = AgentConfig(max_turns=3, max_new_tokens_per_turn=args.long_tokens * 2 + 64,
                      max_response_tokens=args.long_tokens * 3 + 256, max_concurrent_episodes=4096,
                      temperature=1.0, max_episode_s=3600.0)
    box = ToolBox([TailLatencyTool(args.tool_latency, args.tail, seed)])
    return engine, AgentRunner(engine, tokenizer, agent_cfg=cfg, tools=box, run_id="bench", seed=seed), box


def _attempts(insts, group_size, step):
    return [(inst, a, f"{inst.task_id}@{step}") for inst in insts for a in range(group_size)]


def run_mode(mode: str, args, tokenizer, seed: int) -> dict:
    engine, runner, box = _setup(args, tokenizer, seed)
    loop = asyncio.new_event_loop()
    task = get_task("calculator")
    collector = PartialCollector(runner, task, loop, group_size=args.group_size, sum_over_ranks=lambda v: v)
    in_flight = math.ceil(args.prompts * args.oversample)
    launched, admitted, lags, depth = [], [], Counter(), []
    rollout_s = train_s = 0.0
    version, drawn, interrupted = 0, 0, 0
    started = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            if mode == "sync":
                new = instances(args.prompts, drawn)
                drawn += len(new)
                out = loop.run_until_complete(runner.run_attempts(_attempts(new, args.group_size, step), task=task))
                launched += [len(new) * args.group_size]
            else:
                new = instances(max(0, in_flight - len(collector.pending_groups())), drawn)
                drawn += len(new)
                out, stats = collector.collect(_attempts(new, args.group_size, step), quorum=args.prompts,
                                               poll_s=args.poll_s)
                launched += [len(new) * args.group_size]
                interrupted += stats.interrupted
                depth.append(stats.live + stats.waiting)
            rollout_s += time.perf_counter() - t0
            for t in out:
                lags[version - min(t.versions)] += 1
            admitted += [(t, version) for t in out]
            t1 = time.perf_counter()
            time.sleep(args.train_s)                                  # the update (colocated: nothing generates)
            version += 1
            loop.run_until_complete(engine.update_weights([], version))   # the next version is published
            train_s += time.perf_counter() - t1
        wall = time.perf_counter() - started
        unfinished = len(collector.live) + sum(len(m) for m in collector.members.values())
    finally:
        collector.close()
        loop.run_until_complete(box.close())
        loop.close()
    trajs = [t for t, _ in admitted]
    tokens = sum(t.num_policy_tokens for t in trajs)
    newest = sum(sum(1 for v, m in zip(t.policy_versions, t.response_mask) if m and v == max(t.versions))
                 for t in trajs)
    lengths = [t.num_policy_tokens for t in trajs]
    return {"wall_s": wall, "admitted_tokens": tokens, "admitted_tokens_per_s": tokens / wall,
            "trained_tokens_newest_segment_per_s": newest / wall,
            "admitted_episodes": len(trajs), "launched_episodes": sum(launched),
            "unfinished_at_end": unfinished if mode == "partial" else 0,
            "rollout_s": rollout_s, "train_s": train_s,
            "rollout_idle_s": train_s,        # colocated: the engine sleeps while the trainer works
            "trainer_idle_s": rollout_s,      # ... and the trainer waits for the rollout
            "interrupted_requests": interrupted,
            "continued_episodes": sum(1 for t in trajs if t.metadata.get("interruptions")),
            "lag_histogram": {str(k): v for k, v in sorted(lags.items())},
            "queue_depth_per_step": depth,
            "admitted_length": _dist(lengths),
            "admitted_reward_mean": statistics.fmean(t.reward for t in trajs) if trajs else None}


def run_stream(mode: str, args, tokenizer, seed: int) -> dict:
    """The disaggregated placement at lag 1, drain or continue (see the module doc)."""
    from hybridrl.agent.producer import LoopThread, Producer

    engine, runner, box = _setup(args, tokenizer, seed)
    engine.continue_on_update = mode == "continue"
    engine.abort_on_update = False
    threads = LoopThread(name="bench-rollout")
    producer = Producer(runner, get_task("calculator"), threads.loop)
    groups = {step: [_attempts([inst], args.group_size, step) for inst in instances(args.prompts, (step - 1) * args.prompts)]
              for step in range(1, args.steps + 2)}
    admitted, lags, version, waited = [], Counter(), 0, 0.0
    started = time.perf_counter()
    try:
        producer.grant(groups[1], floor=0)
        for step in range(1, args.steps + 1):
            if engine.policy_version != version:                          # publish: the weights on the wire,
                time.sleep(args.publish_s)                                 # the engine drained or generating
                threads.run(engine.update_weights([], version))
            t0 = time.perf_counter()
            out = producer.take([g[0][2] for g in groups[step]])             # take: the trainer waits here
            waited += time.perf_counter() - t0
            producer.grant(groups[step + 1], floor=version) if step < args.steps else None
            for t in out:
                lags[version - min(t.versions)] += 1
            admitted += out
            time.sleep(args.train_s)                                       # the update, while step s+1 generates
            t0 = time.perf_counter()
            if mode == "drain":
                producer.quiesce()                                         # the counters, once nothing runs
            waited += time.perf_counter() - t0
            version += 1
        wall = time.perf_counter() - started
        stats = producer.stats()
        busy = engine.stats()["busy_s"]
    finally:
        threads.run(box.close())
        threads.stop()
    tokens = sum(t.num_policy_tokens for t in admitted)
    return {"wall_s": wall, "admitted_tokens": tokens, "admitted_tokens_per_s": tokens / wall,
            "admitted_episodes": len(admitted), "rollout_idle_share": 1.0 - busy / wall,
            "producer_idle_share": stats["idle_s"] / wall, "trainer_wait_s": waited,
            "multi_version_episodes": sum(len(t.versions) > 1 for t in admitted),
            "lag_histogram": {str(k): v for k, v in sorted(lags.items())},
            "admitted_length": _dist([t.num_policy_tokens for t in admitted])}


def _dist(xs):
    if not xs:
        return None
    s = sorted(xs)
    return {"n": len(s), "mean": statistics.fmean(s), "p50": s[len(s) // 2], "p90": s[int(len(s) * 0.9)],
            "max": s[-1]}


def launched_distribution(args, tokenizer) -> dict:
    """The length / reward every launched prompt would have (its scripted script): the workload itself."""
    task_lengths, rewards = [], []
    tail = 0
    for inst in instances(args.prompts * args.steps * 2, 0):
        q = inst.messages[0]["content"]
        long = _prompt_draw(q, "len") < args.tail
        tail += long
        words = args.long_tokens if long else args.short_tokens
        reply = " ".join(["hm"] * words) + " <answer>5</answer>"
        task_lengths.append(len(tokenizer.encode(reply, add_special_tokens=False)) + 1
                            + len(tokenizer.encode("<calc>2 + 3</calc>", add_special_tokens=False)) + 1)
        rewards.append(float(_prompt_draw(q, "ok") < (0.7 if long else 0.3)))
    return {"length": _dist(task_lengths), "reward_mean": statistics.fmean(rewards),
            "tail_fraction": tail / len(task_lengths)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="groups per step (the quorum of partial)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--oversample", type=float, default=2.0)
    p.add_argument("--tail", type=float, default=0.15, help="fraction of long prompts and of slow tool calls")
    p.add_argument("--short-tokens", type=int, default=24)
    p.add_argument("--long-tokens", type=int, default=240)
    p.add_argument("--tool-latency", type=float, default=0.02)
    p.add_argument("--step-latency", type=float, default=0.004)
    p.add_argument("--train-s", type=float, default=0.3)
    p.add_argument("--poll-s", type=float, default=0.01)
    p.add_argument("--publish-s", type=float, default=0.2,
                   help="--stream: seconds a publication takes to reach the rollout rank")
    p.add_argument("--stream", action="store_true",
                   help="compare the disaggregated placement's drain with updates in flight (continue) instead")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from benchmarks.agent_loop import _tiny_tokenizer

    tokenizer = _tiny_tokenizer()
    if args.stream:
        return stream_main(args, tokenizer)
    runs: dict[str, list[dict]] = {"sync": [], "partial": []}
    for r in range(args.repeats):                        # interleaved: the machine's load hits both alike
        for mode in ("sync", "partial"):
            runs[mode].append(run_mode(mode, args, tokenizer, seed=r))
            print(f"repeat {r} {mode}: {runs[mode][-1]['admitted_tokens_per_s']:.0f} admitted tokens/s", flush=True)
    med = {m: statistics.median(x["admitted_tokens_per_s"] for x in runs[m]) for m in runs}
    trained = {m: statistics.median(x["trained_tokens_newest_segment_per_s"] for x in runs[m]) for m in runs}
    result = {"workload": {k: v for k, v in vars(args).items() if k != "json"},
              "launched_workload": launched_distribution(args, tokenizer),
              "median_admitted_tokens_per_s": med,
              "ratio_admitted_partial_over_sync": med["partial"] / med["sync"],
              "median_trained_tokens_per_s": trained,
              "ratio_trained_partial_over_sync": trained["partial"] / trained["sync"],
              "runs": runs}
    return report(result, args.json)


def report(result: dict, json_path: str | None) -> int:
    """The load average beside the result; the result without its runs on stdout, whole in `json_path`."""
    try:
        import os
        result["load_average"] = os.getloadavg()
    except OSError:
        pass
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def stream_main(args, tokenizer) -> int:
    runs: dict[str, list[dict]] = {"drain": [], "continue": []}
    for r in range(args.repeats):                        # interleaved: the machine's load hits both alike
        for mode in runs:
            runs[mode].append(run_stream(mode, args, tokenizer, seed=r))
            x = runs[mode][-1]
            print(f"repeat {r} {mode}: {x['admitted_tokens_per_s']:.0f} admitted tokens/s, rollout idle "
                  f"{x['rollout_idle_share']:.1%}", flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in
               ("admitted_tokens_per_s", "rollout_idle_share", "producer_idle_share", "trainer_wait_s")} for m in runs}
    result = {"workload": {k: v for k, v in vars(args).items() if k != "json"},
              "medians": med,
              "ratio_admitted_continue_over_drain": med["continue"]["admitted_tokens_per_s"]
              / med["drain"]["admitted_tokens_per_s"],
              "runs": runs}
    return report(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
