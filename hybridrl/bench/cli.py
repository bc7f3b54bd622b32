"""`hybridrl bench ...`: argument parsing and launch (light: the benchmark jobs import torch)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench_mode_switch.yaml"


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
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--run-dir", default=None, help="keep the run directory here (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="extra section.key=value")


def mode_switch_main(args: argparse.Namespace) -> int:
    nproc = args.nproc or args.tp
    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-") as tmp:
        tmp = args.run_dir or tmp
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "hybridrl.train", "--config", str(RECIPE), f"model.path={args.model}", f"run.dir={tmp}",
               f"distributed.nproc_per_node={nproc}", f"train.tp={args.tp}", f"rollout.tp={args.rollout_tp}",
               f"rollout.engine={args.engine}", f"trainer.total_steps={args.cycles}",
               f"publish.verify={args.verify}", f"hybrid.spill_optimizer={str(args.spill_optimizer).lower()}",
               f"rollout.native.kv_cache_mb={args.kv_cache_mb}", *args.overrides]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            return proc.returncode
        result = json.loads((Path(tmp) / "mode_switch.json").read_text())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    phases = ", ".join(f"{k} {v['median_s']:.3f}s" for k, v in result["phases"].items())
    print(f"mode switch of a {result['model_params'] / 1e6:.1f}M-parameter model: {result['switch_s']:.3f}s "
          f"({phases}); copy floor {result['copy_floor_s']:.3f}s -> {result['ratio_to_floor']:.2f}x")
    return 0
