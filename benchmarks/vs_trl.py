"""hybridrl beside TRL's GRPOTrainer on one workload, interleaved in one run.

    python benchmarks/vs_trl.py --model runs/demo/sft/hf --json runs/bench/vs_trl.json \\
        [--install-trl] [--trl-venv runs/bench/trl-venv] [--pairs 3] [--steps 6] [--base OTHER_CHECKOUT]
    python benchmarks/vs_trl.py --model-size 100m,500m --json runs/bench/vs_trl_sizes.json --pairs 2 --steps 5

The workload (both sides): the calculator task's training questions, 16 prompts x 8 samples per
step, one turn of at most 32 new tokens at temperature 1, lr 5e-5 constant, no KL term, group-mean
advantages without the standard deviation, every sample trained in one optimizer step, gradient
clipping at 1.0, float32 on CPU (`--dtype bfloat16`: both in mixed precision). hybridrl runs its CPU demo recipe with those settings
(`hybridrl train`, 2 ranks, as `benchmarks/e2e.py` does); TRL runs `GRPOTrainer` in one process
(`benchmarks/trl_side.py`) with the same micro-batch of rows. Both use every core of the machine:
hybridrl as two ranks of one thread each, TRL as one process of as many threads as torch gives it.

`--dtype bfloat16` runs both sides in mixed precision instead (TRL's own default, `GRPOConfig(bf16=True)`):
TRL autocasts its float32 model's products to bfloat16; hybridrl trains bfloat16 parameters with float32
master weights and gradients in Megatron's optimizer (`train.dtype=bfloat16`) and generates in bfloat16
(`rollout.native.dtype=bfloat16`, serving the trainer's parameters in place). It needs a CPU with bfloat16
matrix instructions (AVX512-BF16 or AMX); elsewhere hybridrl refuses the dtype, naming why.

`--model-size 100m,500m` runs the comparison at size instead, on randomly initialised Qwen2 models
that `hybridrl assets tiny-model` writes (kept under --models-dir; random weights time like trained
ones): 100m is hidden 768, 12 layers, 12 heads / 2 KV heads, FFN 3072 (~101M parameters); 500m is
Qwen2.5-0.5B's transformer (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864: its 0.36B
non-embedding parameters) over the tokenizer's 576-token vocabulary. The workload shrinks to 4
prompts x 4 samples so that a step fits two cores, and the engine frees its KV cache for training as
the rollout defaults do (the demo's recipe keeps it: cheap beside its tiny model); one record per size.

TRL lives in a virtual environment of its own (its pins are not ours): `--install-trl` creates it
(the same torch as this one, then `trl` and this environment's transformers). Pairs alternate the
order (hybridrl first, then TRL first...), so that the machine's load falls on both alike. Reports
each run's median step time over the steps after the first two (warm-up) and its completions' mean
length (the sides stop a completion alike: at the end of the assistant's turn or 32 tokens; a
model that answers longer on one side costs that side more), the medians over pairs,
the speed-up (TRL's step time / hybridrl's) per pair and its median, and the load average around
every run; per run also the rollout's tokens/s (completion tokens / generation seconds), the
training's tokens/s (the step's prompt + completion tokens, counted as TRL's padded-free rows have
them, / training seconds) and every process's peak resident memory (VmHWM, polled). With `--base
CHECKOUT` (another checkout of hybridrl, run with this interpreter, its own package first on the path
and this checkout's recipe) each round runs three sides, the order rotating, and reports that
checkout's speed-up over TRL and this one's over it (`head_vs_base`), all from the same run; `--no-trl`
leaves TRL out (with `--base`: the two checkouts alone, alternating). Trailing KEY=VALUE arguments
are recipe overrides for hybridrl's sides (e.g. `distributed.nproc_per_node=1`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.host_memory import choose_blas_path  # noqa: E402

# MKL's path as the hybridrl CLI sets it, for TRL's side too (it inherits this environment); MKL_CBWR= keeps
# MKL's own path on both
choose_blas_path()

RECIPE = ROOT / "recipes" / "calc_grpo_cpu.yaml"
WORKLOAD = {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 32, "temperature": 1.0, "lr": 5e-5,
            "clip_grad": 1.0, "seed": 0}
OVERRIDES = ["agent.max_turns=1", f"agent.max_new_tokens_per_turn={WORKLOAD['max_new_tokens']}",
             f"agent.max_response_tokens={WORKLOAD['max_new_tokens']}", "algo.kl_coef=0.0",
             "algo.norm_adv_by_std=false", "algo.drop_truncated=false",
             f"train.lr={WORKLOAD['lr']}", "train.lr_schedule=constant"]     # TRL's side: the same, constant
# what `benchmarks/e2e.py` sets for a timing run: no validation, checkpoints or export between the steps
TIMING_RUN = ["trainer.validate_every=0", "trainer.checkpoint_every=0", "trainer.export_hf=false",
              "algo.drop_all_equal_groups=false"]
WARMUP = 2
# `hybridrl assets tiny-model` arguments of the sizes, and the smaller workload a step of them fits on two cores
SIZES = {"100m": ("--hidden", "768", "--layers", "12", "--heads", "12", "--kv-heads", "2", "--intermediate", "3072"),
         "500m": ("--hidden", "896", "--layers", "24", "--heads", "14", "--kv-heads", "2", "--intermediate", "4864")}
SIZE_WORKLOAD = {"prompts_per_step": 4, "group_size": 4}
# the engine's KV cache freed while the trainer trains, as the rollout defaults have it: the demo's recipe keeps
# it (rollout.native.keep_kv_cache: its 64 MiB cost nothing beside a 1.9M-parameter model's step and spare the
# switch re-creating it), which at size would put those 64 MiB on top of the training peak (measured at ~500M:
# peak 6694 -> 6641 MiB, T_sync 0.08 -> 0.20 s of a ~17 s step, medians of 2 alternating runs)
SIZE_OVERRIDES = ["rollout.native.keep_kv_cache=false"]
PHASES = ("time/T_rollout", "time/T_reward", "time/T_prep", "time/T_train", "time/T_sync", "time/T_update",
          "time/T_old", "time/T_ref", "time/grad_reduce_s")


def install_trl(venv: Path) -> None:
    import torch
    import transformers

    print(f"creating {venv} (torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, trl)",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, "trl", f"transformers=={transformers.__version__}", "datasets"], check=True)


def sized_model(size: str, models_dir: Path) -> str:
    """The randomly initialised model of `size` (SIZES), written by `hybridrl assets tiny-model` unless there."""
    out = models_dir / f"qwen2-{size}"
    if not (out / "config.json").exists():
        print(f"writing the {size} model to {out}", flush=True)
        subprocess.run([sys.executable, "-m", "hybridrl", "assets", "tiny-model", "--arch", "qwen2", *SIZES[size],
                        "--seed", "0", "--out", str(out)], check=True, cwd=ROOT)
    return str(out.resolve())


def workload(model: str, steps: int, settings: dict, overrides: list[str]) -> dict:
    """The prompts both sides train on, rendered with the model's chat template, and the shared settings."""
    from transformers import AutoTokenizer

    from hybridrl.config import load_config
    from hybridrl.envs.tasks import get_task

    cfg = load_config(RECIPE, [f"model.path={model}", *overrides])
    task = get_task(cfg.task.name, cfg.task)
    instances = task.train_split(settings["prompts_per_step"] * (steps + 1))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template(list(i.messages), add_generation_prompt=True, tokenize=False)
               for i in instances]
    prompt_tokens = statistics.fmean(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    rows = settings["prompts_per_step"] * settings["group_size"]
    return {**settings, "model": model, "steps": steps, "prompts": prompts, "prompt_tokens_mean": prompt_tokens,
            "references": [i.reference for i in instances], "format_weight": cfg.task.format_weight,
            "micro_batch_size": min(cfg.train.micro_batch_size, rows), "trl_loss_type": "dapo"}


def _hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_watched(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    """Run `cmd`; with it, every process of its tree's peak resident memory (MiB, VmHWM read every 0.2 s),
    keyed `name[pid]`. A process seen under another name (a fork that then exec'd: before the exec its
    high-water mark is its parent's) counts from its last name on."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    seen: dict[int, tuple[str, float]] = {}
    done = threading.Event()

    def poll() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in tree:
                hwm, name = _hwm_mb(p.pid), _process_name(p)
                if hwm is not None and name != "gone":
                    before = seen.get(p.pid)
                    seen[p.pid] = (name, max(hwm, before[1]) if before and before[0] == name else hwm)
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    done.set()
    watcher.join()
    peaks = {f"{name}[{pid}]": mb for pid, (name, mb) in seen.items()}
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peaks


def _process_name(p) -> str:
    try:
        cmd = p.cmdline()
    except Exception:                      # it ended between the listing and the read
        return "gone"
    for i, part in enumerate(cmd):
        if part == "-m" and i + 1 < len(cmd):
            return " ".join(cmd[i + 1:i + 3])
        if part.endswith(".py"):
            return Path(part).name
    return Path(cmd[0]).name if cmd else "?"


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(float(r.get(key) or 0.0) for r in rows)


def hybridrl_summary(rows: list[dict], prompt_tokens: float, settings: dict) -> dict:
    """Medians over the measured steps of a hybridrl run's metrics.jsonl rows."""
    steps = [r for r in rows if "time/step_s" in r]
    measured = steps[WARMUP:] or steps
    step_s = _median(measured, "time/step_s")
    completion = _median(measured, "episode/response_tokens")
    rows_per_step = settings["prompts_per_step"] * settings["group_size"]
    train_tokens = rows_per_step * (prompt_tokens + completion)
    return {"step_s": step_s, "steps_s": [r["time/step_s"] for r in steps],
            "stage_times": {k.split("/", 1)[1]: _median(measured, k) for k in PHASES},
            "switch_s": {k.split("/", 1)[1]: _median(measured, k) for k in measured[-1] if k.startswith("switch/")},
            "completion_tokens": completion,
            "rollout_tokens_per_s": _median(measured, "gen/tokens_per_s"),
            "train_tokens_per_s": train_tokens / _median(measured, "time/T_train"),
            "T_sync_share": statistics.median(r["time/T_sync"] / r["time/step_s"] for r in measured)}


def run_hybridrl(model: str, steps: int, tmp: Path, i: int, extra: list[str], work: dict, checkout: Path = ROOT,
                 tag: str = "hybridrl") -> dict:
    run_dir = tmp / f"{tag}{i}"
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={steps}", *TIMING_RUN, *OVERRIDES, *extra]
    proc, peaks = run_watched(cmd, cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"{tag}'s run ({checkout}) failed\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**hybridrl_summary(rows, work["prompt_tokens_mean"], work), "peak_rss_mb": peaks,
            "load_avg_1m": [load, os.getloadavg()[0]]}


def run_trl(venv: Path, work: Path, steps: int, tmp: Path, i: int) -> dict:
    out = tmp / f"trl{i}.json"
    load = os.getloadavg()[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc, peaks = run_watched([str(venv / "bin" / "python"), str(ROOT / "benchmarks" / "trl_side.py"), "--workload",
                               str(work), "--json", str(out), "--out-dir", str(tmp / f"trl{i}")], cwd=tmp, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"TRL's run failed\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    w = json.loads(work.read_text())
    cut = lambda xs: xs[WARMUP:] or xs  # noqa: E731
    step_s = statistics.median(cut(r["step_s"]))
    completion = statistics.median(cut(r["completion_tokens"]))
    gen_s = statistics.median(cut(r["generate_s"]))
    rows = w["prompts_per_step"] * w["group_size"]
    return {"step_s": step_s, "steps_s": r["step_s"], "reward": r["reward"], "completion_tokens": completion,
            "generate_s": gen_s, "rollout_tokens_per_s": rows * completion / gen_s,
            "train_tokens_per_s": rows * (w["prompt_tokens_mean"] + completion) / (step_s - gen_s),
            "torch_threads": r["torch_threads"], "maxrss_mb": r["maxrss_mb"], "peak_rss_mb": peaks,
            "load_avg_1m": [load, os.getloadavg()[0]]}


def _order(i: int, sides: list[str]) -> list[str]:
    if len(sides) > 2:
        return sides[i % len(sides):] + sides[: i % len(sides)]
    return sides if i % 2 == 0 else sides[::-1]


# hybridrl's side in mixed precision (--dtype bfloat16); its parity probe's tolerance is bfloat16's
BF16 = ["train.dtype=bfloat16", "rollout.native.dtype=bfloat16", "publish.parity_tolerance=0.1"]


def compare(model: str, args: argparse.Namespace, settings: dict, extra: list[str]) -> dict:
    """The interleaved pairs (or rounds of three with --base) on one model; the summary over them."""
    settings = {**settings, "dtype": args.dtype}
    extra = [*(BF16 if args.dtype == "bfloat16" else []), *extra]
    venv, base = Path(args.trl_venv).resolve(), Path(args.base).resolve() if args.base else None
    sides = ["hybridrl"] + ([] if args.no_trl else ["trl"]) + (["base"] if base else [])
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="hybridrl-vs-trl-") as tmp:
        tmp = Path(tmp)
        work = workload(model, args.steps, settings, [*OVERRIDES, *extra])
        (tmp / "workload.json").write_text(json.dumps(work))
        for i in range(args.pairs):
            for side in _order(i, sides):
                if side == "trl":
                    r = run_trl(venv, tmp / "workload.json", args.steps, tmp, i)
                else:
                    r = run_hybridrl(model, args.steps, tmp, i, extra, work,
                                     *((base, "base") if side == "base" else ()))
                runs[side].append(r)
                print(f"{Path(model).name} pair {i} {side}: {r['step_s']:.3f} s/step  "
                      f"{r['completion_tokens']:.1f} tokens/completion  load {r['load_avg_1m'][0]:.1f}", flush=True)
    return summarize(runs, work, args, extra, base)


def _peak_per_process(r: dict) -> float:
    return max(r["peak_rss_mb"].values())


def summarize(runs: dict[str, list[dict]], work: dict, args: argparse.Namespace, extra: list[str],
              base: Path | None) -> dict:
    med = lambda side, key: statistics.median(r[key] for r in runs[side])  # noqa: E731
    t_sync = lambda side: statistics.median(r["stage_times"]["T_sync"] / r["step_s"] for r in runs[side])  # noqa: E731
    result = {"model": work["model"], "workload": {k: work[k] for k in (*WORKLOAD, "micro_batch_size", "dtype")},
              "prompt_tokens_mean": work["prompt_tokens_mean"], "hybridrl_overrides": [*OVERRIDES, *extra],
              "steps": args.steps, "warmup_steps": WARMUP, "pairs": args.pairs,
              "median_step_s": {side: med(side, "step_s") for side in runs}, "hybridrl_T_sync_share": t_sync("hybridrl"),
              "rollout_tokens_per_s": {side: med(side, "rollout_tokens_per_s") for side in runs},
              "train_tokens_per_s": {side: med(side, "train_tokens_per_s") for side in runs},
              "peak_rss_mb_per_process": {side: statistics.median(_peak_per_process(r) for r in runs[side])
                                          for side in runs},
              "runs": runs}
    if "trl" in runs:
        speedups = [t["step_s"] / h["step_s"] for h, t in zip(runs["hybridrl"], runs["trl"])]
        result.update({"speedup_per_pair": speedups, "speedup_median": statistics.median(speedups)})
    if base is not None:
        head_vs_base = [b["step_s"] / h["step_s"] for h, b in zip(runs["hybridrl"], runs["base"])]
        result.update({"base": str(base), "head_vs_base_per_pair": head_vs_base,
                       "head_vs_base_median": statistics.median(head_vs_base), "base_T_sync_share": t_sync("base")})
    if base is not None and "trl" in runs:
        base_speedups = [t["step_s"] / b["step_s"] for b, t in zip(runs["base"], runs["trl"])]
        result.update({"base_speedup_per_pair": base_speedups, "base_speedup_median": statistics.median(base_speedups)})
    return result


HEADLINE = ("median_step_s", "speedup_per_pair", "speedup_median", "hybridrl_T_sync_share", "rollout_tokens_per_s",
            "train_tokens_per_s", "peak_rss_mb_per_process", "base_speedup_median", "head_vs_base_median",
            "base_T_sync_share")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory both sides start from (the demo's SFT model)")
    ap.add_argument("--model-size", default=None, help=f"comma-separated sizes of {sorted(SIZES)}, instead of --model")
    ap.add_argument("--models-dir", default=str(ROOT / "runs" / "bench" / "models"), help="where --model-size's go")
    ap.add_argument("--json", required=True)
    ap.add_argument("--trl-venv", default=str(ROOT / "runs" / "bench" / "trl-venv"))
    ap.add_argument("--install-trl", action="store_true", help="create --trl-venv with TRL if it is missing")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--base", default=None, help="another hybridrl checkout to run beside this one (same interpreter)")
    ap.add_argument("--no-trl", action="store_true", help="hybridrl alone (with --base: this checkout against that one)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both sides' precision: float32, or bfloat16 mixed precision (TRL's default)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for hybridrl's sides (KEY=VALUE)")
    args = ap.parse_args()
    sizes = [s for s in (args.model_size or "").split(",") if s]
    if bool(sizes) == bool(args.model):
        raise SystemExit("give one of --model DIR or --model-size " + ",".join(SIZES))
    if unknown := [s for s in sizes if s not in SIZES]:
        raise SystemExit(f"--model-size: unknown {unknown}; the sizes are {sorted(SIZES)}")
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP} warm-up steps")
    venv = Path(args.trl_venv).resolve()
    if not args.no_trl and not (venv / "bin" / "python").exists():
        if not args.install_trl:
            raise SystemExit(f"no TRL environment at {venv}: pass --install-trl to create it (pip, a few minutes), "
                             "or --trl-venv DIR for one you have")
        install_trl(venv)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not sizes:
        result = compare(str(Path(args.model).resolve()), args, WORKLOAD, args.overrides)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: result[k] for k in HEADLINE if k in result}, indent=1))
        return 0
    results: dict[str, dict] = {}
    extra = [f"trainer.{k}={v}" for k, v in SIZE_WORKLOAD.items()] + SIZE_OVERRIDES + args.overrides
    for size in sizes:
        results[size] = compare(sized_model(size, Path(args.models_dir)), args, {**WORKLOAD, **SIZE_WORKLOAD}, extra)
        out.write_text(json.dumps({"sizes": results}, indent=1))      # each size's record as soon as it is measured
        print(size, json.dumps({k: results[size][k] for k in HEADLINE if k in results[size]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
