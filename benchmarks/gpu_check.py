"""The GPU check kit: what a user with one NVIDIA GPU runs, offline, to see the GPU paths work.

    make gpu-check                                   # offline, from a wheelhouse (see below)
    python benchmarks/gpu_check.py --device cpu      # the same script end to end on a tiny model (the CPU suite)

One run of the hybrid worker on the device (`hybridrl bench mode-switch`, one rank, the native
engine, Megatron in bf16 on CUDA, publication verified after the copy) makes everything the
checks look at; transformers then scores, in float32, the weights the run exported. Recorded in
OUT/gpu_check.json with the numbers and pass/fail of each check:
  hybrid_cycle             every TRAIN -> ROLLOUT -> TRAIN cycle published and verified, the parity probe
                           within tolerance; the switch time against the device's own copy floor measured
                           in the same run (the mode-switch benchmark)
  native_vs_transformers   the engine's greedy continuations of fixed prompts (served after the last
                           publication): ids equal transformers' greedy ids, logprobs close
  megatron_vs_transformers the trainer's logprobs of the same sequences against transformers'
On CUDA the model is a random ~0.5B-shaped Qwen2 (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864,
vocabulary 151,936), made locally; nothing is downloaded. Both sides run in bfloat16 there, so the
parity probe's tolerance is bfloat16's (publication.config.default_parity_tolerance), not the
float32 default. On CPU the model is tiny and the run does one cycle.

Bounded: at most MAX_CYCLES cycles, and the whole kit ends within --budget-s (default 480 s): past it,
the hybrid run's processes are stopped and the checks are recorded as failed, with the reason.
What it needs beyond torch comes from a wheelhouse, with no package index: `make gpu-wheels` on a
connected machine, then `make gpu-check` (benchmarks/gpu_env.py, which passes --environment: what
it reused and installed, recorded in the JSON).
"""

from __future__ import annotations

import _thread
import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "cuda": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_multiple=151936),
    "cpu": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, init_std=0.1),
}
DTYPE = {"cuda": "bfloat16", "cpu": "float32"}             # Megatron's and the engine's
TOLERANCE = {"cuda": 0.1, "cpu": 1e-4}                      # logprobs (nats) against transformers in float32
MAX_CYCLES = 10


def parity_tolerance(device: str) -> float:
    """The publication's parity probe between trainer and engine, both in DTYPE[device]."""
    from hybridrl.publication.config import default_parity_tolerance

    return default_parity_tolerance(DTYPE[device], DTYPE[device])


def megatron_version() -> str:
    try:
        from importlib.metadata import version

        import megatron.core  # noqa: F401
        return version("megatron-core")
    except ImportError:
        raise SystemExit("gpu_check: megatron-core is not installed: run `make gpu-check` (it installs it from the "
                         "wheelhouse that `make gpu-wheels` prepares)") from None


