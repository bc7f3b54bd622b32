"""`hybridrl bench ...`: argument parsing and launch (light: the benchmark jobs import torch)."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from hybridrl.distributed.process_exit import torchrun_command


def add_mode_switch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--tp", type=int, default=1, help="training tensor-parallel size")
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--engine", default="native", choices=("native", "sglang"))
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: --tp)")
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--verify", default="structure", choices=("structure", "post_copy"))
    p.add_argument("--spill-optimizer", action="store_true", help="CPU: spill optimizer state during rollout")
    p.add_argument("--kv-cache-mb", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA rank R > 0: the switch publishing the whole (merged) model against publishing the "
                        "adapters only, side by side (native engine; hybridrl/bench/lora_switch.py)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--run-dir", default=None, help="keep the run directory here (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="extra section.key=value")


def mode_switch_main(args: argparse.Namespace) -> int:
    from hybridrl.shipped import recipe_path

    recipe = recipe_path("bench_mode_switch")
    nproc = args.nproc or args.tp
    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-") as tmp:
        tmp = args.run_dir or tmp
        cmd = torchrun_command(nproc, "-m", "hybridrl.train", "--config", str(recipe), f"model.path={args.model}",
                               f"run.dir={tmp}", f"distributed.nproc_per_node={nproc}", f"train.tp={args.tp}",
                               f"rollout.tp={args.rollout_tp}", f"rollout.engine={args.engine}",
                               f"trainer.total_steps={args.cycles}", f"publish.verify={args.verify}",
                               f"hybrid.spill_optimizer={str(args.spill_optimizer).lower()}",
                               f"rollout.native.kv_cache_mb={args.kv_cache_mb}", *_lora(args), *args.overrides)
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            return proc.returncode
        result = json.loads((Path(tmp) / "mode_switch.json").read_text())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.lora_rank > 0:
        from hybridrl.bench.lora_switch import explain as explain_lora

        print(explain_lora(result))
    else:
        print(explain(result))
    return 0


def _lora(args: argparse.Namespace) -> list[str]:
    if args.lora_rank <= 0:
        return []
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    return ["run.job=hybridrl.bench.lora_switch:JOB", f"train.lora.rank={args.lora_rank}", f"train.lora.alpha={alpha}"]


# Below this the floor is a few memcpy calls' fixed cost, not the bytes: no ratio means anything there.
MEASURABLE_FLOOR_S = 0.005
TARGET_RATIO = 4.0            # verified publication included (publish.verify=post_copy)


def explain(result: dict) -> str:
    """The benchmark's result for a reader: the switch, its phases, and what the ratio says."""
    phases = ", ".join(f"{k} {v['median_s']:.3f}s" for k, v in result["phases"].items())
    moved = sum(result["bytes_must_move"].values())
    floor, ratio = result["copy_floor_s"], result["ratio_to_floor"]
    lines = [f"mode switch of a {result['model_params'] / 1e6:.1f}M-parameter model: {result['switch_s']:.3f}s "
             f"per TRAIN -> ROLLOUT -> TRAIN cycle (median of {result['cycles']}; {phases})",
             f"copy floor: the {moved / 2**20:.1f} MiB a switch must move, at this machine's memory copy rate "
             f"({result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s): {1000 * floor:.2f} ms"]
    if not ratio or floor < MEASURABLE_FLOOR_S:
        lines.append(f"ratio: not meaningful here: the floor is under {1000 * MEASURABLE_FLOOR_S:.0f} ms, so the "
                     "switch's fixed costs (Python, process-group calls, the parity probe) are all that is "
                     f"measured{f' ({ratio:.0f}x)' if ratio else ''}; use a model of ~100M parameters or more "
                     "to compare against the floor")
    else:
        verdict = ("near copy speed" if ratio <= 2 else "within the target" if ratio <= TARGET_RATIO
                   else "above the target: see which phase dominates above")
        lines.append(f"ratio: {ratio:.2f}x the floor ({verdict}; 1x is copy speed, the target is "
                     f"<= {TARGET_RATIO:g}x with verified publication)")
    return "\n".join(lines)
