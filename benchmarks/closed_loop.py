"""Closed-loop load test of `hybridrl plan`: run the configuration it recommends, compare with what it predicted.

    python benchmarks/closed_loop.py --workload stragglers --json OUT.json [--rounds 3]
    python benchmarks/closed_loop.py --workload demo --model runs/demo/sft/hf --json OUT.json [--rounds 3]

Every round, close together in time (the machine's load changes; a prediction is only as good as the
measurement it starts from):

    1. calibrate   the default configuration (colocated, synchronous, no lag filter) for a few steps
    2. plan        fit the workload of that run and simulate every candidate (hybridrl/cost/planner.py)
    3. run         the recommended configuration, and the default again, for the same number of steps
    4. compare     predicted vs measured admitted tokens/s (steps after the warm-up, before the last),
                   stage utilisation, queue depth, and the admitted distribution (length, reward,
                   task) against the launched one

Workloads:
    stragglers  benchmarks/stragglers.py's scripted heavy-tailed workload, in process: a batched
                scripted engine (fixed decode-step latency), one tool call per episode with a 10x
                tail, 15% of prompts reasoning 10x longer, a simulated update of --train-s seconds
                during which nothing generates; every returned trajectory is admitted unless
                max_policy_lag drops it. Candidates are colocated (one engine): sync, or partial
                with an oversample and a lag.
    demo        the demo's GRPO stage (recipes/calc_grpo_cpu.yaml from the demo's SFT model) through
                `hybridrl train` with validation, checkpoints and the export off; candidates
                colocated and disaggregated on its 2 ranks.

The JSON holds, per round, the plan's prediction and the measurement for the recommended and the
default configuration and their ratios; the summary takes medians over rounds. Heavy: run it with
`nice`; it records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.cost.fit import WARMUP, throughput_window, workload_from_episodes, workload_from_run  # noqa: E402
from hybridrl.cost.planner import plan  # noqa: E402
from hybridrl.cost.records import read_run, turn_events_of  # noqa: E402
from hybridrl.cost.simulate import Config  # noqa: E402
from hybridrl.cost.workload import MeasuredConfig, shape_of  # noqa: E402

RECIPE = ROOT / "recipes" / "calc_grpo_cpu.yaml"


def ks_statistic(a: list[float], b: list[float]) -> float | None:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    if not a or not b:
        return None
    xs = sorted(set(a) | set(b))
    sa, sb = sorted(a), sorted(b)

    def cdf(s, x):
        import bisect

        return bisect.bisect_right(s, x) / len(s)

    return max(abs(cdf(sa, x) - cdf(sb, x)) for x in xs)


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def distribution_check(launched: list[dict], admitted: list[dict]) -> dict:
    """Admitted vs launched: length and reward means, the length KS statistic, the task mix."""
    def mix(rows):
        c = Counter(r["task"] for r in rows)
        return {k: v / len(rows) for k, v in sorted(c.items())} if rows else {}

    la, ad = [r["length"] for r in launched], [r["length"] for r in admitted]
    out = {"launched": {"n": len(launched), "length_mean": _mean(la), "reward_mean": _mean([r["reward"] for r in launched]),
                        "task_mix": mix(launched)},
           "admitted": {"n": len(admitted), "length_mean": _mean(ad), "reward_mean": _mean([r["reward"] for r in admitted]),
                        "task_mix": mix(admitted)},
           "length_ks": ks_statistic(la, ad)}
    lm, am = out["launched"], out["admitted"]
    both = lm["length_mean"] and am["length_mean"]
    shift = abs(am["length_mean"] - lm["length_mean"]) / lm["length_mean"] if both else None
    out["length_mean_shift"] = shift
    rewards = am["reward_mean"] is not None and lm["reward_mean"] is not None
    out["reward_mean_shift"] = (am["reward_mean"] - lm["reward_mean"]) if rewards else None
    tasks = set(out["launched"]["task_mix"]) | set(out["admitted"]["task_mix"])
    out["task_mix_gap"] = max((abs(out["launched"]["task_mix"].get(t, 0) - out["admitted"]["task_mix"].get(t, 0))
                               for t in tasks), default=0.0)
    out["equal"] = bool(shift is not None and shift < 0.1 and (out["length_ks"] or 0) < 0.15 and out["task_mix_gap"] < 0.1
                        and abs(out["reward_mean_shift"] or 0) < 0.1)
    return out


# ---------------------------------------------------------------------------- the stragglers workload


class Stragglers:
    """benchmarks/stragglers.py's workload, one engine, any colocated configuration the planner names."""

    def __init__(self, args):
        from benchmarks.agent_loop import _tiny_tokenizer

        self.args, self.tokenizer = args, _tiny_tokenizer()
        self.drawn = 0
        self._scripts: dict[str, dict] = {}

    def run(self, cfg: Config, steps: int, seed: int) -> dict:
        from benchmarks.stragglers import _attempts, _prompt_draw, _setup, instances
        from hybridrl.agent.collector import PartialCollector
        from hybridrl.envs.tasks import get_task

        a = self.args
        engine, runner, box = _setup(a, self.tokenizer, seed)
        loop = asyncio.new_event_loop()
        task = get_task("calculator")
        collector = PartialCollector(runner, task, loop, group_size=cfg.group_size, sum_over_ranks=lambda v: v)
        rows, launched, admitted, groups = [], [], [], []
        version = 0
        last = dict(engine.stats())
        seen = 0            # requests recorded so far: each one's context is work for the scripted engine

        def task_of(t) -> str:        # the workload's two kinds of prompt: 10x longer reasoning or not
            return "long" if _prompt_draw(_question(self.tokenizer, t), "len") < a.tail else "short"

        try:
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                if cfg.rollout_mode == "sync":
                    new = instances(cfg.prompts_per_step, self.drawn)
                    self.drawn += len(new)
                    out = loop.run_until_complete(runner.run_attempts(_attempts(new, cfg.group_size, step), task=task))
                    depth = 0
                else:
                    new = instances(max(0, cfg.groups_in_flight - len(collector.pending_groups())), self.drawn)
                    self.drawn += len(new)
                    out, stats = collector.collect(_attempts(new, cfg.group_size, step), quorum=cfg.prompts_per_step,
                                                   poll_s=a.poll_s)
                    depth = stats.live + stats.waiting
                rollout_s = time.perf_counter() - t0
                launched += [self.scripted(inst, step) for inst in new for _ in range(cfg.group_size)]
                kept = [t for t in out if cfg.max_policy_lag < 0 or version - min(t.versions) <= cfg.max_policy_lag]
                tokens = sum(t.num_policy_tokens for t in kept)
                t1 = time.perf_counter()
                time.sleep(a.train_s)                                          # the update
                train_s = time.perf_counter() - t1
                t2 = time.perf_counter()
                version += 1
                loop.run_until_complete(engine.update_weights([], version))
                sync_s = time.perf_counter() - t2
                s = dict(engine.stats())
                context = sum(len(r.input_ids) for r in engine.requests[seen:])   # decoded and matched per request
                seen = len(engine.requests)
                rows.append({"step": step, "time/T_rollout": rollout_s, "time/T_train": train_s, "time/T_sync": sync_s,
                             "time/T_prep": 0.0, "time/T_store": 0.0, "time/step_s": time.perf_counter() - t0,
                             "time/logged_at": time.time(), "tokens/admitted": float(tokens),
                             "engine/steps": float(s["steps"] - last["steps"]),
                             "engine/step_time_s": s["busy_s"] - last["busy_s"],
                             "engine/decode_tokens": float(s["tokens"] - last["tokens"]),
                             "engine/prefill_tokens": float(context),
                             "queue_depth": float(depth), "episodes": float(len(out)), "admitted": float(len(kept))})
                last = s
                by_group: dict[str, list] = {}
                for t in out:
                    by_group.setdefault(t.group_id, []).append(t)
                for t in kept:
                    admitted.append({"length": t.num_policy_tokens, "reward": t.reward, "task": task_of(t), "step": step})
                groups += list(by_group.values())
        finally:
            collector.close()
            loop.run_until_complete(box.close())
            loop.close()
        return {"rows": rows, "groups": groups, "launched": launched, "admitted": admitted}

    def scripted(self, inst, step: int) -> dict:
        """What a launched episode of this prompt produces (its script): length, reward, kind of prompt."""
        from benchmarks.stragglers import _prompt_draw

        if inst.task_id not in self._scripts:
            q, a = inst.messages[0]["content"], self.args
            long = _prompt_draw(q, "len") < a.tail
            right = _prompt_draw(q, "ok") < (0.7 if long else 0.3)
            reply = " ".join(["hm"] * (a.long_tokens if long else a.short_tokens)) + f" <answer>{5 if right else 4}</answer>"
            enc = lambda text: len(self.tokenizer.encode(text, add_special_tokens=False)) + 1  # noqa: E731  (+ EOS)
            self._scripts[inst.task_id] = {"length": enc("<calc>2 + 3</calc>") + enc(reply), "reward": float(right),
                                           "task": "long" if long else "short"}
        return {**self._scripts[inst.task_id], "step": step}

    def measured_config(self) -> MeasuredConfig:
        a = self.args
        return MeasuredConfig(placement="colocated", world_size=1, rollout_ranks=1, rollout_mode="sync",
                              prompts_per_step=a.prompts, group_size=a.group_size, max_concurrent=4096,
                              drop_truncated=False, drop_all_equal_groups=False)

    def default(self) -> Config:
        a = self.args
        return Config(placement="colocated", train_ranks=1, rollout_ranks=1, rollout_mode="sync", max_policy_lag=-1,
                      prompts_per_step=a.prompts, group_size=a.group_size, max_concurrent=4096,
                      drop_truncated=False, drop_all_equal_groups=False)

    def workload(self, run: dict):
        groups = [[_shape(t) for t in g] for g in run["groups"]]
        return workload_from_episodes(groups, run["rows"], self.measured_config(), max_batch=256, name="stragglers")

    def measure(self, run: dict) -> dict:
        rows = run["rows"]
        tw = throughput_window(rows)
        window = [r for r in rows if tw["first_step"] <= r["step"] <= tw["last_step"]]
        wall = tw["wall_s"]
        launched = [x for x in run["launched"] if tw["first_step"] <= x["step"] <= tw["last_step"]]
        admitted = [x for x in run["admitted"] if tw["first_step"] <= x["step"] <= tw["last_step"]]
        return {**tw, "utilisation": {"rollout": sum(r["engine/step_time_s"] for r in window) / wall,
                                      "train": sum(r["time/T_train"] for r in window) / wall},
                "queue_depth": statistics.fmean(r["queue_depth"] for r in window),
                "distribution": distribution_check(launched, admitted)}


