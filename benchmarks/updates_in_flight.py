"""Weight updates without draining, in the real disaggregated placement: drain vs continue, interleaved.

    python benchmarks/updates_in_flight.py --json runs/bench/updates_in_flight.json [--repeats 2 --steps 6]

The trainer itself (`hybridrl train`, 1 training + 1 rollout rank, gloo, algo.max_policy_lag=1) on the
test recipe's tiny model with long turns (`--tokens` per turn, so that the next step's groups are still
running when the update is published), three ways in each round:

    drain       today: the groups running on the rollout rank end on their version, then the weights land
    continue    rollout.native.on_weight_update=continue, update_after_steps=0: the weights land between
                two engine steps as soon as they are staged (no request waits; timing-dependent)
    continue_k  the same, landing exactly `--after-steps` engine steps after the grant (reproducible; the
                engine waits at that step when the weights are late)

Per run, over the steps after the first (whose groups ran before any update) up to the last: admitted
action tokens/s (`tokens/admitted` over the wall time between their rows, `time/logged_at`), the rollout
idle share (`stream/rollout_idle_s`, time the rollout rank had no group running, over that wall time),
the engine's wait at the update (`engine/update_hold_s`), the KV computed again at updates
(`engine/update_recompute_tokens`, and its share of the tokens the engine computed). Medians over the
repeats. The parity probe is off in every variant (updates in flight skip it, so drain would pay for
work the others do not do).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"


def variants(after_steps: int) -> dict[str, list[str]]:
    return {"drain": [],
            "continue": ["rollout.native.on_weight_update=continue", "rollout.native.update_after_steps=0"],
            "continue_k": ["rollout.native.on_weight_update=continue",
                           f"rollout.native.update_after_steps={after_steps}"]}


def run_variant(name: str, extra: list[str], model: str, out: Path, args) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), "--overwrite", f"model.path={model}",
           f"run.dir={run_dir}", f"trainer.total_steps={args.steps}", "placement.mode=disaggregated",
           "placement.rollout_ranks=1", "algo.max_policy_lag=1", "publish.parity_prompts=0",
           "algo.kl_coef=0.01", "algo.kl_in=reward", "train.lr=1e-3", "train.lr_warmup_steps=0",
           f"agent.max_new_tokens_per_turn={args.tokens}", f"agent.max_response_tokens={2 * args.tokens}",
           f"trainer.prompts_per_step={args.prompts}", "store.enabled=false", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    from hybridrl.telemetry.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    window = rows[1:]                       # the first step's groups ran before any update
    wall = window[-1]["time/logged_at"] - rows[0]["time/logged_at"]
    computed = sum(r["engine/prefill_tokens"] + r["engine/decode_tokens"] for r in window)
    recompute = sum(r.get("engine/update_recompute_tokens", 0.0) for r in window)
    return {"wall_s": wall, "admitted_tokens": sum(r["tokens/admitted"] for r in window),
            "admitted_tokens_per_s": sum(r["tokens/admitted"] for r in window) / wall,
            "rollout_idle_share": sum(r["stream/rollout_idle_s"] for r in window) / wall,
            "trainer_wait_s": sum(r["stream/trainer_wait_s"] for r in window),
            "engine_update_hold_s": sum(r.get("engine/update_hold_s", 0.0) for r in window),
            "updates_mid_request": sum(r.get("engine/updates_mid_request", 0.0) for r in window),
            "recompute_tokens": recompute, "recompute_share": recompute / max(1.0, computed + recompute),
            "multi_version_episodes": sum(r["stream/multi_version_episodes"] for r in window)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4, help="groups per step (x the recipe's group size)")
    p.add_argument("--tokens", type=int, default=96, help="tokens per turn")
    p.add_argument("--after-steps", type=int, default=16, help="continue_k: engine steps from grant to update")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    out = Path(args.json).with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    model = str(build_tiny_model(out / "model", TinyModelSpec(arch="qwen2", init_std=0.05)))
    runs: dict[str, list[dict]] = {name: [] for name in variants(args.after_steps)}
    for r in range(args.repeats):                        # interleaved: the machine's load hits each alike
        for name, extra in variants(args.after_steps).items():
            runs[name].append(run_variant(name, extra, model, out / f"round{r}", args))
            x = runs[name][-1]
            print(f"round {r} {name}: {x['admitted_tokens_per_s']:.0f} admitted tokens/s, rollout idle "
                  f"{x['rollout_idle_share']:.1%}, engine wait at updates {x['engine_update_hold_s']:.2f}s", flush=True)
    keys = ("admitted_tokens_per_s", "rollout_idle_share", "trainer_wait_s", "engine_update_hold_s", "recompute_share")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    result = {"workload": {k: v for k, v in vars(args).items() if k != "json"}, "medians": med,
              "ratio_admitted_continue_over_drain": med["continue"]["admitted_tokens_per_s"]
              / med["drain"]["admitted_tokens_per_s"],
              "ratio_admitted_continue_k_over_drain": med["continue_k"]["admitted_tokens_per_s"]
              / med["drain"]["admitted_tokens_per_s"],
              "load_average": os.getloadavg(), "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