class Budget:
    """Past `seconds`: stops the kit's child processes (the hybrid run's torchrun and its ranks), then
    interrupts the main thread (KeyboardInterrupt), whatever it was doing."""

    def __init__(self, seconds: float):
        self.seconds, self.exceeded = seconds, False
        self._timer = threading.Timer(seconds, self._stop)
        self._timer.daemon = True
        self._timer.start()

    def _stop(self) -> None:
        import psutil

        self.exceeded = True
        print(f"gpu_check: past its {self.seconds:g} s budget: stopping the hybrid run", file=sys.stderr, flush=True)
        children = psutil.Process().children(recursive=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for child in children:
                try:
                    child.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, children = psutil.wait_procs(children, timeout=20)
        _thread.interrupt_main()

    def cancel(self) -> None:
        self._timer.cancel()


def make_model(out: Path, device: str) -> Path:
    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    if not (out / "config.json").exists():
        build_tiny_model(out, TinyModelSpec(arch="qwen2", **SHAPES[device]))
    return out


def run_hybrid(model: Path, device: str, cycles: int, out: Path) -> dict:
    """One run of the hybrid worker: the benchmark's cycles, then the served continuations (see module doc)."""
    from hybridrl.bench.cli import add_mode_switch_arguments, mode_switch_main

    parser = argparse.ArgumentParser()
    add_mode_switch_arguments(parser)
    dtype = DTYPE[device]
    args = parser.parse_args([
        "--model", str(model), "--cycles", str(cycles), "--verify", "post_copy",
        "--kv-cache-mb", "256" if device == "cuda" else "4", "--json", str(out / "mode_switch.json"),
        "--run-dir", str(out / "run"), "run.job=hybridrl.bench.mode_switch:SERVE_JOB", f"distributed.device={device}",
        f"train.dtype={dtype}", f"rollout.native.dtype={dtype}", f"publish.parity_tolerance={parity_tolerance(device)}",
        "agent.temperature=1.0"])
    code = mode_switch_main(args)
    if code != 0:
        raise RuntimeError(f"the hybrid run failed (exit code {code}); its output is above")
    return json.loads((out / "mode_switch.json").read_text())


def hybrid_cycle(run: dict, device: str) -> dict:
    parity_tol = parity_tolerance(device)
    return {"ok": run["published_cycles"] == run["cycles"] and run["parity_max_abs"] < parity_tol,
            "parity_tolerance": parity_tol,
            "published_cycles": f"{run['published_cycles']}/{run['cycles']}", "retried_tensors": run["retried_tensors"],
            "switch_s": run["switch_s"], "copy_floor_s": run["copy_floor_s"], "ratio_to_floor": run["ratio_to_floor"],
            "parity_max_abs": run["parity_max_abs"], "model_params": run["model_params"],
            "bench": {k: v for k, v in run.items() if k != "served"}}


def transformers_scores(hf_dir: Path, served: list[dict], device: str) -> list[dict]:
    """Transformers (float32) on the exported weights: greedy ids from each prompt and the logprobs of
    the served tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    scores = []
    for row in served:
        prompt, ids = row["prompt"], row["token_ids"]
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=len(ids), do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            lp = hf(torch.tensor([prompt + ids], device=device)).logits[0].float().log_softmax(-1).cpu()
        scores.append({"greedy": greedy, "logprobs": [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]})
    return scores


def against_transformers(run: dict, scores: list[dict], device: str) -> dict[str, dict]:
    tol, served = TOLERANCE[device], run["served"]
    same = sum(s["greedy"] == row["token_ids"] for row, s in zip(served, scores))
    worst = {key: max(abs(a - b) for row, s in zip(served, scores) for a, b in zip(row[key], s["logprobs"]))
             for key in ("engine_logprobs", "trainer_logprobs")}
    versions = {row["policy_version"] for row in served}
    allowed_misses = 1 if device == "cuda" else 0            # a near-tie may break the other way in bf16
    return {
        "native_vs_transformers": {"greedy_equal": f"{same}/{len(served)}", "logprob_max_abs": worst["engine_logprobs"],
                                   "policy_versions": sorted(versions),
                                   "ok": same >= len(served) - allowed_misses and worst["engine_logprobs"] < tol
                                   and versions == {run["cycles"]}},
        "megatron_vs_transformers": {"dtype": run["trainer_dtype"], "logprob_max_abs": worst["trainer_logprobs"],
                                     "ok": worst["trainer_logprobs"] < tol},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--cycles", type=int, default=None,
                    help=f"mode-switch cycles (default: 5 on CUDA, 1 on CPU; at most {MAX_CYCLES})")
    ap.add_argument("--budget-s", type=float, default=480.0, help="end everything within this many seconds")
    ap.add_argument("--environment", default=None, help="JSON from benchmarks/gpu_env.py: what was reused/installed")
    args = ap.parse_args(argv)
    cycles = args.cycles or (5 if args.device == "cuda" else 1)
    if not 1 <= cycles <= MAX_CYCLES:
        ap.error(f"--cycles must be within 1..{MAX_CYCLES}, got {cycles}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    budget = Budget(args.budget_s)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch (use --device cpu for the CPU run)", file=sys.stderr)
        return 2
    environment = json.loads(Path(args.environment).read_text()) if args.environment else {
        "how": "run directly (not through `make gpu-check`): nothing installed"}
    result: dict = {"device": args.device, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                    "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "megatron": megatron_version(), "environment": environment, "cycles": cycles,
                    "budget_s": args.budget_s}
    checks = ("hybrid_cycle", "native_vs_transformers", "megatron_vs_transformers")
    try:
        model = make_model(out / f"model-{args.device}", args.device)
        run = run_hybrid(model, args.device, cycles, out)
        result["hybrid_cycle"] = hybrid_cycle(run, args.device)
        result.update(against_transformers(run, transformers_scores(out / "run" / "hf", run["served"], args.device),
                                           args.device))
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - recorded in the JSON, then reported
        if isinstance(err, KeyboardInterrupt) and not budget.exceeded:
            raise
        why = f"ran past the {args.budget_s:g} s budget" if budget.exceeded else f"{type(err).__name__}: {err}"
        for name in checks:
            result.setdefault(name, {"ok": False, "error": why})
    finally:
        budget.cancel()
    for name in checks:
        shown = {k: v for k, v in result[name].items() if k != "bench"}
        print(f"gpu_check {name}: {'ok' if result[name]['ok'] else 'FAILED'} {shown}", flush=True)
    result["seconds"] = round(time.time() - started, 1)
    result["ok"] = all(result[name]["ok"] for name in checks)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"gpu_check: {'all checks passed' if result['ok'] else 'FAILED'} in {result['seconds']}s -> "
          f"{out / 'gpu_check.json'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