def _question(tokenizer, t) -> str:
    text = tokenizer.decode(t.prompt_ids)
    return text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0] if "<|im_start|>user\n" in text else text


def _shape(t):
    return shape_of(turn_events_of(t.metadata.get("trace", [])), len(t.prompt_ids), dict(t.timings), float(t.reward),
                    t.status.value, t.task_id, t.status.value == "truncated")


# ---------------------------------------------------------------------------- the demo workload


class Demo:
    """The demo's GRPO stage through `hybridrl train`, one run directory per run."""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.n = 0

    def _overrides(self, cfg: Config | None) -> list[str]:
        return [] if cfg is None else cfg.overrides()

    def run(self, cfg: Config | None, steps: int, seed: int) -> dict:
        self.n += 1
        run_dir = self.out / f"run{self.n:02d}"
        cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), "--overwrite", f"model.path={self.args.model}",
               f"run.dir={run_dir}", f"trainer.total_steps={steps}", "trainer.validate_every=0",
               "trainer.checkpoint_every=0", "trainer.export_hf=false", *self._overrides(cfg), *self.args.overrides]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return {"run_dir": str(run_dir), "seconds": time.perf_counter() - started, "overrides": self._overrides(cfg)}

    def default(self, w) -> Config:
        from hybridrl.cost.planner import default_config

        return default_config(w, w.measured.world_size)

    def workload(self, run: dict):
        return workload_from_run(read_run(run["run_dir"]))

    def measure(self, run: dict) -> dict:
        rec = read_run(run["run_dir"])
        tw = throughput_window(rec.rows)
        window = [r for r in rec.rows if tw["first_step"] <= r["step"] <= tw["last_step"]]
        wall, ranks = tw["wall_s"], rec.world_size
        disagg = rec.placement["mode"] == "disaggregated"
        engines = rec.placement["rollout_ranks"] if disagg else ranks
        trainers = ranks - engines if disagg else ranks
        depth = [float((r.get("partial/live_episodes") or 0) + (r.get("partial/waiting_episodes") or 0)
                       + (r.get("stream/running_episodes") or 0) + (r.get("stream/complete_waiting") or 0) * 0)
                 for r in window]
        steps = set(range(tw["first_step"], tw["last_step"] + 1))
        eps = [e for e in rec.episodes if e.step in steps]
        launched = [{"length": e.policy_tokens, "reward": e.reward, "task": _operation(e.task_id, e), "step": e.step}
                    for e in eps]
        admitted = [x for x, e in zip(launched, eps) if e.filter_reason is None]
        return {**tw, "utilisation": {
                    "rollout": sum(float(r.get("engine/step_time_s") or 0) for r in window) / (wall * engines),
                    "train": sum(float(r.get("time/T_train") or 0) for r in window) * trainers / (wall * trainers)},
                "queue_depth": statistics.fmean(depth) if depth else 0.0,
                "distribution": distribution_check(launched, admitted)}


