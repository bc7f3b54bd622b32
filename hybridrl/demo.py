"""`hybridrl demo`: train a tiny calculator agent end to end on this machine, and show it learned.

    1. base  hybridrl assets tiny-model ...           a random ~1.9M-parameter Qwen2 model
    2. sft   hybridrl train recipes/calc_sft_cpu.yaml  warm start on demonstrations (some use the tool)
    3. grpo  hybridrl train recipes/calc_grpo_cpu.yaml GRPO with the calculator tool; validation on
                                                       held-out questions before the first update and
                                                       every few steps

Each stage is a subprocess writing under `--dir` (default runs/demo), its output in
`<dir>/<stage>.log`. A stage whose command (and recipe file) matches its last completed run is
reused; a stage that runs again makes every later stage run again (`--fresh` redoes all).
An interrupted grpo stage resumes from its newest checkpoint. Overrides: `key=value` goes to both
training stages, `sft:key=value` or `grpo:key=value` to one.

Every number printed is read from the runs' metrics.jsonl: the SFT model's accuracy is the grpo
run's step-0 validation (before any update), the final accuracy its last validation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.shipped import recipe_path

SFT_RECIPE = recipe_path("calc_sft_cpu")      # shipped with the package (a pip install has them too)
GRPO_RECIPE = recipe_path("calc_grpo_cpu")
# The base model: Qwen2 layout, hidden 192, 4 layers, 6 heads / 2 KV heads, tied embeddings (~1.9M
# parameters). Hidden 128 learns the default task but cannot copy 3-4 digit operands into a tool
# call reliably enough for the demo to work across operand ranges.
BASE_MODEL_ARGS = ("--arch", "qwen2", "--hidden", "192", "--layers", "4", "--heads", "6", "--kv-heads", "2",
                   "--intermediate", "512", "--seed", "0")
STAGE_NAMES = ("sft", "grpo")


def build_base_model(out: str | Path) -> str:
    """The demo's base model written to `out` by this checkout's `hybridrl assets tiny-model` (the benchmarks'
    default model); returns the path."""
    subprocess.run([sys.executable, "-m", "hybridrl", "assets", "tiny-model", *BASE_MODEL_ARGS, "--out", str(out)],
                   check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1])
    return str(out)

RESERVED = ("run.dir", "model.path")          # the demo sets these itself
LOG_TAIL = 40


@dataclass
class Stage:
    name: str
    title: str
    cmd: list[str]
    out_dir: Path                  # everything the stage writes (removed before a fresh run)
    recipe: Path | None = None
    cfg: Any = None                # the resolved config (training stages)
    resumable: bool = False        # an interrupted run continues from its checkpoint
    seconds: float = 0.0
    cached: bool = False

    def fingerprint(self) -> dict:
        recipe = hashlib.sha256(self.recipe.read_bytes()).hexdigest() if self.recipe else None
        return {"cmd": self.cmd, "recipe_sha256": recipe}


@dataclass
class Plan:
    root: Path
    stages: list[Stage] = field(default_factory=list)

    @property
    def state_path(self) -> Path:
        return self.root / "stages.json"

    def load_state(self) -> dict:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    def save_state(self, state: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_path.write_text(json.dumps(state, indent=1))


def split_overrides(items: list[str]) -> dict[str, list[str]]:
    """`key=value` -> both training stages; `sft:key=value` / `grpo:key=value` -> one stage."""
    out: dict[str, list[str]] = {name: [] for name in STAGE_NAMES}
    for item in items:
        stage, sep, rest = item.partition(":")
        targets, override = ([stage], rest) if sep and stage in STAGE_NAMES else (list(STAGE_NAMES), item)
        if "=" not in override:
            raise ValueError(f"override {item!r} is not key=value (or sft:key=value / grpo:key=value)")
        key = override.split("=", 1)[0].strip()
        if key in RESERVED:
            raise ValueError(f"override {item!r}: the demo sets {key} itself (use --dir / --base-model)")
        for t in targets:
            out[t].append(override)
    return out


def build_plan(args: argparse.Namespace) -> Plan:
    from hybridrl.config import load_config

    root = Path(args.dir).resolve()
    overrides = split_overrides(args.overrides)
    plan = Plan(root)
    hybridrl = [sys.executable, "-m", "hybridrl"]
    if args.base_model:
        base = Path(args.base_model).resolve()
        if not (base / "config.json").exists():
            raise ValueError(f"--base-model {args.base_model}: no config.json there (an HF model directory)")
    else:
        base = root / "base"
        plan.stages.append(Stage("base", "base model", [*hybridrl, "assets", "tiny-model", *BASE_MODEL_ARGS,
                                                        "--out", str(base)], out_dir=base))
    sft_dir, grpo_dir = root / "sft", root / "grpo"
    for name, recipe, model, run_dir, title in (
            ("sft", Path(args.sft_recipe), base, sft_dir, "SFT warm start"),
            ("grpo", Path(args.grpo_recipe), sft_dir / "hf", grpo_dir, "GRPO with the calculator")):
        if not recipe.is_file():
            raise ValueError(f"recipe {recipe} not found")
        stage_overrides = [*overrides[name], f"model.path={model}", f"run.dir={run_dir}"]
        cfg = load_config(recipe, stage_overrides)     # a bad key stops here, before anything runs
        plan.stages.append(Stage(name, title, [*hybridrl, "train", str(recipe.resolve()), *stage_overrides],
                                 out_dir=run_dir, recipe=recipe.resolve(), cfg=cfg, resumable=name == "grpo"))
    expected = {"sft": "sft", "grpo": "rl"}
    for stage in plan.stages:
        if stage.cfg is not None and stage.cfg.run.job != expected[stage.name]:
            raise ValueError(f"the {stage.name} recipe {stage.recipe} runs run.job={stage.cfg.run.job}, "
                             f"expected {expected[stage.name]}")
    return plan


# ------------------------------------------------------------------ progress


class Progress:
    """Follows a stage's metrics.jsonl: a tqdm bar on a terminal, a line per ~10% (and per
    validation) otherwise."""

    def __init__(self, stage: Stage):
        from tqdm import tqdm

        self.stage, self.offset, self.next_pct = stage, 0, 10
        cfg = stage.cfg
        self.total = (cfg.sft.steps if stage.name == "sft" else cfg.trainer.total_steps) if cfg else 0
        self.path = stage.out_dir / "metrics.jsonl"
        self.bar = tqdm(total=self.total, desc=f"  {stage.name}", unit="step", dynamic_ncols=True,
                        disable=None if self.total else True, leave=False)

    def poll(self) -> None:
        if not self.total or not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            if line.strip():
                self._row(json.loads(line))

    def _row(self, row: dict) -> None:
        step = row["step"]
        if self.stage.name == "sft":
            status = f"loss {row['sft/loss']:.3f}"
        else:
            status = f"reward {row['reward/mean']:.2f}" if "reward/mean" in row else ""
            if row.get("val/accuracy") is not None:
                self._write(f"  grpo step {step:3d}: validation accuracy {100 * row['val/accuracy']:5.1f}%")
        self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(step - self.bar.n)
        if self.bar.disable and 100 * step >= self.next_pct * self.total and self.stage.name == "sft":
            print(f"  sft step {step}/{self.total}: {status}", flush=True)
            self.next_pct = 10 * (100 * step // (10 * self.total) + 1)

    def _write(self, text: str) -> None:
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def close(self) -> None:
        self.poll()
        self.bar.close()


# ------------------------------------------------------------------ running


def run_stage(stage: Stage, log_path: Path, *, verbose: bool) -> int:
    progress = Progress(stage)
    started = time.perf_counter()
    with log_path.open("w") as log:
        log.write("$ " + " ".join(stage.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(stage.cmd, stdout=None if verbose else log, stderr=subprocess.STDOUT if not verbose
                                else None, text=True)
        try:
            while proc.poll() is None:
                progress.poll()
                time.sleep(0.5)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        finally:
            progress.close()
    stage.seconds = time.perf_counter() - started
    return proc.returncode


def _stage_complete(stage: Stage) -> bool:
    from hybridrl.telemetry.metrics import read_metrics

    if stage.name == "base":
        return (stage.out_dir / "config.json").exists()
    if stage.name == "sft":
        return (Path(stage.cfg.sft.output_dir or stage.out_dir / "hf") / "config.json").exists()
    rows = read_metrics(stage.out_dir)
    return bool(rows) and rows[-1]["step"] == stage.cfg.trainer.total_steps and "val/accuracy" in rows[-1]


def execute(plan: Plan, *, fresh: bool, verbose: bool) -> int:
    from hybridrl.store.checkpoints import CheckpointManager

    state = {} if fresh else plan.load_state()
    redo_rest = fresh
    for i, stage in enumerate(plan.stages, 1):
        record = state.get(stage.name, {})
        same = record.get("fingerprint") == stage.fingerprint()
        print(f"[{i}/{len(plan.stages)}] {stage.title}: {' '.join(stage.cmd[2:])}", flush=True)
        if not redo_rest and same and record.get("status") == "done" and _stage_complete(stage):
            stage.cached, stage.seconds = True, record.get("seconds", 0.0)
            print(f"      done before ({_fmt_s(stage.seconds)}): reusing {stage.out_dir}", flush=True)
            continue
        if redo_rest or not (same and stage.resumable and record.get("status") == "running"
                             and CheckpointManager(stage.out_dir).latest() is not None):
            shutil.rmtree(stage.out_dir, ignore_errors=True)      # (an interrupted run without a checkpoint too)
        else:
            print("      an earlier run was interrupted: resuming it from its newest checkpoint", flush=True)
        redo_rest = True
        state[stage.name] = {"fingerprint": stage.fingerprint(), "status": "running"}
        for later in plan.stages[i:]:
            state.pop(later.name, None)
        plan.save_state(state)
        log_path = plan.root / f"{stage.name}.log"
        code = run_stage(stage, log_path, verbose=verbose)
        if code != 0:
            print(f"      FAILED (exit {code}) after {_fmt_s(stage.seconds)}; last lines of {log_path}:", flush=True)
            if not verbose:
                print("".join(log_path.read_text().splitlines(keepends=True)[-LOG_TAIL:]), file=sys.stderr)
            return 1
        state[stage.name].update(status="done", seconds=stage.seconds)
        plan.save_state(state)
        print(f"      done in {_fmt_s(stage.seconds)}", flush=True)
    return 0


# ------------------------------------------------------------------ results


def summarize(plan: Plan, *, target_points: float) -> dict:
    """The demo's result, read from the runs' metrics.jsonl."""
    from hybridrl.telemetry.metrics import read_metrics

    sft, grpo = (next(s for s in plan.stages if s.name == n) for n in ("sft", "grpo"))
    vals = [(r["step"], r["val/accuracy"]) for r in read_metrics(grpo.out_dir) if r.get("val/accuracy") is not None]
    if not vals or vals[0][0] != 0:
        raise RuntimeError(f"{grpo.out_dir / 'metrics.jsonl'} has no step-0 validation: the grpo run did not finish")
    sft_rows = read_metrics(sft.out_dir)
    before, after = vals[0][1], vals[-1][1]
    improvement = 100 * (after - before)
    tc = grpo.cfg.trainer
    return {
        "sft_accuracy": before, "final_accuracy": after, "final_step": vals[-1][0],
        "improvement_points": improvement, "target_points": target_points,
        "target_met": improvement >= target_points, "validation": vals,
        "validation_size": grpo.cfg.task.validation_size, "validation_temperature": tc.validation_temperature,
        "sft_final_loss": sft_rows[-1]["sft/loss"] if sft_rows else None,
        "stages": {s.name: {"seconds": round(s.seconds, 1), "cached": s.cached} for s in plan.stages},
        "seconds_this_run": round(sum(s.seconds for s in plan.stages if not s.cached), 1),
        "run_dir": str(plan.root), "models": {
            "base": str(plan.stages[0].out_dir) if plan.stages[0].name == "base" else sft.cfg.model.path,
            "sft": str(Path(sft.cfg.sft.output_dir or sft.out_dir / "hf")),
            "grpo": str(grpo.out_dir / "hf") if tc.export_hf else None},
    }


def print_summary(s: dict) -> None:
    how = "greedy" if s["validation_temperature"] == 0 else f"T={s['validation_temperature']:g}"
    curve = "  ".join(f"{step}: {100 * acc:.1f}%" for step, acc in s["validation"])
    verdict = "met" if s["target_met"] else "NOT met"
    lines = [
        "",
        f"validation accuracy ({how}, {s['validation_size']} held-out questions), by GRPO step: {curve}",
        "",
        f"  {'SFT model (step 0)':28s} {100 * s['sft_accuracy']:6.1f}%",
        f"  {'after GRPO (step %d)' % s['final_step']:28s} {100 * s['final_accuracy']:6.1f}%",
        f"  {'improvement':28s} {s['improvement_points']:+6.1f} points   (target +{s['target_points']:g}: {verdict})",
        "",
    ]
    for name, st in s["stages"].items():
        lines.append(f"  {'stage ' + name:28s} {_fmt_s(st['seconds']):>7s}" + ("   (reused)" if st["cached"] else ""))
    lines.append(f"  {'wall time of this run':28s} {_fmt_s(s['seconds_this_run']):>7s}")
    lines += ["", f"run directory: {s['run_dir']}  (stage logs: <stage>.log; metrics: sft/, grpo/metrics.jsonl; "
                  "TensorBoard: grpo/tensorboard)"]
    lines += [f"  {name} model: {path}" for name, path in s["models"].items() if path]
    print("\n".join(lines), flush=True)


def _fmt_s(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


# ------------------------------------------------------------------ command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="key=value (both training stages), sft:key=value, "
                                                     "grpo:key=value")
    parser.add_argument("--dir", default="runs/demo", help="where every stage writes (default: runs/demo)")
    parser.add_argument("--base-model", default=None, help="start from this HF model directory instead of "
                                                           "building the tiny base model")
    parser.add_argument("--sft-recipe", default=str(SFT_RECIPE))
    parser.add_argument("--grpo-recipe", default=str(GRPO_RECIPE))
    parser.add_argument("--fresh", action="store_true", help="run every stage again, reusing nothing")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (and validate the configs), run nothing")
    parser.add_argument("--verbose", action="store_true", help="show the stages' own output instead of logging it")
    parser.add_argument("--target", type=float, default=25.0, help="improvement to report against, in points")
    parser.add_argument("--check", action="store_true", help="exit 3 when the improvement is below --target")
    parser.add_argument("--json", default=None, help="also write the summary here (it always goes to <dir>/summary.json)")


def main(args: argparse.Namespace) -> int:
    from hybridrl.config import ConfigError

    try:
        plan = build_plan(args)
    except (ConfigError, ValueError) as err:
        print(f"hybridrl demo: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        state = plan.load_state()
        for i, stage in enumerate(plan.stages, 1):
            record = state.get(stage.name, {})
            reuse = (not args.fresh and record.get("status") == "done"
                     and record.get("fingerprint") == stage.fingerprint() and _stage_complete(stage))
            print(f"[{i}/{len(plan.stages)}] {stage.title} ({'reuse' if reuse else 'run'}): {' '.join(stage.cmd)}")
        return 0
    print(f"hybridrl demo: {len(plan.stages)} stages under {plan.root}", flush=True)
    try:
        code = execute(plan, fresh=args.fresh, verbose=args.verbose)
    except KeyboardInterrupt:
        print("\nhybridrl demo: interrupted (run it again to continue)", file=sys.stderr)
        return 130
    if code:
        return code
    summary = summarize(plan, target_points=args.target)
    print_summary(summary)
    text = json.dumps(summary, indent=1)
    (plan.root / "summary.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    return 3 if args.check and not summary["target_met"] else 0
