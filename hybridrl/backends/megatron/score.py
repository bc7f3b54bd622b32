"""The ranks of `hybridrl score` (`hybridrl/cli/score.py` launches them): per-token log-probabilities of
given token ids, through the Megatron backend.

    hybridrl score --model HF_DIR --backend megatron --tp 2 --pp 1 --input seqs.jsonl --output out.jsonl
    hybridrl score --model MOE_DIR --ep 2 --nproc 2 --input seqs.jsonl --output out.jsonl   # experts split

Input lines: {"id": ..., "token_ids": [int, ...]}. Output lines, in input order:
{"id": ..., "logprobs": [null, lp_1, ..., lp_{n-1}]}: lp_t = log p(token_t | tokens before t) at
the given temperature; the first token has no prefix, hence null. The command starts
tp * pp * dp ranks with torchrun (dp = --nproc / (tp * pp); a mixture-of-experts model's experts
are split over --ep of the dp ranks); each data-parallel group scores its share and rank 0 writes
the file. Use it to check parity with another implementation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BACKENDS = ("megatron",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--backend", choices=BACKENDS, default="megatron")
    parser.add_argument("--input", required=True, help='JSONL with {"id", "token_ids"} per line')
    parser.add_argument("--output", required=True, help='JSONL to write {"id", "logprobs"} lines to')
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; divides dp)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks to start (default tp * pp * ep)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per compute_logprobs call")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))


def read_sequences(path: str | Path) -> list[dict]:
    """The input records, checked: each needs an id and a non-empty list of int token ids."""
    records = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from None
        ids = rec.get("token_ids") if isinstance(rec, dict) else None
        if "id" not in rec or not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f'{path}:{lineno}: expected {{"id": ..., "token_ids": [int, ...]}} with at least '
                             "one token")
        records.append({"id": rec["id"], "token_ids": ids})
    if not records:
        raise ValueError(f"{path}: no sequences")
    return records


def run_rank(args: argparse.Namespace) -> None:
    """What every rank runs (under torchrun)."""
    import torch.distributed as dist

    from hybridrl.backends.megatron import MegatronConfig, MegatronEngine
    from hybridrl.data.batch import Batch, pad_sequences
    from hybridrl.distributed.bootstrap import init_distributed, shutdown_distributed
    from hybridrl.distributed.config import DistributedConfig

    ctx = init_distributed(DistributedConfig())
    cfg = MegatronConfig(tp=args.tp, pp=args.pp, ep=args.ep, micro_batch_size=args.micro_batch_size, dtype=args.dtype)
    engine = MegatronEngine.from_hf(args.model, cfg, training=False, device=ctx.device)
    records = read_sequences(args.input)
    mesh = engine.mesh
    dp_rank, dp_size = mesh.dp_rank(ctx.rank), mesh.dp_size
    mine = list(range(dp_rank, len(records), dp_size))
    mine.sort(key=lambda i: len(records[i]["token_ids"]))          # similar lengths batch together
    scored: dict[int, list] = {}
    progress = _progress(len(mine), enabled=engine.is_output_rank and dp_rank == 0)
    # every data-parallel rank runs as many forwards as the one with the most sequences: an expert-parallel
    # group spans data-parallel ranks, and its collectives need every member's forward (a rank with
    # nothing left scores a filler, a sequence of its own or the first, and drops the result)
    most = -(-len(records) // dp_size)                              # sequences of the busiest rank
    steps = -(-most // args.batch_size)
    for step in range(steps):
        chunk = mine[step * args.batch_size: (step + 1) * args.batch_size]
        filler = not chunk
        rows = [records[i]["token_ids"] for i in (chunk or mine[-1:] or [0])]
        ids = pad_sequences(rows)
        mask = pad_sequences([[1] * len(r) for r in rows])
        out = engine.compute_logprobs(Batch({"input_ids": ids, "attention_mask": mask}),
                                      temperature=args.temperature)
        if out is not None and not filler:
            for row, i in enumerate(chunk):
                n = len(records[i]["token_ids"])
                scored[i] = [None] + out["logprobs"][row, 1:n].tolist()
        progress.update(len(chunk))
    progress.close()
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(scored if engine.is_output_rank else {}, gathered, dst=0, group=ctx.control_group)
    if ctx.rank == 0:
        merged: dict[int, list] = {}
        for part in gathered:
            merged.update(part)
        with open(args.output, "w") as f:
            for i, rec in enumerate(records):
                f.write(json.dumps({"id": rec["id"], "logprobs": merged[i]}) + "\n")
        print(f"hybridrl score: wrote {len(records)} sequences to {args.output}", file=sys.stderr)
    dist.barrier(group=ctx.control_group)
    shutdown_distributed()


def _progress(total: int, *, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="scoring", unit="seq", disable=not enabled)


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    parser = argparse.ArgumentParser(prog="python -m hybridrl.backends.megatron.score")
    add_arguments(parser)
    run_then_leave(lambda: run_rank(parser.parse_args()))