def _operation(task_id: str, e) -> str:
    """A task family for the mix check: how the episode used the tool (the calculator task has one task)."""
    return "tool" if e.turns > 1 else "direct"


# ---------------------------------------------------------------------------- rounds


def _ratio(a, b):
    return a / b if a and b else None


def one_round(harness, args, seed: int, log) -> dict:
    steps = args.steps
    calib_steps = args.calibration_steps or steps
    if isinstance(harness, Stragglers):
        calib = harness.run(harness.default(), calib_steps, seed)
    else:
        calib = harness.run(None, calib_steps, seed)
    w = harness.workload(calib)
    w.overheads.validate_every = w.overheads.checkpoint_every = 0       # the closed-loop runs have neither
    placements = ("colocated",) if isinstance(harness, Stragglers) else ("colocated", "disaggregated")
    p = plan(w, placements=placements, steps=steps, warmup=WARMUP)
    rec_cfg = Config(**p["recommended"]["config"])
    default = harness.default() if isinstance(harness, Stragglers) else harness.default(w)
    d_pred = p["default"]["predicted"]
    runs = {}
    order = [("recommended", rec_cfg), ("default", default)]
    if seed % 2:
        order.reverse()                          # alternate which runs first
    for name, cfg in order:
        run = harness.run(cfg, steps, seed)
        runs[name] = harness.measure(run)
        if "run_dir" in run:
            runs[name]["run_dir"] = run["run_dir"]
    measured_calib = harness.measure(calib)
    out = {"seed": seed, "load_average": os.getloadavg(),
           "calibration": {"admitted_tokens_per_s": measured_calib["admitted_tokens_per_s"],
                           "step_s": measured_calib["step_s"], "rollout_factor": w.rollout_factor,
                           "engine": dataclasses.asdict(w.engine), "trainer": dataclasses.asdict(w.trainer)},
           "recommended": {"label": p["recommended"]["label"], "overrides": p["recommended"]["overrides"],
                           "is_default": p["recommended"]["is_default"],
                           "predicted": p["recommended"]["predicted"], "measured": runs["recommended"],
                           "measured_over_predicted": _ratio(runs["recommended"]["admitted_tokens_per_s"],
                                                             p["recommended"]["predicted"]["admitted_tokens_per_s"])},
           "default": {"label": p["default"]["label"], "predicted": d_pred, "measured": runs["default"],
                       "measured_over_predicted": _ratio(runs["default"]["admitted_tokens_per_s"],
                                                         d_pred["admitted_tokens_per_s"])},
           "candidates": p["candidates"]}
    out["recommended_over_default_measured"] = _ratio(runs["recommended"]["admitted_tokens_per_s"],
                                                      runs["default"]["admitted_tokens_per_s"])
    out["recommended_over_default_predicted"] = p["recommended"]["speedup_over_default"]
    log(f"round seed {seed}: recommended {out['recommended']['label']}: predicted "
        f"{p['recommended']['predicted']['admitted_tokens_per_s']:.0f}, measured "
        f"{runs['recommended']['admitted_tokens_per_s']:.0f} tokens/s (x{out['recommended']['measured_over_predicted']:.2f}); "
        f"default predicted {d_pred['admitted_tokens_per_s']:.0f}, measured {runs['default']['admitted_tokens_per_s']:.0f} "
        f"(x{out['default']['measured_over_predicted']:.2f}); load {out['load_average'][0]:.1f}")
    return out


