"""`hybridrl score`: per-token log-probabilities of given token ids, through the Megatron backend.

    hybridrl score --model HF_DIR --backend megatron --tp 2 --pp 1 --input seqs.jsonl --output out.jsonl
    hybridrl score --model MOE_DIR --ep 2 --nproc 2 --input seqs.jsonl --output out.jsonl   # experts split

The inputs are checked here, in one line each, before torchrun starts the ranks that score
(`hybridrl.backends.megatron.score`, which documents the input and output lines).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hybridrl.backends.megatron.score import read_sequences
from hybridrl.distributed.process_exit import torchrun_command

def main(args: argparse.Namespace) -> int:
    """CLI handler: validate, then start the ranks with torchrun and wait."""
    try:
        read_sequences(args.input)
    except (OSError, ValueError) as err:
        print(f"hybridrl score: {err}", file=sys.stderr)
        return 2
    if not (Path(args.model) / "config.json").exists():
        print(f"hybridrl score: {args.model} is not an HF model directory (no config.json)", file=sys.stderr)
        return 2
    nproc = args.nproc or args.tp * args.pp * args.ep
    from hybridrl.preflight import PreflightError, check_layout

    try:
        check_layout(args.model, args.tp, args.pp, nproc, keys=("--tp", "--pp"), world_key="--nproc", ep=args.ep,
                     ep_key="--ep", training=False)
    except PreflightError as err:
        print(f"hybridrl score: {err}", file=sys.stderr)
        return 2
    cmd = torchrun_command(nproc, "-m", "hybridrl.backends.megatron.score", "--model", args.model,
                           "--input", args.input, "--output", args.output, "--tp", str(args.tp),
                           "--pp", str(args.pp), "--ep", str(args.ep), "--batch-size", str(args.batch_size),
                           "--micro-batch-size", str(args.micro_batch_size), "--temperature", str(args.temperature),
                           "--dtype", args.dtype)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)


