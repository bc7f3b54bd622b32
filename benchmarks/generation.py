"""Generation throughput: the native engine against transformers `generate` and vLLM, side by side.

    python benchmarks/generation.py --json out.json [--sizes tiny,small,medium] [--batch 32] [--torch-peer]
    .venv-vllm/bin/python benchmarks/generation.py --json out.json --vllm vllm,vllm_packed   # with vLLM

vLLM is a peer where it is importable (its own venv: `make vllm-venv`) and the model's head size is
one its CPU attention takes; it gets the requests through the same async engine API as the native
engine (`hybridrl.backends.vllm`), with its worker on --threads threads. Each repeat runs every peer
back to back, the order rotating; ratios are medians of the paired per-repeat ratios.

Workload (the same for every peer, per model size): `--batch` requests with prompt lengths drawn
uniformly from --prompt-len (default 16:128) and output budgets from --output-len (default
16:128), sampling at --temperature (default 0.7), EOS on. transformers gets the batch as one
left-padded `generate` call with a per-row stopping criterion enforcing each row's budget (it
cannot do per-row budgets otherwise); the engine gets every request at once through its async
API. Output tokens counted are the real ones of each row (up to its budget or its EOS). Each
repeat runs both back to back (the order alternates), giving one paired ratio; the machine is
shared, so the headline `ratio` is the median of the paired ratios (robust to load that drifts
between repeats), reported with the medians of each side's tokens/s.
Models are seeded random Qwen2-architecture models built offline (hybridrl.assets.tiny_model),
so their size is stated exactly (parameters in the JSON).

A second, long-prompt shape runs on the headline size (`long_prompt` in the JSON; --long-prompt-len,
--long-output-len, --long-batch; --no-long to skip): prompts longer than a step's token budget are
prefilled in chunks while the running rows keep decoding. `--torch-peer` adds the native engine with
`rollout.native.kernels=torch` (torch operators only, no C kernels) as a peer, so the kernels' share of
the ratio is measured in the same run (`ratio_native_engine_torch`).

`roofline` (per size and per repeat): the native engine's seconds per engine step against the
memory-bandwidth floor of a step, the weights' bytes read once at the copy bandwidth of a buffer of
that size measured right after the repeat (`x_roofline` = step time / floor; every step, decode or
prefill chunk, reads every weight once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's package, whatever the venv has installed

from hybridrl.host_memory import choose_blas_path  # noqa: E402

# MKL's path as the hybridrl CLI sets it (both sides of the comparison alike); MKL_CBWR= keeps MKL's own
choose_blas_path()

SIZES = {
    # name: TinyModelSpec overrides. "demo" is the architecture of the CPU calculator demo's base
    # model (hybridrl.demo.BASE_MODEL_ARGS); "h128" its earlier, smaller one.
    "demo": dict(hidden=192, layers=4, heads=6, kv_heads=2, intermediate=512),
    "h128": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768),
    "medium": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
}


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_workload(batch: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt_len[0], prompt_len[1] + 1, (batch,), generator=g).tolist()
    olens = torch.randint(output_len[0], output_len[1] + 1, (batch,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in plens]
    return prompts, olens


def count_tokens(row: list[int], budget: int, eos: set[int]) -> int:
    for i, t in enumerate(row[:budget]):
        if t in eos:
            return i + 1
    return min(len(row), budget)


def run_hf(model, prompts, olens, eos, temperature, top_p, seed) -> tuple[int, float]:
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hybridrl.data.batch import pad_sequences

    ids = pad_sequences(prompts, left=True)
    mask = pad_sequences([[1] * len(p) for p in prompts], left=True)
    width = ids.shape[1]
    budgets = torch.tensor(olens)

    class PerRowBudget(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - width) >= budgets

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                             top_p=top_p, top_k=0, max_new_tokens=max(olens), pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([PerRowBudget()]))
    seconds = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    return sum(count_tokens(row, b, eos) for row, b in zip(gen, olens)), seconds


def run_engine(engine, prompts, olens, temperature, top_p, seed, tag) -> tuple[int, float]:
    from hybridrl.rollout.protocol import SamplingParams

    async def go():
        return await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_new_tokens=n, temperature=temperature, top_p=top_p, seed=seed + i),
                            f"{tag}-{i}")
            for i, (p, n) in enumerate(zip(prompts, olens))])

    t0 = time.perf_counter()
    outs = asyncio.run(go())
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def roofline(seconds: float, steps: int, weight_bytes: int) -> dict[str, float]:
    """The engine's time per step (every step reads every weight once: prefill chunks ride along with
    the decodes) against the memory-bandwidth floor: the weights' bytes at the copy bandwidth measured
    now, beside the run, the way the mode-switch benchmark measures its floor."""
    from hybridrl.bench.mode_switch import copy_bandwidth

    bandwidth = copy_bandwidth(weight_bytes, torch.device("cpu"))
    floor = weight_bytes / bandwidth
    return {"copy_gb_s": round(bandwidth / 1e9, 2), "step_s": round(seconds / steps, 7),
            "floor_step_s": round(floor, 7), "x_roofline": round(seconds / steps / floor, 3)}


VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)    # vLLM's CPU attention kernel


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def bench_size(name: str, model_dir: Path, args, shape: dict) -> dict:
    """Every peer on the same workload (`shape`: batch, prompt_len, output_len); each repeat runs them back to
    back, the order rotating."""
    from transformers import AutoModelForCausalLM

    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in hf.parameters())
    cfg = NativeEngineConfig(kv_cache_mb=args.kv_cache_mb, max_num_seqs=max(64, shape["batch"]),
                             max_num_batched_tokens=args.max_num_batched_tokens, kernels=args.kernels,
                             dtype=args.dtype)
    engines = {"engine": NativeEngine.from_pretrained(model_dir, cfg, device="cpu")}
    if args.torch_peer:
        engines["engine_torch"] = NativeEngine.from_pretrained(model_dir, replace(cfg, kernels="torch"), device="cpu")
    eos = set(engines["engine"].eos_token_ids)
    skipped = {}
    wanted = [e for e in args.vllm.split(",") if e]
    head = hf.config.hidden_size // hf.config.num_attention_heads
    if wanted and not vllm_available():
        skipped = {e: "vllm is not importable here (make vllm-venv; run with .venv-vllm/bin/python)" for e in wanted}
    elif wanted and head not in VLLM_HEAD_SIZES:
        skipped = {e: f"head size {head}: vLLM's CPU attention takes {list(VLLM_HEAD_SIZES)}" for e in wanted}
    else:
        from hybridrl.backends.vllm.config import VLLMConfig
        from hybridrl.backends.vllm.engine import VLLMEngine

        for variant in wanted:
            # "vllm": as hybridrl runs it (plain weights the in-place copies reach); "vllm_packed": vLLM's own
            # CPU loading, its GEMM weights packed for its kernels (no in-place publication possible)
            extra = {"load_format": "auto"} if variant == "vllm_packed" else {}
            engines[variant] = VLLMEngine(model_dir, VLLMConfig(
                kv_cache_mb=args.kv_cache_mb, max_num_seqs=max(64, shape["batch"]), threads=args.threads,
                engine_args=extra), seed=args.seed)
    prompts, olens = make_workload(shape["batch"], parse_range(shape["prompt_len"]), parse_range(shape["output_len"]),
                                   min(engines["engine"].vocab_size, 500), args.seed)
    runners = {"hf": lambda r, lens: run_hf(hf, prompts, lens, eos, args.temperature, args.top_p, args.seed + r)}
    for key, engine in engines.items():
        runners[key] = (lambda e, k: lambda r, lens: run_engine(e, prompts, lens, args.temperature, args.top_p,
                                                                 args.seed + 1000 * r, f"{k}{r}"))(engine, key)
    # warm-up every peer on the full batch with short outputs (allocator, kernel selection for these shapes)
    for run in runners.values():
        run(-1, [8] * len(prompts))
    names = list(runners)
    rates = {k: [] for k in names}
    rows = []
    weight_bytes = params * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        row = {}
        for key in order:
            steps = engines["engine"].stats()["steps"] if key == "engine" else 0
            n, seconds = runners[key](r, olens)
            rates[key].append(n / seconds)
            row[f"{key}_tokens"], row[f"{key}_s"] = n, round(seconds, 3)
            if key == "engine":
                row["engine_steps"] = engines["engine"].stats()["steps"] - steps
        row.update(roofline(row["engine_s"], row["engine_steps"], weight_bytes))
        row["ratio"] = round(rates["engine"][-1] / rates["hf"][-1], 3)
        rows.append(row)
        print(f"  [{name} {shape['name']}] repeat {r}: " + " | ".join(f"{k} {rates[k][-1]:.0f} tok/s" for k in names),
              file=sys.stderr)
    ratios = [a / b for a, b in zip(rates["engine"], rates["hf"])]
    stats = engines["engine"].stats()
    out = {
        "size": name, "shape": shape, "params": params, "model_spec": SIZES.get(name, {}),
        "engine_tokens_per_s": round(statistics.median(rates["engine"]), 1),
        "hf_tokens_per_s": round(statistics.median(rates["hf"]), 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
        # best run of each side: the least disturbed by other jobs on a shared machine
        "ratio_of_best": round(max(rates["engine"]) / max(rates["hf"]), 3),
        "runs": rows, "engine_driver": engines["engine"].driver, "engine_kernels": stats["kernels"],
        "engine_steps": stats["steps"], "engine_preemptions": stats["preemptions"], "skipped": skipped,
    }
    out["roofline"] = {"weight_bytes": weight_bytes, **{key: round(statistics.median(r[key] for r in rows), 4)
                                                        for key in ("copy_gb_s", "step_s", "floor_step_s", "x_roofline")}}
    if "engine_torch" in rates:
        paired = [a / b for a, b in zip(rates["engine"], rates["engine_torch"])]
        out["engine_torch_tokens_per_s"] = round(statistics.median(rates["engine_torch"]), 1)
        out["ratio_engine_torch_hf"] = round(statistics.median(
            [a / b for a, b in zip(rates["engine_torch"], rates["hf"])]), 3)
        out["ratio_native_engine_torch"] = round(statistics.median(paired), 3)
        out["ratio_native_engine_torch_range"] = [round(min(paired), 3), round(max(paired), 3)]
    for key in names:
        if key.startswith("vllm"):
            paired = lambda a, b: [x / y for x, y in zip(rates[a], rates[b])]   # noqa: E731
            out[f"{key}_tokens_per_s"] = round(statistics.median(rates[key]), 1)
            out[f"ratio_{key}_hf"] = round(statistics.median(paired(key, "hf")), 3)
            out[f"ratio_native_{key}"] = round(statistics.median(paired("engine", key)), 3)
            out[f"ratio_native_{key}_range"] = [round(min(paired("engine", key)), 3),
                                                round(max(paired("engine", key)), 3)]
    for engine in engines.values():
        engine.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--sizes", default="demo,tiny,small",
                        help=f"comma list of {sorted(SIZES)}; the first is the headline")
    parser.add_argument("--model", default=None, help="benchmark this HF directory instead of built sizes")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", default="16:128")
    parser.add_argument("--output-len", default="16:128")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both")
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and KV of both the native engine and transformers (the same on both sides; "
                             "bfloat16 pays on CPUs with AMX or AVX-512 BF16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kernels", default="auto", choices=["auto", "c", "torch"],
                        help="the native engine's rollout.native.kernels")
    parser.add_argument("--torch-peer", action="store_true",
                        help="add the native engine with kernels=torch as a peer (the C kernels' gain, same run)")
    parser.add_argument("--long-prompt-len", default="512:1024")
    parser.add_argument("--long-output-len", default="16:64")
    parser.add_argument("--long-batch", type=int, default=16)
    parser.add_argument("--no-long", action="store_true", help="skip the long-prompt shape")
    parser.add_argument("--vllm", default="vllm" if vllm_available() else "",
                        help="vLLM peers, comma list of vllm (as hybridrl runs it: plain weights) and vllm_packed "
                             "(vLLM's own CPU weight packing); default vllm where it is importable, '' for none")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = [("model", Path(args.model))] if args.model else [
            (name, build_tiny_model(Path(tmp) / name, TinyModelSpec(arch="qwen2", init_std=0.05, **SIZES[name])))
            for name in args.sizes.split(",")]
        standard = {"name": "standard", "batch": args.batch, "prompt_len": args.prompt_len,
                    "output_len": args.output_len}
        long = {"name": "long_prompt", "batch": args.long_batch, "prompt_len": args.long_prompt_len,
                "output_len": args.long_output_len}
        long_result = None
        for i, (name, model_dir) in enumerate(targets):
            print(f"benchmarking {name} ({model_dir})", file=sys.stderr)
            results.append(bench_size(name, model_dir, args, standard))
            if i == 0 and not args.no_long:
                long_result = bench_size(name, model_dir, args, long)
    head = results[0]
    out = {
        "engine_tokens_per_s": head["engine_tokens_per_s"], "hf_tokens_per_s": head["hf_tokens_per_s"],
        "ratio": head["ratio"], "ratio_definition": "median over repeats of the paired ratio engine/hf tokens per s",
        "headline_size": head["size"], "params": head["params"],
        "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "temperature": args.temperature, "top_p": args.top_p, "repeats": args.repeats,
                     "threads": args.threads, "dtype": args.dtype, "device": "cpu"},
        "peers": ["engine (native)", "hf (transformers generate)", *[v for v in args.vllm.split(",") if v]],
        "sizes": results,
    }
    if long_result is not None:
        out["long_prompt"] = long_result
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
