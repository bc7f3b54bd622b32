"""Train-step throughput: hybridrl's MegatronEngine.train_step vs a plain transformers step.

    python benchmarks/train_step.py --json out.json                 # builds a small Qwen2 model
    python benchmarks/train_step.py --model HF_DIR --batch 8 --seq 256 --json out.json

Both sides get the same model (from one HF directory), the same batch (right-padded sequences of
mixed lengths) and the same objective (a REINFORCE-style token loss, token-mean over the loss
mask, global-norm clipping at 1.0, AdamW). The transformers side is the plain loop: forward,
log_softmax + gather, backward, clip, AdamW step. They run interleaved in one process, round
by round, so that machine noise hits both alike; the JSON holds medians and their ratio.
Runs as one rank (world size 1, TP=1) unless started under torchrun (then only rank 0 times the
transformers side, after the others finish their step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write results here")
    p.add_argument("--model", default=None, help="HF model directory (default: build a small qwen2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="longest sequence; others are 50-100%% of it")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (median reported)")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores / ranks)")
    return p.parse_args()


def ensure_dist() -> None:
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(batch: int, seq: int, vocab: int):
    from hybridrl.data.batch import Batch, pad_sequences

    gen = torch.Generator().manual_seed(0)
    lengths = [max(2, int(seq * (0.5 + 0.5 * (i + 1) / batch))) for i in range(batch)]
    rows = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    ids = pad_sequences(rows)
    mask = pad_sequences([[1] * n for n in lengths])
    loss_mask = mask.float()
    loss_mask[:, : seq // 8] = 0.0                                   # a prompt that is not trained on
    adv = torch.randn(batch, 1, generator=gen).expand(-1, ids.shape[1]).contiguous()
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, "advantages": adv})


def pg_loss(logprobs, entropy, mb):
    return -mb["advantages"].to(logprobs.device) * logprobs, {}


class HFStep:
    """The plain transformers loop, same objective."""

    def __init__(self, model_dir: str, lr: float):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)

    def __call__(self, batch) -> float:
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = torch.zeros(ids.shape)
        lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        token_loss, _ = pg_loss(lp, None, batch)
        loss = (token_loss * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()


def main() -> int:
    args = parse_args()
    ensure_dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    from hybridrl.backends.megatron import MegatronConfig, MegatronEngine

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

        tmp = tempfile.mkdtemp(prefix="bench-train-step-")
        if rank == 0:
            build_tiny_model(tmp, TinyModelSpec(arch="qwen2", hidden=args.hidden, layers=args.layers,
                                                heads=max(2, args.hidden // 64), kv_heads=max(1, args.hidden // 128),
                                                intermediate=3 * args.hidden, max_position=max(2048, args.seq)))
        model_dir = [tmp]
        dist.broadcast_object_list(model_dir, src=0)
        model_dir = model_dir[0]
    lr = 1e-5
    cfg = MegatronConfig(tp=args.tp, micro_batch_size=args.micro_batch_size, lr=lr, weight_decay=0.01,
                         use_distributed_optimizer=True)
    engine = MegatronEngine.from_hf(model_dir, cfg)
    vocab = engine.adapter.spec.vocab_size
    full = make_batch(args.batch, args.seq, vocab)
    mine = full.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank(rank)]
    tokens = int(full["attention_mask"].sum())
    hf = HFStep(model_dir, lr) if rank == 0 else None

    first = {"hybridrl": engine.train_step(mine, pg_loss)["loss"], "hf": hf(full) if hf else None}
    for _ in range(args.warmup - 1):
        engine.train_step(mine, pg_loss)
        if hf:
            hf(full)
    ours, theirs = [], []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps_per_round):
            engine.train_step(mine, pg_loss)
        dist.barrier()
        ours.append((time.perf_counter() - t0) / args.steps_per_round)
        if hf:
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                hf(full)
            theirs.append((time.perf_counter() - t0) / args.steps_per_round)
        dist.barrier()
    if rank == 0:
        ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
        result = {
            "hybridrl_tokens_per_s": tokens / ours_s,
            "hf_tokens_per_s": tokens / theirs_s,
            "ratio": theirs_s / ours_s,                 # > 1: hybridrl is faster
            "hybridrl_step_s_median": ours_s, "hf_step_s_median": theirs_s,
            "hybridrl_step_s": ours, "hf_step_s": theirs,
            "tokens_per_step": tokens, "batch": args.batch, "seq": args.seq,
            "micro_batch_size": args.micro_batch_size, "tp": args.tp, "world_size": world,
            "num_parameters": engine.num_parameters(), "model": args.model or f"qwen2 hidden={args.hidden} "
                                                                           f"layers={args.layers} (built)",
            "first_loss": first, "threads_per_rank": torch.get_num_threads(), "device": str(engine.device),
            "rounds": args.rounds, "steps_per_round": args.steps_per_round,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: result[k] for k in ("hybridrl_tokens_per_s", "hf_tokens_per_s", "ratio",
                                                 "num_parameters", "tokens_per_step")}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
