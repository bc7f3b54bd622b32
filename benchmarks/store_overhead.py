"""What the run ledger costs: the demo recipe with the store on and off, side by side in one run.

    python benchmarks/store_overhead.py --json runs/bench/store.json [--model DIR] [--steps 5] [--repeats 2]

Runs `hybridrl train` on the recipe (the CPU demo's GRPO stage by default) `2 x repeats` times,
store.enabled=true and false interleaved (on/off, off/on, ...), a few steps each (no checkpoints;
validation of 4 instances at the ends only), and reports over the steps after the first:
  - the store's share of a step, measured inside the store-on runs: median of
    time/T_store / time/step_s (T_store is the ledger's write, outside the step's own wall time);
    this is the figure the target (<= 5%) is about, and it does not depend on how loaded the
    machine was between runs;
  - the A/B ratio: median step time with the store on (step_s + T_store) over median step time
    with it off (noisier: two different runs on a shared machine);
  - the ledger's size per trajectory (data shards, text shards, index) from the store-on runs.
The per-episode trace events are recorded in both arms (the agent loop always writes them): the
ratio measures the ledger, not the events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridrl.demo import build_base_model  # noqa: E402  (the demo's base model)


def run_once(recipe: str, model: str, run_dir: Path, steps: int, store: bool, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "hybridrl", "train", recipe, f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.validate_every=0", "trainer.checkpoint_every=0",
           "task.validation_size=4", "trainer.export_hf=false", "algo.drop_all_equal_groups=false",
           f"store.enabled={str(store).lower()}", *overrides]
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"store_overhead: the {'store-on' if store else 'store-off'} run failed")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] >= 2 and "time/step_s" in r]
    out = {"store": store, "wall_s": time.time() - started,
           "step_s": [r["time/step_s"] for r in steps_rows],
           "store_s": [r.get("time/T_store", 0.0) for r in steps_rows],
           "episodes": sum(r["episodes"] for r in rows if r["step"] >= 1)}
    if store:
        from hybridrl.inspect.query import RunLedger

        summary = RunLedger(run_dir).summary()
        index = (run_dir / "ledger" / "index.sqlite").stat().st_size
        n = summary["trajectories"]
        out["bytes"] = {"data": summary["bytes"]["data"], "text": summary["bytes"]["text"], "index": index,
                        "trajectories": n,
                        "data_per_trajectory": summary["bytes"]["data"] / n,
                        "text_per_trajectory": summary["bytes"]["text"] / n,
                        "index_per_trajectory": index / n}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "calc_grpo_cpu.yaml"))
    ap.add_argument("--model", default=None, help="HF directory (default: the demo's base model, built for the run; "
                                                  "the demo's SFT model, runs/demo/sft/hf, makes episodes use the tool)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="hybridrl-store-") as tmp:
        model = args.model or build_base_model(Path(tmp) / "model")
        for r in range(args.repeats):
            for store in ((True, False) if r % 2 == 0 else (False, True)):
                run = run_once(args.recipe, model, Path(tmp) / f"run{r}-{'on' if store else 'off'}", args.steps,
                               store, args.overrides)
                runs.append(run)
                print(f"repeat {r} store {'on ' if store else 'off'}: median step "
                      f"{statistics.median(run['step_s']):.3f}s, store {statistics.median(run['store_s']):.4f}s",
                      flush=True)
    on = [r for r in runs if r["store"]]
    off = [r for r in runs if not r["store"]]
    share = statistics.median(s / t for r in on for s, t in zip(r["store_s"], r["step_s"]))
    on_step = statistics.median(t + s for r in on for s, t in zip(r["store_s"], r["step_s"]))
    off_step = statistics.median(t for r in off for t in r["step_s"])
    sizes = on[0]["bytes"]
    result = {
        "recipe": args.recipe, "model": args.model or "demo base model (built)", "steps": args.steps,
        "repeats": args.repeats, "overrides": args.overrides, "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "store_share_of_step_median": share, "target_share": 0.05, "target_met": share <= 0.05,
        "store_s_median": statistics.median(s for r in on for s in r["store_s"]),
        "step_s_median_on": on_step, "step_s_median_off": off_step, "on_over_off": on_step / off_step,
        "bytes_per_trajectory": {k: sizes[k] for k in ("data_per_trajectory", "text_per_trajectory",
                                                       "index_per_trajectory")},
        "bytes_per_trajectory_total": sizes["data_per_trajectory"] + sizes["text_per_trajectory"]
        + sizes["index_per_trajectory"],
        "runs": runs,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"store share of a step: {100 * share:.2f}% (median; target <= 5%: {'met' if share <= 0.05 else 'MISSED'}); "
          f"step on/off {on_step:.3f}s / {off_step:.3f}s = {on_step / off_step:.3f}; "
          f"{result['bytes_per_trajectory_total'] / 1024:.2f} KiB per trajectory "
          f"(data {sizes['data_per_trajectory'] / 1024:.2f}, text {sizes['text_per_trajectory'] / 1024:.2f}, "
          f"index {sizes['index_per_trajectory'] / 1024:.2f}); load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