def summarise(rounds: list[dict]) -> dict:
    def med(path):
        xs = [r for r in (_get(x, path) for x in rounds) if r is not None]
        return statistics.median(xs) if xs else None

    labels = Counter(r["recommended"]["label"] for r in rounds)
    s = {"recommended_labels": dict(labels),
         "recommended_measured_over_predicted": med("recommended.measured_over_predicted"),
         "default_measured_over_predicted": med("default.measured_over_predicted"),
         "recommended_over_default_measured": med("recommended_over_default_measured"),
         "recommended_over_default_predicted": med("recommended_over_default_predicted"),
         "recommended_predicted_tokens_per_s": med("recommended.predicted.admitted_tokens_per_s"),
         "recommended_measured_tokens_per_s": med("recommended.measured.admitted_tokens_per_s"),
         "default_predicted_tokens_per_s": med("default.predicted.admitted_tokens_per_s"),
         "default_measured_tokens_per_s": med("default.measured.admitted_tokens_per_s"),
         "admitted_distribution_equal_recommended": [r["recommended"]["measured"]["distribution"]["equal"] for r in rounds]}
    ratio = s["recommended_measured_over_predicted"]
    s["recommended_within_20_percent"] = ratio is not None and abs(ratio - 1) <= 0.2
    s["rounds_within_20_percent"] = sum(abs((r["recommended"]["measured_over_predicted"] or 0) - 1) <= 0.2
                                        for r in rounds)
    other = [r["recommended_over_default_measured"] for r in rounds
             if not r["recommended"]["is_default"] and r["recommended_over_default_measured"]]
    s["recommends_other_than_default"] = bool(other)
    s["other_choice_over_default_measured"] = statistics.median(other) if other else None
    s["other_choice_measures_faster"] = bool(other) and statistics.median(other) > 1.0
    return s


