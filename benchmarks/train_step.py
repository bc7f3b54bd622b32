"""Train-step throughput: hybridrl's MegatronEngine.train_step vs a plain transformers step.

    python benchmarks/train_step.py --json out.json                 # builds a small Qwen2 model
    python benchmarks/train_step.py --model HF_DIR --batch 8 --seq 256 --json out.json
    python benchmarks/train_step.py --shape demo --json out.json    # the demo's RL batch, packed vs padded

--shape demo: the demo's model shape (Qwen2, hidden 192, 4 layers, 6 heads / 2 KV heads, FFN 512)
and its RL batch: 128 episodes (16 prompts x 8 samples, the 8 samples of a prompt beginning with
the same tokens) of mixed lengths like the calculator task's: a ~60-token prompt, then either a
short direct answer or a multi-turn tool-calling response (up to 96 response tokens). Four steps
are timed round by round: hybridrl with padded micro-batches (--micro-batch-size rows, the demo
recipe's 32), hybridrl with packed micro-batches (--max-tokens per micro-batch), hybridrl with
those packs sharing each prompt's tokens (`share_prefix`), and the plain transformers step on the
whole batch.

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
    p.add_argument("--shape", choices=("uniform", "demo"), default="uniform",
                   help="uniform: --batch rows of 50-100%% of --seq; demo: the demo's model and RL batch")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="also time hybridrl with packed micro-batches of this many tokens (demo default 2048)")
    args = p.parse_args()
    if args.shape == "demo":
        args.hidden, args.layers, args.batch = 192, 4, 128
        args.max_tokens = args.max_tokens or 2048
        if "--micro-batch-size" not in sys.argv:
            args.micro_batch_size = 32
    return args


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


def make_demo_batch(batch: int, vocab: int, group: int = 8):
    """Episodes shaped like the demo's calculator RL batch: prompt 52-66 tokens, the same for each
    `group` consecutive rows (the samples of one prompt); 60% answer directly (8-30 response
    tokens), 40% call the tool over 2-3 turns (50-96 response tokens)."""
    from hybridrl.data.batch import Batch, pad_sequences

    gen = torch.Generator().manual_seed(0)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    prompts, lengths = [], []
    for i in range(batch):
        prompt = draw(52, 66) if i % group == 0 else prompts[-1]
        response = draw(8, 30) if float(torch.rand(1, generator=gen)) < 0.6 else draw(50, 96)
        prompts.append(prompt)
        lengths.append(prompt + response)
    rows = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    for i in range(batch):
        rows[i][:prompts[i]] = rows[i - i % group][:prompts[i]]
    ids = pad_sequences(rows)
    mask = pad_sequences([[1] * n for n in lengths])
    loss_mask = mask.float()
    for r, n in enumerate(prompts):
        loss_mask[r, :n] = 0.0
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
            demo = args.shape == "demo"
            build_tiny_model(tmp, TinyModelSpec(arch="qwen2", hidden=args.hidden, layers=args.layers,
                                                heads=6 if demo else max(2, args.hidden // 64),
                                                kv_heads=2 if demo else max(1, args.hidden // 128),
                                                intermediate=512 if demo else 3 * args.hidden,
                                                max_position=max(2048, args.seq)))
        model_dir = [tmp]
        dist.broadcast_object_list(model_dir, src=0)
        model_dir = model_dir[0]
    lr = 1e-5
    variants = {"padded": (0, False),
                **({"packed": (args.max_tokens, False), "shared": (args.max_tokens, True)} if args.max_tokens else {})}
    engines = {}
    for name, (max_tokens, share) in variants.items():   # training engines sharing the parallel state
        cfg = MegatronConfig(tp=args.tp, micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=max_tokens,
                             share_prefix=share, lr=lr, weight_decay=0.01, use_distributed_optimizer=True)
        engines[name] = MegatronEngine.from_hf(model_dir, cfg)
    engine = engines["padded"]
    vocab = engine.adapter.spec.vocab_size
    full = make_demo_batch(args.batch, vocab) if args.shape == "demo" else make_batch(args.batch, args.seq, vocab)
    mine = full.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank(rank)]
    tokens = int(full["attention_mask"].sum())
    hf = HFStep(model_dir, lr) if rank == 0 else None
    load_before = os.getloadavg()

    firsts = {name: e.train_step(mine, pg_loss) for name, e in engines.items()}
    first = {name: m["loss"] for name, m in firsts.items()}
    model_tokens = {name: m.get("model_tokens") for name, m in firsts.items()}
    first["hf"] = hf(full) if hf else None
    for _ in range(args.warmup - 1):
        for e in engines.values():
            e.train_step(mine, pg_loss)
        if hf:
            hf(full)
    times: dict[str, list[float]] = {name: [] for name in engines}
    times["hf"] = []
    for _ in range(args.rounds):
        for name, e in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                e.train_step(mine, pg_loss)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps_per_round)
        if hf:
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                hf(full)
            times["hf"].append((time.perf_counter() - t0) / args.steps_per_round)
        dist.barrier()
    if rank == 0:
        med = {name: statistics.median(t) for name, t in times.items()}
        ours_s, theirs_s = med["padded"], med["hf"]
        result = {
            "hybridrl_tokens_per_s": tokens / ours_s,             # padded micro-batches
            "hf_tokens_per_s": tokens / theirs_s,
            "ratio": theirs_s / ours_s,                 # > 1: hybridrl (padded) is faster
            "hybridrl_step_s_median": ours_s, "hf_step_s_median": theirs_s,
            "hybridrl_step_s": times["padded"], "hf_step_s": times["hf"],
            "tokens_per_step": tokens, "padded_tokens_per_step": int(full["attention_mask"].numel()),
            "batch": args.batch, "seq": args.seq if args.shape == "uniform" else int(full["input_ids"].shape[1]),
            "shape": args.shape, "micro_batch_size": args.micro_batch_size, "tp": args.tp, "world_size": world,
            "num_parameters": engine.num_parameters(), "model": args.model or f"qwen2 hidden={args.hidden} "
                                                                           f"layers={args.layers} (built)",
            "first_loss": first, "threads_per_rank": torch.get_num_threads(), "device": str(engine.device),
            "rounds": args.rounds, "steps_per_round": args.steps_per_round,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
        }
        if "packed" in med:
            result.update({
                "max_tokens_per_micro_batch": args.max_tokens,
                "packed_tokens_per_s": tokens / med["packed"], "packed_step_s_median": med["packed"],
                "packed_step_s": times["packed"],
                "packed_over_padded": med["padded"] / med["packed"],     # the target: >= 2
                "packed_over_hf": med["hf"] / med["packed"],             # the target: >= 1.2
                "shared_tokens_per_s": tokens / med["shared"], "shared_step_s_median": med["shared"],
                "shared_step_s": times["shared"], "shared_over_packed": med["packed"] / med["shared"],
                "shared_model_tokens_per_step": model_tokens["shared"],
                "packed_model_tokens_per_step": model_tokens["packed"],
            })
        Path(args.json).write_text(json.dumps(result, indent=2))
        keys = ("hybridrl_tokens_per_s", "packed_tokens_per_s", "shared_tokens_per_s", "hf_tokens_per_s", "ratio",
                "packed_over_padded", "packed_over_hf", "shared_over_packed", "shared_model_tokens_per_step",
                "packed_model_tokens_per_step", "num_parameters", "tokens_per_step", "load_average_before")
        print(json.dumps({k: result[k] for k in keys if k in result}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
