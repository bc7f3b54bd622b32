"""The gateway's step-time cost in two checkouts side by side, interleaved in one run.

    python benchmarks/gateway_ab.py --base ../main-checkout --json runs/bench/gateway_ab.json
                                    [--model DIR] [--repeats 2] [--steps 4]

Each repeat runs `benchmarks/gateway.py step --repeats 1` of each checkout (its own .venv, its own
package first on the path), the order swapped every repeat: the demo's GRPO recipe with the built-in
agent loop and the same work as an OpenAI-client agent through the gateway, from the same model.
Reports per checkout the median step times and the median of the per-repeat ratios agent / built-in,
and head's ratio over base's (<= 1: the gateway costs head no more than base).
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


def run(checkout: Path, model: str, steps: int, out: Path) -> dict:
    python = checkout / ".venv" / "bin" / "python"
    proc = subprocess.run([str(python), str(checkout / "benchmarks" / "gateway.py"), "step", "--json", str(out),
                           "--model", model, "--steps", str(steps), "--repeats", "1"], cwd=checkout,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: gateway.py step failed\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the checkout to compare against (with its own .venv)")
    ap.add_argument("--head", default=str(ROOT), help="this checkout by default")
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default=None, help="HF directory for both (default: the demo's base model)")
    args = ap.parse_args()
    sides = {"base": Path(args.base).resolve(), "head": Path(args.head).resolve()}
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-ab-") as tmp:
        model = str(Path(args.model).resolve()) if args.model else build_base_model(Path(tmp) / "model")
        for i in range(args.repeats):
            for side in (("base", "head") if i % 2 == 0 else ("head", "base")):
                r = run(sides[side], model, args.steps, Path(tmp) / f"{side}{i}.json")
                runs[side].append(r)
                print(f"repeat {i} {side}: built-in {r['median']['builtin']['step_s']:.3f}s  agent "
                      f"{r['median']['agent']['step_s']:.3f}s  ratio {r['ratio_step_agent_over_builtin']:.3f}",
                      flush=True)
    med = {side: {"builtin_step_s": statistics.median(r["median"]["builtin"]["step_s"] for r in rs),
                  "agent_step_s": statistics.median(r["median"]["agent"]["step_s"] for r in rs),
                  "ratio_agent_over_builtin": statistics.median(r["ratio_step_agent_over_builtin"] for r in rs)}
           for side, rs in runs.items()}
    result = {"base": str(sides["base"]), "head": str(sides["head"]), "repeats": args.repeats, "steps": args.steps,
              "median": med, "head_ratio_over_base_ratio": med["head"]["ratio_agent_over_builtin"]
              / med["base"]["ratio_agent_over_builtin"], "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median", "head_ratio_over_base_ratio")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
