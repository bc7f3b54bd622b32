"""hybridrl beside TRL's GRPOTrainer on one workload, interleaved in one run.

    python benchmarks/vs_trl.py --model runs/demo/sft/hf --json runs/bench/vs_trl.json \\
        [--install-trl] [--trl-venv runs/bench/trl-venv] [--pairs 3] [--steps 6] [--base OTHER_CHECKOUT]

The workload (both sides): the calculator task's training questions, 16 prompts x 8 samples per
step, one turn of at most 32 new tokens at temperature 1, lr 5e-5 constant, no KL term, group-mean
advantages without the standard deviation, every sample trained in one optimizer step, gradient
clipping at 1.0, float32 on CPU. hybridrl runs its CPU demo recipe with those settings
(`benchmarks/e2e.py`, 2 ranks); TRL runs `GRPOTrainer` in one process (`benchmarks/trl_side.py`)
with the same micro-batch of rows. Both use every core of the machine: hybridrl as two ranks of
one thread each, TRL as one process of as many threads as torch gives it.

TRL lives in a virtual environment of its own (its pins are not ours): `--install-trl` creates it
(the same torch as this one, then `trl` and this environment's transformers). Pairs alternate the
order (hybridrl first, then TRL first...), so that the machine's load falls on both alike. Reports
each run's median step time over the steps after the first two (warm-up) and its completions' mean
length (the sides stop a completion alike: at the end of the assistant's turn or 32 tokens; a
model that answers longer on one side costs that side more), the medians over pairs,
the speed-up (TRL's step time / hybridrl's) per pair and its median, and the load average around
every run. With `--base CHECKOUT` (another checkout of hybridrl, run with this interpreter and its own
package first on the path) each round runs three sides, the order rotating, and reports that checkout's
speed-up over TRL and this one's over it (`head_vs_base`), all from the same run.
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

RECIPE = ROOT / "recipes" / "calc_grpo_cpu.yaml"
WORKLOAD = {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 32, "temperature": 1.0, "lr": 5e-5,
            "clip_grad": 1.0, "seed": 0}
OVERRIDES = ["agent.max_turns=1", f"agent.max_new_tokens_per_turn={WORKLOAD['max_new_tokens']}",
             f"agent.max_response_tokens={WORKLOAD['max_new_tokens']}", "algo.kl_coef=0.0",
             "algo.norm_adv_by_std=false", "algo.drop_truncated=false",
             f"train.lr={WORKLOAD['lr']}", "train.lr_schedule=constant"]     # TRL's side: the same, constant
WARMUP = 2


def install_trl(venv: Path) -> None:
    import torch
    import transformers

    print(f"creating {venv} (torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, trl)",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, "trl", f"transformers=={transformers.__version__}", "datasets"], check=True)


def workload(model: str, steps: int) -> dict:
    """The prompts both sides train on, rendered with the model's chat template, and the shared settings."""
    from transformers import AutoTokenizer

    from hybridrl.config import load_config
    from hybridrl.envs.tasks import get_task

    cfg = load_config(RECIPE, [f"model.path={model}", *OVERRIDES])
    task = get_task(cfg.task.name, cfg.task)
    instances = task.train_split(WORKLOAD["prompts_per_step"] * (steps + 1))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template(list(i.messages), add_generation_prompt=True, tokenize=False)
               for i in instances]
    return {**WORKLOAD, "model": model, "steps": steps, "prompts": prompts,
            "references": [i.reference for i in instances], "format_weight": cfg.task.format_weight,
            "micro_batch_size": cfg.train.micro_batch_size, "trl_loss_type": "dapo"}


def run_hybridrl(model: str, steps: int, tmp: Path, i: int, checkout: Path = ROOT, tag: str = "hybridrl") -> dict:
    out = tmp / f"{tag}{i}.json"
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, str(checkout / "benchmarks" / "e2e.py"), "--json", str(out), "--model",
                           model, "--steps", str(steps), *OVERRIDES], cwd=checkout, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"{tag}'s run ({checkout}) failed\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    return {"step_s": r["step_s"], "stage_times": r["stage_times"], "switch_s": r["switch_s"],
            "completion_tokens": r["response_tokens_per_episode"], "load_avg_1m": [load, os.getloadavg()[0]]}


