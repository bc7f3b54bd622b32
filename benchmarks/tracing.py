"""What tracing and the timeline cost: the same short RL job with telemetry.traces off and on (and the
timeline off), interleaved in one invocation.

    python benchmarks/tracing.py --json runs/bench/tracing.json [--model DIR] [--steps 6] [--repeats 2]

Arms (run in a rotating order each repeat, so drift in the machine's load falls on each alike):
  off       the defaults: telemetry.traces=off, the timeline recorded (telemetry.timeline=true)
  traces    telemetry.traces=file: every episode and step traced to OTLP JSON (trace_sample 1)
  bare      telemetry.timeline=false: nothing recorded (what the timeline's appends cost)

A step's time here is the whole loop's wall time per step: the difference of consecutive steps'
`time/logged_at` (it includes the ledger's write and the hand-off to the tracer, which run after
`time/step_s` is measured), over the steps after the second. Reported: the median per arm and the
ratios traces/off and off/bare (target: traces within 3% of off), and per repeat each arm's median over
off's median in the same repeat (its median over the repeats: drift between repeats cancels).
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

ARMS = {"off": [], "traces": ["telemetry.traces=file"], "bare": ["telemetry.timeline=false"]}


def run_once(recipe: str, model: str, run_dir: Path, steps: int, arm: str, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "hybridrl", "train", recipe, f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.validate_every=0", "trainer.checkpoint_every=0",
           "task.validation_size=4", "trainer.export_hf=false", "algo.drop_all_equal_groups=false",
           *ARMS[arm], *overrides]
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"tracing: the {arm} run failed")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["time/logged_at"] for r in rows if r["step"] >= 1]
    out = {"arm": arm, "wall_s": time.time() - started, "loop_s": [b - a for a, b in zip(logged[1:], logged[2:])],
           "step_s": [r["time/step_s"] for r in rows if r["step"] >= 3]}
    traces = run_dir / "traces.otlp.jsonl"
    if traces.exists():
        out["trace_bytes"] = traces.stat().st_size
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "calc_grpo_cpu.yaml"))
    ap.add_argument("--model", default=None, help="HF directory (default: the demo's base model, built for the run)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    load_before = os.getloadavg()
    runs = []
    names = list(ARMS)
    with tempfile.TemporaryDirectory(prefix="hybridrl-tracing-") as tmp:
        model = args.model or build_base_model(Path(tmp) / "model")
        for r in range(args.repeats):
            for arm in names[r % len(names):] + names[: r % len(names)]:
                run = run_once(args.recipe, model, Path(tmp) / f"run{r}-{arm}", args.steps, arm, args.overrides)
                runs.append(run | {"repeat": r})
                print(f"repeat {r} {arm:6s}: median loop step {statistics.median(run['loop_s']):.3f}s", flush=True)
    median = {arm: statistics.median(s for r in runs if r["arm"] == arm for s in r["loop_s"]) for arm in names}
    ratio = median["traces"] / median["off"]
    # per repeat, each arm's median against off's in the same repeat: drift between repeats cancels
    paired = {f"{arm}_over_off": [statistics.median(a["loop_s"]) / statistics.median(o["loop_s"])
                                  for a in runs if a["arm"] == arm for o in runs
                                  if o["arm"] == "off" and o["repeat"] == a["repeat"]] for arm in ("traces", "bare")}
    result = {"recipe": args.recipe, "model": args.model or "demo base model (built)", "steps": args.steps,
              "repeats": args.repeats, "overrides": args.overrides, "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "loop_s_median": median,
              "traces_over_off": ratio, "off_over_bare": median["off"] / median["bare"],
              "per_repeat": paired, "per_repeat_median": {k: statistics.median(v) for k, v in paired.items()},
              "target_traces_over_off": 1.03, "target_met": ratio <= 1.03, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"loop step (median): off {median['off']:.3f}s, traces {median['traces']:.3f}s, bare {median['bare']:.3f}s; "
          f"traces/off {ratio:.3f} (target <= 1.03: {'met' if ratio <= 1.03 else 'MISSED'}), off/bare "
          f"{result['off_over_bare']:.3f}; per repeat (median): traces/off "
          f"{result['per_repeat_median']['traces_over_off']:.3f}, "
          f"bare/off {result['per_repeat_median']['bare_over_off']:.3f}"
          f"; load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
