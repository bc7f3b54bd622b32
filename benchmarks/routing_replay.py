"""What rollout routing replay costs, side by side in one run (interleaved repeats, medians):

    python benchmarks/routing_replay.py --json out.json [--repeats 5] [--episodes 64]

On the tiny Qwen3-MoE of the MoE demo (`recipes/calc_moe_sft_cpu.yaml`'s base model, built offline):
1. the native engine generating `--episodes` sampled requests (prompts 16-64 tokens, 32-96 new
   tokens) with its routing record (as it always runs for MoE models) vs with the record switched
   off (the routing cache removed): tokens/s, and the record's bytes per token;
2. the Megatron trainer (one rank) computing the logprobs of those episodes, and one training
   step on them, with the batch's routing replayed (`algo.router_replay=rollout`) vs without a
   record at all (the router's own choice, no statistics): seconds.
Each repeat runs both variants back to back, the order alternating; the machine may be shared, so
the JSON reports each side's median and the median of the paired ratios, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(arch="qwen3_moe", hidden=192, layers=4, heads=6, kv_heads=2, intermediate=512, experts=8,
             experts_per_tok=2, moe_intermediate=192, init_std=0.05)


def generate(engine, prompts, budgets, seed):
    from hybridrl.rollout.protocol import SamplingParams

    async def go():
        return await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=seed + i),
                            f"r{seed}-{i}") for i, (p, n) in enumerate(zip(prompts, budgets))])

    started = time.perf_counter()
    outs = asyncio.run(go())
    return outs, time.perf_counter() - started


def engine_side(model_dir, prompts, budgets, repeats):
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=64, max_num_seqs=64))
    runner = engine.core.runner
    saved = runner.routing
    tokens = sum(budgets)
    rates = {"record": [], "no_record": []}
    ratios = []
    outs = None
    for r in range(repeats):
        order = ("record", "no_record") if r % 2 == 0 else ("no_record", "record")
        seconds = {}
        for variant in order:
            runner.routing = saved if variant == "record" else None
            out, seconds[variant] = generate(engine, prompts, budgets, seed=1000 * r)
            if variant == "record":
                outs = out
        runner.routing = saved
        for v in seconds:
            rates[v].append(tokens / seconds[v])
        ratios.append(seconds["record"] / seconds["no_record"])
    engine.close()
    record = outs[0].routed_experts
    return outs, {"tokens": tokens,
                  "tokens_per_s": {v: statistics.median(x) for v, x in rates.items()},
                  "time_ratio_record_over_none": statistics.median(ratios), "ratios": ratios,
                  "record_bytes_per_token": record.shape[1] * record.shape[2] * record.element_size(),
                  "record_dtype": str(record.dtype)}


def trainer_side(model_dir, outs, prompts, repeats):
    import torch.distributed as dist

    from hybridrl.backends.megatron import MegatronConfig, MegatronEngine, moe
    from hybridrl.data.trajectory import Trajectory, to_batch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    trajectories = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        t = Trajectory(run_id="b", task_id="t", group_id=f"g{i}", attempt=0, prompt_ids=p)
        t.append(o.token_ids, policy=True, logprobs=o.logprobs, version=0, routed_experts=o.routed_experts)
        trajectories.append(t)
    with_record = to_batch(trajectories)
    with_record.set("advantages", torch.randn(len(with_record), 1).expand_as(with_record["loss_mask"]).contiguous())
    without = with_record.select(list(range(len(with_record))))
    without.tensors.pop("routed_experts")
    engine = MegatronEngine.from_hf(model_dir, MegatronConfig(micro_batch_size=16, max_tokens_per_micro_batch=2048,
                                                              lr=1e-6))

    def loss(logprobs, entropy, mb):
        return -mb["advantages"].to(logprobs.device) * logprobs, {}

    seconds = {k: [] for k in ("logprobs_replay", "logprobs_own", "train_replay", "train_own")}
    for r in range(repeats):
        for variant in (("replay", "own") if r % 2 == 0 else ("own", "replay")):
            batch = with_record if variant == "replay" else without
            moe.set_mode(engine.model, "rollout" if variant == "replay" else "off")
            started = time.perf_counter()
            engine.compute_logprobs(batch)
            seconds[f"logprobs_{variant}"].append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.train_step(batch, loss)
            seconds[f"train_{variant}"].append(time.perf_counter() - started)
    dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {"seconds": med, "logprobs_ratio": med["logprobs_replay"] / med["logprobs_own"],
            "train_ratio": med["train_replay"] / med["train_own"], "all_seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "moe", TinyModelSpec(**MODEL))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist()
                   for n in torch.randint(16, 65, (args.episodes,), generator=g)]
        budgets = torch.randint(32, 97, (args.episodes,), generator=g).tolist()
        outs, engine = engine_side(model_dir, prompts, budgets, args.repeats)
        trainer = trainer_side(model_dir, outs, prompts, args.repeats)
    result = {"model": MODEL, "episodes": args.episodes, "repeats": args.repeats,
              "load_average": os.getloadavg(), "engine": engine, "trainer": trainer}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({"engine_time_ratio": engine["time_ratio_record_over_none"],
                      "engine_tokens_per_s": engine["tokens_per_s"],
                      "bytes_per_token": engine["record_bytes_per_token"],
                      "trainer_logprobs_ratio": trainer["logprobs_ratio"], "trainer_train_ratio": trainer["train_ratio"],
                      "load_average": result["load_average"]}, indent=1))


if __name__ == "__main__":
    main()