def run_trl(venv: Path, work: Path, steps: int, tmp: Path, i: int) -> dict:
    out = tmp / f"trl{i}.json"
    load = os.getloadavg()[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "benchmarks" / "trl_side.py"), "--workload",
                           str(work), "--json", str(out), "--out-dir", str(tmp / f"trl{i}")], cwd=tmp,
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"TRL's run failed\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    measured = r["step_s"][WARMUP:] or r["step_s"]
    return {"step_s": statistics.median(measured), "steps_s": r["step_s"], "reward": r["reward"],
            "completion_tokens": statistics.median(r["completion_tokens"][WARMUP:] or r["completion_tokens"]),
            "torch_threads": r["torch_threads"], "load_avg_1m": [load, os.getloadavg()[0]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory both sides start from (the demo's SFT model)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--trl-venv", default=str(ROOT / "runs" / "bench" / "trl-venv"))
    ap.add_argument("--install-trl", action="store_true", help="create --trl-venv with TRL if it is missing")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--base", default=None, help="another hybridrl checkout to run beside this one (same interpreter)")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP} warm-up steps")
    venv, model = Path(args.trl_venv), str(Path(args.model).resolve())
    if not (venv / "bin" / "python").exists():
        if not args.install_trl:
            raise SystemExit(f"no TRL environment at {venv}: pass --install-trl to create it (pip, a few minutes), "
                             "or --trl-venv DIR for one you have")
        install_trl(venv)
    sides = ["hybridrl", "trl"] + (["base"] if args.base else [])
    base = Path(args.base).resolve() if args.base else None
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="hybridrl-vs-trl-") as tmp:
        tmp = Path(tmp)
        work = tmp / "workload.json"
        work.write_text(json.dumps(workload(model, args.steps)))
        for i in range(args.pairs):
            order = sides[i % len(sides):] + sides[: i % len(sides)] if args.base else (
                ("hybridrl", "trl") if i % 2 == 0 else ("trl", "hybridrl"))
            for side in order:
                if side == "trl":
                    r = run_trl(venv, work, args.steps, tmp, i)
                else:
                    r = run_hybridrl(model, args.steps, tmp, i, *((base, "base") if side == "base" else ()))
                runs[side].append(r)
                print(f"pair {i} {side}: {r['step_s']:.3f} s/step  {r['completion_tokens']:.1f} tokens/completion  "
                      f"load {r['load_avg_1m'][0]:.1f}", flush=True)
    speedups = [t["step_s"] / h["step_s"] for h, t in zip(runs["hybridrl"], runs["trl"])]
    result = {"model": args.model, "workload": WORKLOAD, "hybridrl_overrides": OVERRIDES, "steps": args.steps,
              "warmup_steps": WARMUP, "pairs": args.pairs,
              "median_step_s": {side: statistics.median(r["step_s"] for r in rs) for side, rs in runs.items()},
              "speedup_per_pair": speedups, "speedup_median": statistics.median(speedups),
              "hybridrl_T_sync_share": statistics.median(r["stage_times"]["T_sync"] / r["step_s"]
                                                         for r in runs["hybridrl"]),
              "runs": runs}
    if base is not None:
        base_speedups = [t["step_s"] / b["step_s"] for b, t in zip(runs["base"], runs["trl"])]
        head_vs_base = [b["step_s"] / h["step_s"] for h, b in zip(runs["hybridrl"], runs["base"])]
        result.update({"base": str(base), "base_speedup_per_pair": base_speedups,
                       "base_speedup_median": statistics.median(base_speedups), "head_vs_base_per_pair": head_vs_base,
                       "head_vs_base_median": statistics.median(head_vs_base),
                       "base_T_sync_share": statistics.median(r["stage_times"]["T_sync"] / r["step_s"]
                                                              for r in runs["base"])})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_step_s", "speedup_per_pair", "speedup_median",
                                             "hybridrl_T_sync_share", "base_speedup_median", "head_vs_base_median",
                                             "base_T_sync_share") if k in result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
