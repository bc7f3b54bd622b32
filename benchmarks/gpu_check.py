"""The GPU check kit: what a user with one NVIDIA GPU runs, offline, to see the GPU paths work.

    make gpu-check                                   # or: python benchmarks/gpu_check.py --out runs/gpu_check
    python benchmarks/gpu_check.py --device cpu      # the same script end to end on a tiny model (the CPU suite)

Checks, each recorded in OUT/gpu_check.json with its numbers and pass/fail:
  native_vs_transformers   the native engine on the device: greedy ids equal transformers', logprobs close
  megatron_vs_transformers Megatron logprobs (`hybridrl score`, the device's dtype) against transformers
  hybrid_cycle             TRAIN -> ROLLOUT -> TRAIN cycles of the hybrid worker with the native engine on the
                           device, publication verified after the copy (`hybridrl bench mode-switch`), and the
                           switch time against the device's own copy floor measured in the same run
On CUDA the model is a random ~0.5B-shaped Qwen2 (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864),
made locally; nothing is downloaded. Without a package index, megatron-core is installed from a wheel
in the ignored folder .whl/ when it is missing (`pip download megatron-core==0.16.1 -d .whl` beforehand).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "cuda": ["--hidden", "896", "--layers", "24", "--heads", "14", "--kv-heads", "2", "--intermediate", "4864",
             "--init-std", "0.02"],
    "cpu": ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
            "--init-std", "0.1"],
}
TOLERANCE = {"cuda": 2e-2, "cpu": 1e-4}          # logprobs (nats): bf16 kernels on CUDA, float32 on CPU


def hybridrl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def ensure_megatron() -> str:
    try:
        import megatron.core  # noqa: F401
        return "present"
    except ImportError:
        wheels = ROOT / ".whl"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                        "megatron-core"], check=True)
        return f"installed from {wheels}"


def prompts(vocab: int, n: int = 4) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (6 + 3 * i,), generator=g).tolist() for i in range(n)]


def native_vs_transformers(model: Path, device: str, tol: float) -> dict:
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    from hybridrl.rollout.protocol import SamplingParams

    engine = NativeEngine.from_pretrained(model, NativeEngineConfig(kv_cache_mb=64), device=device)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    ps = prompts(engine.vocab_size)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    async def go():
        return await asyncio.gather(*[engine.generate(p, greedy, f"g{i}") for i, p in enumerate(ps)])

    outs = asyncio.run(go())
    engine.close()
    same, worst = 0, 0.0
    for p, o in zip(ps, outs):
        with torch.no_grad():
            ids = torch.tensor([p + o.token_ids], device=device)
            ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            lp = hf(ids).logits[0].float().log_softmax(-1)
        same += ref == o.token_ids
        mine = torch.tensor(o.logprobs)
        theirs = torch.stack([lp[len(p) - 1 + i, t] for i, t in enumerate(o.token_ids)]).cpu()
        worst = max(worst, float((mine - theirs).abs().max()))
    return {"greedy_equal": f"{same}/{len(ps)}", "logprob_max_abs": worst,
            "ok": worst < tol and same >= len(ps) - (1 if device == "cuda" else 0)}


def megatron_vs_transformers(model: Path, device: str, tol: float, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "bfloat16" if device == "cuda" else "float32"
    seqs = prompts(AutoModelForCausalLM.from_pretrained(model).config.vocab_size)
    src, dst = out / "score_in.jsonl", out / "score_out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "token_ids": s}) + "\n" for i, s in enumerate(seqs)))
    proc = hybridrl("score", "--model", str(model), "--input", str(src), "--output", str(dst), "--dtype", dtype)
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-2000:]}
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    worst = 0.0
    for line in dst.read_text().splitlines():
        row = json.loads(line)
        ids = seqs[row["id"]]
        with torch.no_grad():
            lp = hf(torch.tensor([ids], device=device)).logits[0].float().log_softmax(-1).cpu()
        ref = [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]
        mine = [x for x in row["logprobs"] if x is not None][-len(ref):]
        worst = max(worst, max(abs(a - b) for a, b in zip(mine, ref)))
    return {"dtype": dtype, "logprob_max_abs": worst, "ok": worst < (tol if dtype == "float32" else 0.1)}


def hybrid_cycle(model: Path, device: str, cycles: int, out: Path) -> dict:
    path = out / "mode_switch.json"
    proc = hybridrl("bench", "mode-switch", "--model", str(model), "--cycles", str(cycles), "--verify", "post_copy",
                    "--kv-cache-mb", "64" if device == "cuda" else "4", "--json", str(path),
                    f"distributed.device={device}")
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-3000:]}
    r = json.loads(path.read_text())
    return {"ok": r["parity_max_abs"] < (0.1 if device == "cuda" else 1e-4) and r["ratio_to_floor"] is not None,
            "switch_s": r["switch_s"], "copy_floor_s": r["copy_floor_s"], "ratio_to_floor": r["ratio_to_floor"],
            "parity_max_abs": r["parity_max_abs"], "model_params": r["model_params"], "bench": r}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--cycles", type=int, default=None, help="mode-switch cycles (default: 5 on CUDA, 1 on CPU)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch (use --device cpu for the CPU run)", file=sys.stderr)
        return 2
    result: dict = {"device": args.device, "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "megatron": ensure_megatron()}
    model = out / f"model-{args.device}"
    if not (model / "config.json").exists():
        proc = hybridrl("assets", "tiny-model", "--arch", "qwen2", "--out", str(model), *SHAPES[args.device])
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
    tol = TOLERANCE[args.device]
    checks = {"native_vs_transformers": lambda: native_vs_transformers(model, args.device, tol),
              "megatron_vs_transformers": lambda: megatron_vs_transformers(model, args.device, tol, out),
              "hybrid_cycle": lambda: hybrid_cycle(model, args.device, args.cycles or (5 if args.device == "cuda"
                                                                                       else 1), out)}
    for name, check in checks.items():
        t = time.time()
        try:
            result[name] = check()
        except Exception as err:  # noqa: BLE001 - recorded, the other checks still run
            result[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        result[name]["seconds"] = round(time.time() - t, 1)
        print(f"gpu_check {name}: {'ok' if result[name]['ok'] else 'FAILED'} "
              f"({ {k: v for k, v in result[name].items() if k not in ('bench', 'error')} })", flush=True)
    result["seconds"] = round(time.time() - started, 1)
    result["ok"] = all(result[name]["ok"] for name in checks)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"gpu_check: {'all checks passed' if result['ok'] else 'FAILED'} in {result['seconds']}s -> "
          f"{out / 'gpu_check.json'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
