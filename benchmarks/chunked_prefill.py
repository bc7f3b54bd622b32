"""Chunked prefill: decode inter-token latency while long prompts arrive, with the prefill chunked vs whole.

    python benchmarks/chunked_prefill.py --json out.json [--size demo] [--model DIR] [--repeats 5]

The native engine always prefills a prompt in chunks of the step's token budget
(`rollout.native.max_num_batched_tokens`), decodes first: a step never computes more tokens than the
budget, so a running sequence's next token waits for at most one budget's worth of prefill. "whole" is
the same engine with a budget above the longest prompt (each long prompt prefilled in one step, as an
engine without chunking does). Workload, driven step by step on the synchronous core: --decodes requests
with short prompts decode --decode-tokens tokens each (greedy); after every --every steps one of
--long long prompts (--long-len tokens) arrives and generates 8 tokens. Reported per mode (medians over
repeats, the modes alternating): the decoding requests' inter-token latency p50 / p90 / p99 / max from the
engine's own per-token timestamps, the long requests' time to first token, wall time, and whether both
modes generated the same tokens (greedy: chunking must not change them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's package, whatever the venv has installed

SIZES = {"demo": dict(hidden=192, layers=4, heads=6, kv_heads=2, intermediate=512),
         "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768),
         "medium": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536)}


def run_mode(model_dir: Path, budget: int, args) -> dict:
    from hybridrl.backends.native import NativeEngineConfig
    from hybridrl.backends.native.core import EngineCore
    from hybridrl.rollout.protocol import SamplingParams

    cfg = NativeEngineConfig(kv_cache_mb=256, max_num_batched_tokens=budget, enable_prefix_caching=False)
    core = EngineCore.from_pretrained(model_dir, cfg, device=torch.device("cpu"))
    vocab = core.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    decodes = [core.make_sequence(torch.randint(10, vocab, (16,), generator=g).tolist(),
                                  SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True), f"d{i}")
               for i in range(args.decodes)]
    longs = [core.make_sequence(torch.randint(10, vocab, (args.long_len,), generator=g).tolist(),
                                SamplingParams(max_new_tokens=8, ignore_eos=True), f"l{i}") for i in range(args.long)]
    for seq in decodes:
        core.add(seq)
    pending = list(longs)
    t0 = time.perf_counter()
    steps = 0
    while core.has_work() or pending:
        if pending and steps % args.every == args.every - 1:
            seq = pending.pop(0)
            seq.t_submit = time.monotonic()
            core.add(seq)
        core.step()
        steps += 1
    wall = time.perf_counter() - t0
    itl = np.concatenate([np.diff(s.token_times) for s in decodes])
    return {"itl_p50_s": float(np.percentile(itl, 50)), "itl_p90_s": float(np.percentile(itl, 90)),
            "itl_p99_s": float(np.percentile(itl, 99)), "itl_max_s": float(itl.max()),
            "long_ttft_median_s": statistics.median(s.token_times[0] - s.t_submit for s in longs),
            "wall_s": wall, "steps": steps, "outputs": [s.output_ids for s in decodes + longs]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--model", default=None, help="an HF directory instead of a built --size")
    parser.add_argument("--budget", type=int, default=256, help="the chunked mode's max_num_batched_tokens")
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--every", type=int, default=12, help="steps between long-prompt arrivals")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

        model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / args.size, TinyModelSpec(**SIZES[args.size]))
    modes = {"chunked": args.budget, "whole": max(args.long_len + args.decodes + 64, 2048)}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for rep in range(args.repeats):
        for name in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
            runs[name].append(run_mode(model_dir, modes[name], args))
    report = {"benchmark": "chunked_prefill", "model": str(model_dir), "args": vars(args), "budgets": modes,
              "identical_outputs": all(a["outputs"] == b["outputs"] for a, b in zip(runs["chunked"], runs["whole"]))}
    for name, rs in runs.items():
        report[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "outputs"}
        report[name]["repeats"] = [{k: v for k, v in r.items() if k != "outputs"} for r in rs]
    for key in ("itl_p90_s", "itl_p99_s", "itl_max_s"):
        report[f"ratio_{key}_whole_over_chunked"] = report["whole"][key] / report["chunked"][key]
    print(json.dumps({k: v for k, v in report.items() if k not in ("chunked", "whole", "args")}, indent=1))
    for name in modes:
        print(name, {k: round(v, 4) for k, v in report[name].items() if k != "repeats"})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
