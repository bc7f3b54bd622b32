"""`hybridrl export RUN --step N --out DIR`: the policy of a run's checkpoint as an HF directory.

    hybridrl export runs/demo/grpo --step 10 --out runs/demo/grpo-step10     # then chat / generate / transformers
    hybridrl export runs/demo/lora_grpo --peft --out adapter    # a LoRA run's adapters: PeftModel.from_pretrained

A job of its own under torchrun (`run.job=hybridrl.controller.export_job:JOB`), with the run's resolved
config (its config.json) and training layout: every rank builds the actor from the run's
`model.path`, loads the Megatron checkpoint `RUN/checkpoints/step_N/model` into it (data parallel
1 unless `--nproc-per-node` says more: a checkpoint loads at any data-parallel size) and writes the
HF directory as the run's own end does (`TrainEngine.export_hf`), so the export of a run's last
step equals its `hf/`; with `--peft` (a LoRA run: train.lora.rank > 0) the adapters alone as a
PEFT directory (`TrainEngine.export_peft`), as the run's end writes `hf_peft/`. The run directory
is only read. Checked before anything starts (exit 2): the run directory, the step (the complete
checkpoints are listed), the output directory, that a --peft run trained adapters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from hybridrl.distributed.process_exit import torchrun_command

EXIT_CONFIG = 2


# ------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the run directory (run.dir of an RL run)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    parser.add_argument("--out", required=True, help="the HF directory to write (new or empty)")
    parser.add_argument("--peft", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT directory (adapter_config.json, "
                             "adapter_model.safetensors) instead of the merged model")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks (default: train.tp x train.pp of the run, data parallel 1)")


class ExportError(Exception):
    """One line: what is wrong with the export's inputs, and what to do."""


def plan(args: argparse.Namespace) -> tuple[dict, int, Path, Path]:
    """(the run's config, the step, the checkpoint's model directory, the output directory), checked."""
    from hybridrl.store.checkpoints import CheckpointManager

    run_dir = Path(args.run)
    config = run_dir / "config.json"
    if not config.exists():
        raise ExportError(f"{run_dir}: not a run directory (no config.json): pass the run.dir of an RL run")
    resolved = json.loads(config.read_text())
    final = run_dir / ("hf_peft" if args.peft else "hf")
    if args.peft and not int(resolved.get("train", {}).get("lora", {}).get("rank", 0) or 0):
        raise ExportError(f"{run_dir} trained the full model (train.lora.rank is 0): it has no adapters to write as "
                          "PEFT; drop --peft for the HF directory")
    complete = CheckpointManager(run_dir).complete()
    steps = [int(p.name.rsplit("_", 1)[1]) for p in complete]
    if not steps:
        raise ExportError(f"{run_dir} holds no complete checkpoint (trainer.checkpoint_every writes them; the "
                          f"final policy is {final})")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise ExportError(f"{run_dir} has no complete checkpoint of step {step}; complete: "
                          f"{', '.join(map(str, steps))} (trainer.keep_checkpoints={len(steps)} keeps the newest)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory: choose a new one")
    return resolved, step, complete[steps.index(step)] / "model", out


def main(args: argparse.Namespace) -> int:
    import yaml

    from hybridrl.controller.export_job import FORMAT, FROM, TO
    from hybridrl.launcher import supervise

    try:
        config, step, checkpoint, out = plan(args)
    except ExportError as err:
        print(f"hybridrl: export: {err}", file=sys.stderr)
        return EXIT_CONFIG
    train = config.get("train", {})
    nproc = args.nproc_per_node or int(train.get("tp", 1)) * int(train.get("pp", 1))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="hybridrl-export-", delete=False) as f:
        yaml.safe_dump(config, f)
    overrides = ["run.job=hybridrl.controller.export_job:JOB", f"run.dir={out.resolve()}",
                 "placement.mode=colocated", "trainer.inject=[]", "trainer.callbacks=[]",
                 f"distributed.nproc_per_node={nproc}"]
    cmd = torchrun_command(nproc, "-m", "hybridrl.train", "--config", f.name, *overrides)
    os.environ.update({FROM: str(checkpoint.resolve()), TO: str(out.resolve()), FORMAT: "peft" if args.peft else "hf"})
    if nproc > 1:        # what torchrun would set, with its banner; one rank keeps every core
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    print(f"hybridrl: export: {checkpoint.parent} -> {out} ({nproc} rank(s))", file=sys.stderr, flush=True)
    try:
        code = supervise(cmd)
    finally:
        os.unlink(f.name)
    if code == 0 and args.peft and (out / "adapter_config.json").exists():
        print(f"exported the LoRA adapters of step {step} of {args.run} to {out} (a PEFT directory: "
              f"PeftModel.from_pretrained(base, {str(out)!r}))")
    elif code == 0 and (out / "config.json").exists():
        print(f"exported step {step} of {args.run} to {out} (an HF directory: transformers, hybridrl generate)")
    return code
