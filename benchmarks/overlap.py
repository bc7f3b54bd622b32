"""Overlap of generation and training in the disaggregated placement, measured honestly.

    python benchmarks/overlap.py --json runs/bench/overlap.json [--repeats 2] [--steps 8]

One workload, three ways, interleaved in one run (`--repeats` rounds, each running every variant):

    lag0        placement.mode=disaggregated, 1 training + 1 rollout rank, algo.max_policy_lag=0:
                a step's groups start only once the previous update is published, so the rollout
                rank waits for every update and the training rank for every rollout
    lag1        the same placement with algo.max_policy_lag=1: the next step's groups are generated
                (on the policy being trained) while this step trains
    colocated   the same 2 ranks colocated (both train, DP 2, and both generate, in turns)

The workload is the demo's base model widened to `--hidden` (random weights, so every episode is
one turn of `--tokens` tokens) on the calculator task, `--prompts` x `--group` episodes per step,
at most `--concurrency` at once; every trajectory is trained on (no group is dropped). A wider
model keeps both ranks compute-bound: at the demo's width (192) the two processes slow each other
down by 20-50% on this 2-core machine (measured), which no placement can overlap away. Before comparing, the benchmark prints how long
rollout and training take on their ranks in the lag-0 runs (the time the training rank waits
for its groups, and the update itself): the overlap can reach 2x only where they are similar.

Throughput: episodes of the steps after `--warmup` (but the last, whose row waits for the final
validation) divided by the wall time between their rows (`time/logged_at`), so everything between
steps counts. Medians over the repeats; the ratio
lag1 / lag0 is taken within each round. Every run's metrics stay under the JSON's directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridrl.demo import BASE_MODEL_ARGS  # noqa: E402  (the demo's base model)

RECIPE = ROOT / "recipes" / "calc_grpo_cpu.yaml"
VARIANTS = {
    "lag0": ["placement.mode=disaggregated", "algo.max_policy_lag=0"],
    "lag1": ["placement.mode=disaggregated", "algo.max_policy_lag=1"],
    "colocated": ["placement.mode=colocated"],
}


def run_variant(name: str, model: str, out: Path, args) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), "--overwrite", f"model.path={model}",
           f"run.dir={run_dir}", f"trainer.total_steps={args.steps}", "trainer.validate_every=0",
           "trainer.checkpoint_every=0", "trainer.export_hf=false", f"trainer.prompts_per_step={args.prompts}",
           f"trainer.group_size={args.group}", "algo.drop_all_equal_groups=false", "algo.drop_truncated=false",
           "agent.max_turns=1", f"agent.max_new_tokens_per_turn={args.tokens}",
           f"agent.max_response_tokens={args.tokens}", f"train.micro_batch_size={args.micro_batch}",
           f"agent.max_concurrent_episodes={args.concurrency}", "publish.parity_prompts=0", "store.enabled=false",
           "distributed.nproc_per_node=2", *VARIANTS[name],
           *args.overrides]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    # the last step's row is written after the final validation: its wall time is not the loop's
    measured = [r for r in steps if args.warmup < r["step"] < args.steps]
    first = next(r for r in steps if r["step"] == args.warmup)
    wall = measured[-1]["time/logged_at"] - first["time/logged_at"]
    episodes = sum(r["episodes"] for r in measured)
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in measured)  # noqa: E731
    return {"samples_per_s": episodes / wall, "wall_s": wall, "episodes": episodes, "run_s": time.perf_counter() - started,
            "step_s": med("time/step_s"), "T_train": med("time/T_train"), "T_rollout": med("time/T_rollout"),
            "T_sync": med("time/T_sync"), "trainer_wait_s": med("stream/trainer_wait_s"),
            "rollout_idle_s": med("stream/rollout_idle_s"), "lag_max": max(r.get("policy/lag_max") or 0 for r in measured),
            "lag1_trajectories": sum(r.get("lag/1") or 0 for r in measured), "gen_tokens_per_s": med("gen/tokens_per_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the measurement")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per episode (one turn)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=384, help="the model's hidden size (0: the demo's 192)")
    ap.add_argument("--concurrency", type=int, default=11,
                    help="agent.max_concurrent_episodes: with the defaults, rollout and training take about as long")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("overrides", nargs="*", help="more key=value overrides for every variant")
    args = ap.parse_args()
    out = Path(args.json).resolve().parent / "overlap-runs"
    out.mkdir(parents=True, exist_ok=True)
    model_args = list(BASE_MODEL_ARGS)
    if args.hidden:
        model_args[model_args.index("--hidden") + 1] = str(args.hidden)
    model = out / f"model-hidden{model_args[model_args.index('--hidden') + 1]}"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "hybridrl", "assets", "tiny-model", *model_args, "--out", str(model)],
                       check=True, capture_output=True)
    names = args.variants.split(",")
    load_before = os.getloadavg()
    rounds = []
    for i in range(args.repeats):
        result = {name: run_variant(name, str(model), out, args) for name in names}
        rounds.append(result)
        print(f"round {i + 1}: " + "  ".join(f"{n} {r['samples_per_s']:.1f}/s" for n, r in result.items()), flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    report = {"workload": {"model": " ".join(model_args), "overrides": args.overrides, "episodes_per_step": args.prompts * args.group,
                           "tokens_per_episode": args.tokens, "steps": args.steps, "warmup": args.warmup},
              "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "rounds": rounds,
              "median": {n: {k: median(n, k) for k in rounds[0][n]} for n in names}}
    if "lag0" in names:
        report["balance"] = {"rollout_s (lag0: the training rank's wait for its groups)": median("lag0", "trainer_wait_s"),
                             "train_s (lag0: the update on the training rank)": median("lag0", "T_train")}
    if {"lag0", "lag1"} <= set(names):
        ratios = [r["lag1"]["samples_per_s"] / r["lag0"]["samples_per_s"] for r in rounds]
        report["lag1_over_lag0"] = {"median": statistics.median(ratios), "per_round": ratios, "target": 1.6}
    if {"lag1", "colocated"} <= set(names):
        ratios = [r["lag1"]["samples_per_s"] / r["colocated"]["samples_per_s"] for r in rounds]
        report["lag1_over_colocated"] = {"median": statistics.median(ratios), "per_round": ratios}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