def _get(d, path):
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _plain(x):
    """JSON-able: numpy scalars to Python, non-finite floats to None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("stragglers", "demo"), required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="steps per run (the window: after 2, before the last)")
    p.add_argument("--calibration-steps", type=int, default=0,
                   help="steps of the calibration run (default --steps): a heavy tail needs a larger sample")
    p.add_argument("--model", default=str(ROOT / "runs" / "demo" / "sft" / "hf"), help="demo: the SFT model")
    # the stragglers workload's knobs (benchmarks/stragglers.py)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tail", type=float, default=0.15)
    p.add_argument("--short-tokens", type=int, default=24)
    p.add_argument("--long-tokens", type=int, default=240)
    p.add_argument("--tool-latency", type=float, default=0.02)
    p.add_argument("--step-latency", type=float, default=0.004)
    p.add_argument("--train-s", type=float, default=0.3)
    p.add_argument("--poll-s", type=float, default=0.01)
    p.add_argument("overrides", nargs="*", help="demo: more key=value overrides for every run")
    args = p.parse_args(argv)
    out_path = Path(args.json).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.workload == "stragglers":
        harness = Stragglers(args)
    else:
        if not (Path(args.model) / "config.json").exists():
            raise SystemExit(f"--model {args.model}: no HF model there (run `hybridrl demo` first)")
        harness = Demo(args, out_path.parent / "closed-loop-runs")
    load_before = os.getloadavg()
    rounds = [one_round(harness, args, seed, lambda s: print(s, flush=True)) for seed in range(args.rounds)]
    report = {"workload": args.workload, "args": {k: v for k, v in vars(args).items() if k != "json"},
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "summary": summarise(rounds), "rounds": rounds}
    out_path.write_text(json.dumps(_plain(report), indent=1))
    print(json.dumps(_plain(report["summary"]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
