"""The compute floor of a measured GRPO step: how fast could this machine run it at all?

    python benchmarks/step_floor.py --vs-trl-json runs/bench/vs_trl_sizes.json --json OUT [--threads 2]

Reads a `benchmarks/vs_trl.py --model-size` record (its workload, its hybridrl overrides, every run's
phase times and TRL's step), then measures on this machine the throughput of the matrix products a
step is made of, at the model's shapes and the step's row counts, in float32 with `--threads` threads
(the training rank's):

- training: every linear layer's forward, input gradient and weight gradient (6 FLOPs per parameter
  per token) at the micro-batch's token count (`train.max_tokens_per_micro_batch`), over the tokens the
  step computes: each prompt's tokens once per group (`train.share_prefix`, the recipe's setting)
  plus every completion's;
- rollout: the forward of every linear layer at the batch's row count once per decode step (one
  step per completion token), plus the prompts' prefill at their token count.

The floor is those FLOPs at the measured throughput: a step that did nothing but its matrix
products, each as fast as MKL runs it alone. Attention's score products (sequences of ~55 tokens
here), norms, the optimizer and the sampler are left out, so the floor is below what any
implementation reaches. With TRL's measured step it bounds the speed-up over TRL this machine
allows: TRL's step / (floor of training + floor of rollout + hybridrl's measured T_sync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linear layers (Qwen2 / Llama: q, k, v, o, gate, up, down)."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    ffn = config["intermediate_size"]
    return [(h, heads * head_dim), (h, kv * head_dim), (h, kv * head_dim), (heads * head_dim, h),
            (h, ffn), (h, ffn), (ffn, h)]


def _seconds(fns: list, reps: int) -> float:
    for f in fns:
        f()
    start = time.perf_counter()
    for _ in range(reps):
        for f in fns:
            f()
    return (time.perf_counter() - start) / reps


def layer_seconds(shapes: list[tuple[int, int]], rows: int, backward: bool, reps: int = 10) -> float:
    """Seconds of one layer's products at `rows` tokens: the forward, and with `backward` both gradients."""
    total = 0.0
    for k, n in shapes:
        x, w, g = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
        fns = [lambda x=x, w=w: x @ w.t()]
        if backward:
            fns += [lambda g=g, w=w: g @ w, lambda g=g, x=x: g.t() @ x]
        total += _seconds(fns, reps)
    return total


def floor(size: dict, config: dict, threads: int) -> dict:
    torch.set_num_threads(threads)
    work, overrides = size["workload"], dict(o.split("=", 1) for o in size["hybridrl_overrides"])
    groups, rows = work["prompts_per_step"], work["prompts_per_step"] * work["group_size"]
    prompt = size["prompt_tokens_mean"]
    completion = statistics.median(r["completion_tokens"] for r in size["runs"]["hybridrl"])
    layers, shapes = config["num_hidden_layers"], linear_shapes(config)
    params = layers * sum(k * n for k, n in shapes)
    micro = int(overrides.get("train.max_tokens_per_micro_batch", 0)) or int(rows * (prompt + completion))
    trained = groups * prompt + rows * completion                 # each prompt once per group, every completion
    train_s = layers * layer_seconds(shapes, micro, backward=True) * trained / micro
    decode_s = layers * layer_seconds(shapes, rows, backward=False) * round(completion)
    prefill_s = layers * layer_seconds(shapes, max(1, round(groups * prompt)), backward=False)
    med = lambda key: statistics.median(r["stage_times"][key] for r in size["runs"]["hybridrl"])  # noqa: E731
    out = {"linear_parameters": params, "train_tokens_computed": trained, "micro_batch_tokens": micro,
           "train_gflop_per_s": 6 * params * trained / train_s / 1e9, "train_floor_s": train_s,
           "rollout_floor_s": decode_s + prefill_s, "decode_steps": round(completion), "decode_rows": rows,
           "measured_T_train": med("T_train"), "measured_T_rollout": med("T_rollout"), "measured_T_sync": med("T_sync")}
    out["train_share_of_floor"] = train_s / out["measured_T_train"]
    out["rollout_share_of_floor"] = out["rollout_floor_s"] / out["measured_T_rollout"]
    if "trl" in size["median_step_s"]:
        best = train_s + out["rollout_floor_s"] + out["measured_T_sync"]
        out.update({"trl_step_s": size["median_step_s"]["trl"], "hybridrl_step_s": size["median_step_s"]["hybridrl"],
                    "max_speedup_over_trl": size["median_step_s"]["trl"] / best,
                    "measured_speedup_over_trl": size["speedup_median"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs-trl-json", required=True, help="a `benchmarks/vs_trl.py --model-size` record")
    ap.add_argument("--json", required=True)
    ap.add_argument("--threads", type=int, default=2, help="threads of the products (the training rank's)")
    args = ap.parse_args()
    sizes = json.loads(Path(args.vs_trl_json).read_text()).get("sizes")
    if not sizes:
        raise SystemExit(f"{args.vs_trl_json}: not a --model-size record of benchmarks/vs_trl.py (no 'sizes')")
    result = {}
    for name, size in sizes.items():
        config = json.loads((Path(size["model"]) / "config.json").read_text())
        result[name] = floor(size, config, args.threads)
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result[name].items()}),
              flush=True)
    Path(args.json).write_text(json.dumps({"threads": args.threads, "sizes": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
