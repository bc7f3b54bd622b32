"""Two checkouts' end-to-end step times side by side, interleaved in one run (`benchmarks/e2e.py` in each).

    python benchmarks/e2e_ab.py --base ../main-checkout --json runs/bench/e2e_ab.json [--repeats 3] [--steps 6]

Each checkout runs with its own virtual environment (<dir>/.venv/bin/python) on the same model
(the demo's base model, built once) and recipe; runs alternate base/head with the order swapped
every repeat, so that the machine's load falls on both alike. Reports each run's medians (as
`e2e.py` measures them), the medians over repeats, head's speed-up (base step time / head step
time) and the load average around every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridrl.demo import build_base_model  # noqa: E402  (the demo's base model)


def run(checkout: Path, model: str, steps: int, out: Path, overrides: list[str]) -> dict:
    """e2e.py of `checkout` with its virtual environment and its own package first on the path."""
    python = checkout / ".venv" / "bin" / "python"
    load_before = os.getloadavg()[0]
    proc = subprocess.run([str(python), str(checkout / "benchmarks" / "e2e.py"), "--json", str(out),
                           "--model", model, "--steps", str(steps), *overrides], cwd=checkout,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: e2e.py failed\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["load_avg_1m"] = [load_before, os.getloadavg()[0]]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the checkout to compare against (with its own .venv)")
    ap.add_argument("--head", default=str(ROOT), help="this checkout by default")
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default=None, help="HF directory for both (default: the demo's base model, built for "
                                                  "the run; runs/demo/sft/hf is the demo's GRPO stage as it runs)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides passed to both")
    args = ap.parse_args()
    sides = {"base": Path(args.base).resolve(), "head": Path(args.head).resolve()}
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="hybridrl-e2e-ab-") as tmp:
        model = str(Path(args.model).resolve()) if args.model else build_base_model(Path(tmp) / "model")
        for i in range(args.repeats):
            for side in (("base", "head") if i % 2 == 0 else ("head", "base")):
                r = run(sides[side], model, args.steps, Path(tmp) / f"{side}{i}.json", args.overrides)
                runs[side].append(r)
                print(f"repeat {i} {side}: step {r['step_s']:.3f}s  T_train {r['stage_times']['T_train']:.3f}s  "
                      f"T_prep {r['stage_times']['T_prep']:.3f}s  load {r['load_avg_1m'][0]:.1f}", flush=True)
    med = {side: {"step_s": statistics.median(r["step_s"] for r in rs),
                  **{k: statistics.median(r["stage_times"][k] for r in rs) for k in rs[0]["stage_times"]}}
           for side, rs in runs.items()}
    result = {"base": str(sides["base"]), "head": str(sides["head"]), "model": args.model or "the demo's base model",
              "repeats": args.repeats, "steps": args.steps,
              "overrides": args.overrides, "median": med,
              "speedup_step": med["base"]["step_s"] / med["head"]["step_s"],
              "speedup_train_plus_prep": (med["base"]["T_train"] + med["base"]["T_prep"])
              / (med["head"]["T_train"] + med["head"]["T_prep"]),
              "load_avg_1m": [r["load_avg_1m"] for side in ("base", "head") for r in runs[side]], "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median", "speedup_step", "speedup_train_plus_prep")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
