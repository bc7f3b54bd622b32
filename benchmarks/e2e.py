"""End-to-end throughput of the RL loop on a recipe (the CPU demo recipe by default).

    python benchmarks/e2e.py --json runs/bench/e2e.json [--recipe recipes/calc_grpo_cpu.yaml]
                             [--model DIR] [--steps 6]

Runs `hybridrl train` for a few steps (no validation or checkpoints in between) and reports the
medians over the steps after the first (warm-up): samples/s, the stage times T_rollout, T_reward,
T_prep, T_train, T_sync (the terms of one update's wall time), generation tokens/s, and the effective yield Y.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridrl.demo import build_base_model  # noqa: E402  (the demo's base model)

STAGES = ("rollout", "reward", "prep", "train", "sync")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "calc_grpo_cpu.yaml"))
    ap.add_argument("--model", default=None, help="HF directory (default: the demo's base model, built for the run)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrl-e2e-") as tmp:
        model = args.model or build_base_model(Path(tmp) / "model")
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "hybridrl", "train", args.recipe, f"model.path={model}", f"run.dir={run_dir}",
               f"trainer.total_steps={args.steps}", "trainer.validate_every=0", "trainer.checkpoint_every=0",
               "trainer.export_hf=false", "algo.drop_all_equal_groups=false", *args.overrides]
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0:
            return proc.returncode
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 2 and "time/step_s" in r] or [r for r in rows if "time/step_s" in r]
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in steps)  # noqa: E731
    result = {
        "recipe": args.recipe, "steps_measured": len(steps),
        "samples_per_s": statistics.median(r["episodes"] / r["time/step_s"] for r in steps),
        "step_s": med("time/step_s"),
        "stage_times": {f"T_{s}": med(f"time/T_{s}") for s in STAGES},
        "gen_tokens_per_s": med("gen/tokens_per_s"),
        "yield_tokens_per_s": med("yield/tokens_per_s"),
        "switch_s": {k.split("/", 1)[1]: med(k) for k in steps[-1] if k.startswith("switch/")},
        "episodes_per_step": med("episodes"),
        "response_tokens_per_episode": med("episode/response_tokens"),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
