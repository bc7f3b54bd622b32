"""The gateway's cost in two checkouts side by side, interleaved in one run.

    python benchmarks/gateway_ab.py --base ../main-checkout --json runs/bench/gateway_ab.json
                                    [--model DIR] [--repeats 2] [--steps 4]
    python benchmarks/gateway_ab.py overhead --base ../main-checkout --json runs/bench/gateway_ab_overhead.json
                                    [--repeats 6] [--inner-repeats 6] [--agents 8 64]

`step` (the default): each repeat runs `benchmarks/gateway.py step --repeats 1` of each checkout (its
own .venv, its own package first on the path), the order swapped every repeat: the demo's GRPO recipe
with the built-in agent loop and the same work as an OpenAI-client agent through the gateway, from the
same model. Reports per checkout the median step times and the median of the per-repeat ratios agent /
built-in, and head's ratio over base's (<= 1: the gateway costs head no more than base).

`overhead`: each repeat runs `benchmarks/gateway.py overhead --engine instant --modes direct gateway` of
each checkout (`--inner-repeats` repeats of its own, the order swapped every repeat): the gateway's
added latency per request and the engine process's added CPU per request, with an engine that answers
at once (what is left is the gateway's path). Reports per checkout and agent count the median over the
repeats of each run's medians, and head / base; besides the added figures, each mode's own CPU per request
(`gateway_cpu_ms`, `direct_cpu_ms`: a change that speeds up what both modes share, e.g. the chat template,
lowers direct's too and so raises the added CPU while the gateway itself got cheaper).
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


def run(checkout: Path, out: Path, what: str, *options: str) -> dict:
    python = checkout / ".venv" / "bin" / "python"
    proc = subprocess.run([str(python), str(checkout / "benchmarks" / "gateway.py"), what, "--json", str(out),
                           *options], cwd=checkout,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: gateway.py {what} failed\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def alternate(repeats: int):
    """(repeat, side) pairs, base first in even repeats and head first in odd ones."""
    for i in range(repeats):
        for side in (("base", "head") if i % 2 == 0 else ("head", "base")):
            yield i, side


def overhead(args, sides: dict[str, Path]) -> dict:
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    agents = [str(a) for a in args.agents]
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-ab-") as tmp:
        for i, side in alternate(args.repeats):
            r = run(sides[side], Path(tmp) / f"{side}{i}.json", "overhead", "--engine", "instant", "--modes", "direct",
                    "gateway", "--repeats", str(args.inner_repeats), "--agents", *agents)
            row = {a: {"added_ms": r["by_agents"][a]["added_ms"]["gateway"]["median_of_repeats"],
                       "added_cpu_ms": r["by_agents"][a]["added_cpu_ms"]["gateway"]["median_of_repeats"],
                       "gateway_cpu_ms": r["by_agents"][a]["cpu_ms_per_request"]["gateway"],
                       "direct_cpu_ms": r["by_agents"][a]["cpu_ms_per_request"]["direct"]}
                   for a in agents}
            runs[side].append(row)
            print(f"repeat {i} {side}: " + "  ".join(
                f"{a} agents +{v['added_ms']:.2f} ms, cpu +{v['added_cpu_ms']:.3f} ms" for a, v in row.items()), flush=True)
    keys = ("added_ms", "added_cpu_ms", "gateway_cpu_ms", "direct_cpu_ms")
    med = {side: {a: {k: statistics.median(row[a][k] for row in rs) for k in keys} for a in agents}
           for side, rs in runs.items()}
    return {"what": "overhead", "repeats": args.repeats, "inner_repeats": args.inner_repeats, "agents": args.agents,
            "median": med, "head_over_base": {a: {k: med["head"][a][k] / med["base"][a][k] for k in keys}
                                              for a in agents},
            "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="step", choices=("step", "overhead"))
    ap.add_argument("--base", required=True, help="the checkout to compare against (with its own .venv)")
    ap.add_argument("--head", default=str(ROOT), help="this checkout by default")
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default=None, help="HF directory for both (default: the demo's base model)")
    ap.add_argument("--inner-repeats", type=int, default=6, help="overhead: repeats inside each run")
    ap.add_argument("--agents", type=int, nargs="+", default=[8, 64], help="overhead: concurrent agents")
    args = ap.parse_args()
    sides = {"base": Path(args.base).resolve(), "head": Path(args.head).resolve()}
    if args.what == "overhead":
        return write(args.json, {"base": str(sides["base"]), "head": str(sides["head"])} | overhead(args, sides),
                     "head_over_base")
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-ab-") as tmp:
        model = str(Path(args.model).resolve()) if args.model else build_base_model(Path(tmp) / "model")
        for i, side in alternate(args.repeats):
            r = run(sides[side], Path(tmp) / f"{side}{i}.json", "step", "--model", model, "--steps",
                    str(args.steps), "--repeats", "1")
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
    return write(args.json, result, "head_ratio_over_base_ratio")


def write(path: str, result: dict, verdict: str) -> int:
    """The result as JSON at `path`; its medians and `verdict` printed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median", verdict)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
