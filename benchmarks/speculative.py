"""Speculative decoding by prompt lookup (`rollout.native.speculative_tokens`): decode speed with drafts vs without.

    python benchmarks/speculative.py --model runs/demo/sft/hf --json out.json [--batch 1,16] [--repeats 5]

Workload: the calculator task's two generation turns, rendered with the model's chat template as the agent
loop sends them: "call" prompts (the question; the model writes `<calc>EXPR</calc>`, copying the
expression) and "answer" prompts (question, call and tool result; the model writes `<answer>VALUE</answer>`,
copying the result). Half of each, validation questions, sampled at --temperature (1.0, as GRPO samples)
and greedy. A model trained on the task is needed (the demo's SFT model: `hybridrl demo` writes it to
runs/demo/sft/hf); a random model never copies, so its drafts are rejected and only their cost is measured.

Each repeat runs both engines (speculative_tokens=0 and =--speculative-tokens, otherwise the same config)
on the same requests back to back, the order alternating; reported per batch size: medians over the
repeats of output tokens / s (submission to the last output), engine forward steps, the acceptance rate
(accepted / drafted tokens), and the median of the paired per-repeat speed ratios. Outputs are checked equal
between the two engines (same seeds): speculation must not change what is generated.
"""

from __future__ import annotations

import argparse
import random
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's package, whatever the venv has installed


def calculator_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """n prompts: alternately a question alone and question + tool call + tool result (validation questions)."""
    from transformers import AutoTokenizer

    from hybridrl.agent.chat import ChatFormat
    from hybridrl.envs.config import TaskConfig
    from hybridrl.envs.tasks.calculator import CalculatorTask

    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    task = CalculatorTask(TaskConfig(name="calculator"))
    rng = random.Random(0)
    prompts = []
    for i, inst in enumerate(task.validation_split(n)):
        chat = task.demonstration(inst, rng, use_tool=True, guess_correct=True)
        # before the call / before the answer, laid out as the agent loop lays out episodes
        prompts.append(fmt.prompt_ids(chat[:1]) if i % 2 == 0 else fmt.conversation_ids(chat[:3])[0])
    return prompts


def run(engine, prompts, temperature: float, max_new_tokens: int, tag: str) -> dict:
    from hybridrl.rollout.protocol import SamplingParams

    before = engine.stats()

    async def go():
        return await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i),
                            f"{tag}-{i}") for i, p in enumerate(prompts)])

    t0 = time.perf_counter()
    outs = asyncio.run(go())
    seconds = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "steps": after["steps"] - before["steps"],
            "drafted": after["spec_draft_tokens"] - before["spec_draft_tokens"],
            "accepted": after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
            "outputs": [o.token_ids for o in outs]}


def bench(engines: dict, prompts: list[list[int]], batch: int, temperature: float, args) -> dict:
    """Requests in waves of `batch` concurrent ones; both engines per repeat, the order alternating."""
    rows = {name: [] for name in engines}
    ratios = []
    identical = True
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        got = {}
        for name in order:
            waves = [run(engines[name], prompts[i:i + batch], temperature, args.max_new_tokens, f"{name}{rep}-{i}")
                     for i in range(0, len(prompts), batch)]
            got[name] = {k: sum(w[k] for w in waves) for k in ("tokens", "seconds", "steps", "drafted", "accepted")}
            got[name]["tokens_per_s"] = got[name]["tokens"] / got[name]["seconds"]
            got[name]["outputs"] = [o for w in waves for o in w["outputs"]]
        identical &= got["plain"]["outputs"] == got["speculative"]["outputs"]
        for name in engines:
            rows[name].append({k: v for k, v in got[name].items() if k != "outputs"})
        ratios.append(got["speculative"]["tokens_per_s"] / got["plain"]["tokens_per_s"])
    out = {"batch": batch, "temperature": temperature, "identical_outputs": identical,
           "ratio_tokens_per_s": statistics.median(ratios), "ratios": ratios}
    for name, rs in rows.items():
        out[name] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "steps": statistics.median(r["steps"] for r in rs),
                     "tokens": rs[0]["tokens"], "repeats": rs}
    spec = rows["speculative"][0]
    out["acceptance"] = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
    out["steps_ratio"] = out["plain"]["steps"] / out["speculative"]["steps"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF directory of a model trained on the calculator task")
    parser.add_argument("--json", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch", default="1,16", help="comma list: concurrent requests per wave")
    parser.add_argument("--temperatures", default="1.0,0.0")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    model = Path(args.model)
    prompts = calculator_prompts(model, args.requests)
    cfg = NativeEngineConfig(kv_cache_mb=64)
    engines = {"plain": NativeEngine.from_pretrained(model, cfg),
               "speculative": NativeEngine.from_pretrained(model, replace(
                   cfg, speculative_tokens=args.speculative_tokens, speculative_ngram_min=args.ngram_min,
                   speculative_ngram_max=args.ngram_max))}
    results = []
    try:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                r = bench(engines, prompts, batch, temperature, args)
                results.append(r)
                print(f"T={temperature} batch={batch}: {r['plain']['tokens_per_s']:.0f} -> "
                      f"{r['speculative']['tokens_per_s']:.0f} tokens/s (x{r['ratio_tokens_per_s']:.2f}), steps "
                      f"{r['plain']['steps']:.0f} -> {r['speculative']['steps']:.0f}, acceptance "
                      f"{r['acceptance']:.2f}, identical outputs {r['identical_outputs']}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    report = {"benchmark": "speculative", "model": str(model), "requests": args.requests,
              "max_new_tokens": args.max_new_tokens, "speculative_tokens": args.speculative_tokens,
              "ngram": [args.ngram_min, args.ngram_max], "repeats": args.repeats, "threads": args.threads,
              "mean_prompt_tokens": statistics.fmean(map(len, prompts)), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
