"""`hybridrl agent ...`: check the tool sandbox, stop a run's tools, read its audit log, dump task
data, run episodes.

    hybridrl agent sandbox-check [RECIPE | --config RECIPE] [k=v ...] [--json] [--attack NAME ...]
    hybridrl agent kill-switch RUN_DIR [--reason TEXT | --clear | --status]
    hybridrl agent audit RUN_DIR [--json]
    hybridrl agent tasks [RECIPE | --config RECIPE] [k=v ...] [--split train|validation|sft] [-n N] [--out FILE]
    hybridrl agent rollout [RECIPE | --config RECIPE] [k=v ...] [--engine scripted|native] [-n N]
                           [--group-size G] [--split train|validation] [--temperature T] [--json OUT]

`rollout` samples the validation split at trainer.validation_temperature (greedy by default: the
accuracy training's validation reports) unless --temperature says otherwise, and prints which.
Only argparse and the recipe arguments are imported here; each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridrl.config.cli import add_recipe_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="agent_command", required=True)

    def common(p):
        add_recipe_arguments(p)        # RECIPE or --config RECIPE, then section.key=value

    p = sub.add_parser("sandbox-check", help="run the attack set against the tool sandbox on this machine: "
                                             "PASS/FAIL per attack, exit 1 on any FAIL")
    common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--attack", action="append", default=[], metavar="NAME",
                   help="run only this attack (repeatable); default: all")
    p = sub.add_parser("kill-switch", help="stop every tool call and new episode of a running job within a second "
                                           "(and the run at the end of its step, resumable); --clear before resuming")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--reason", default="stopped by an operator", help="recorded with the switch and in the audit log")
    p.add_argument("--clear", action="store_true", help="clear the switch (the run can be resumed)")
    p.add_argument("--status", action="store_true", help="only say whether the switch is set")
    p = sub.add_parser("audit", help="verify a run's hash-chained audit log and summarise it (exit 1 if tampered)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or the audit log itself")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("tasks", help="print task instances or SFT demonstrations as JSON lines")
    common(p)
    p.add_argument("--split", choices=["train", "validation", "sft"], default="train")
    p.add_argument("-n", type=int, default=5)
    p.add_argument("--out", default=None, help="write JSON lines here instead of stdout")
    p = sub.add_parser("rollout", help="run episodes of the configured task and report statuses and rewards")
    common(p)
    p.add_argument("--engine", choices=["scripted", "native"], default="native",
                   help="native: model.path (or a tiny random model); scripted: a perfect calculator agent")
    p.add_argument("--split", choices=["train", "validation"], default="validation")
    p.add_argument("-n", type=int, default=16, help="instances")
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; default: trainer.validation_temperature on the validation split "
                        "(what training's validation reports), agent.temperature on the train split")
    p.add_argument("--show", type=int, default=2, help="print this many trajectories as text")
    p.add_argument("--json", default=None, help="write a summary here")


def main(args: argparse.Namespace) -> int:
    from hybridrl.config import ConfigError, load_config
    from hybridrl.config.cli import recipe_and_overrides

    if args.agent_command in ("kill-switch", "audit"):          # about a run directory: no recipe
        return {"kill-switch": _kill_switch, "audit": _audit}[args.agent_command](args)
    try:
        cfg = load_config(*recipe_and_overrides(args.recipe_args, args.config))
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return 2
    handler = {"sandbox-check": _sandbox_check, "tasks": _tasks, "rollout": _rollout}[args.agent_command]
    return handler(cfg, args)


# ---------------------------------------------------------------------------------------------


def _sandbox_check(cfg, args) -> int:
    """Run the attack set (`hybridrl/agent/sandbox/attacks.py`) against this machine's configuration:
    PASS / FAIL per attack; exit 1 when an attack the chosen isolation promises to contain was not."""
    import dataclasses
    import socket

    from hybridrl.agent.sandbox.attacks import ATTACKS, attack_context, run_attack_set
    from hybridrl.agent.sandbox.pool import SandboxUnavailable

    names = args.attack or None
    unknown = sorted(set(names or ()) - {a.name for a in ATTACKS})
    if unknown:
        print(f"hybridrl: unknown attack(s) {unknown}; known: {[a.name for a in ATTACKS]}", file=sys.stderr)
        return 2
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    # the check is no part of a run: nothing goes to the configured run's audit log
    tools = dataclasses.replace(cfg.tools, cpu_s=min(cfg.tools.cpu_s, 2), audit_log="")
    try:
        mode, verdicts, limits = run_attack_set(tools, attack_context(tools, port=listener.getsockname()[1]), names,
                                                with_limits=True)
    except SandboxUnavailable as err:
        print(f"FAIL sandbox: {err}")
        return 1
    finally:
        listener.close()
    failed = [v.name for v in verdicts if v.status == "FAIL"]
    if args.json:
        print(json.dumps({"isolation": mode, **limits, "failed": failed,
                          "attacks": {v.name: {"status": v.status, "what": v.what, "detail": v.detail, **v.result}
                                      for v in verdicts}}, indent=2))
    else:
        print(f"tool sandbox isolation: {mode}, memory limit: {limits['memory_limit']}, "
              f"cpu limit: {limits['cpu_limit']}"
              + (f" ({limits['cgroup_problem']})" if limits["cgroup_problem"] else ""))
        for v in verdicts:
            print(f"{'SKIP' if v.skipped else v.status:4s} {v.name:14s} {v.what}")
            if v.status != "PASS":
                print(f"     {v.skipped or v.detail}")
        print(f"{len(verdicts) - len(failed)}/{len(verdicts)} attacks contained, not promised or skipped"
              if not failed else f"{len(failed)} attack(s) NOT contained: {', '.join(failed)}")
    return 1 if failed else 0


def _kill_switch(args) -> int:
    from pathlib import Path

    from hybridrl.agent import killswitch

    if not Path(args.run_dir).is_dir():
        print(f"hybridrl: {args.run_dir} is not a directory: pass the run directory (run.dir) of the job",
              file=sys.stderr)
        return 2
    path, audit_log = killswitch.switch_path(args.run_dir)
    if args.status:
        record = killswitch.read(path)
        print(f"kill switch {path}: " + (f"SET ({record.get('reason')}, by {record.get('by')})" if record else "clear"))
        return 0
    if args.clear:
        cleared = killswitch.clear(path, audit_log=audit_log)
        print(f"kill switch {path}: " + ("cleared; resume the run with trainer.resume=auto" if cleared
                                         else "was not set"))
        return 0
    killswitch.trip(path, args.reason, audit_log=audit_log)
    print(f"kill switch set ({path}): every tool call and new episode of the job stops within a second; the run "
          f"stops after its current step, resumable (clear with: hybridrl agent kill-switch {args.run_dir} --clear)")
    return 0


def _audit(args) -> int:
    from collections import Counter
    from pathlib import Path

    from hybridrl.agent import killswitch
    from hybridrl.telemetry import audit

    path = Path(args.run_dir)
    if path.is_dir():
        path = Path(killswitch.switch_path(path)[1] or path / "audit.jsonl")
    if not path.is_file():
        print(f"hybridrl: no audit log at {path}", file=sys.stderr)
        return 2
    intact, count, problem = audit.verify(path)
    kinds = Counter(r.get("kind") for r in audit.records(path))
    n, head = audit.head(path) if count else (0, audit.GENESIS)
    egress = Counter(r.get("verdict", "?").split(":")[0] for r in audit.records(path) if r.get("kind") == "egress")
    if args.json:
        print(json.dumps({"path": str(path), "intact": intact, "records": count, "problem": problem or None,
                          "head": head, "kinds": dict(kinds), "egress": dict(egress)}, indent=2))
    else:
        print(f"audit log {path}: {count} records, " + ("chain intact" if intact else f"TAMPERED: {problem}"))
        print(f"head: record {n} {head}")
        for kind, k in sorted(kinds.items()):
            print(f"  {kind:24s} {k}")
        if egress:
            print("egress: " + ", ".join(f"{v} {k}" for v, k in sorted(egress.items())))
    return 0 if intact else 1


def _tasks(cfg, args) -> int:
    from hybridrl.envs.tasks import get_task

    task = get_task(cfg.task.name, cfg.task)
    if args.split == "sft":
        rows = [{"messages": m} for m in task.sft_demonstrations(args.n)]
    elif args.split == "train":
        rows = [i.to_dict() for i in task.train_split(args.n)]
    else:
        rows = [i.to_dict() for i in task.validation_split(args.n)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {len(rows)} {args.split} rows of task {task.name} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _rollout_temperature(cfg, args) -> tuple[float, str]:
    if args.temperature is not None:
        return args.temperature, "--temperature"
    if args.split == "validation":
        return cfg.trainer.validation_temperature, "trainer.validation_temperature"
    return cfg.agent.temperature, "agent.temperature"


def _agent_recipe_refusal(cfg, args) -> str:
    """What to run instead for a task.agent recipe: `hybridrl eval` with the same recipe runs its episodes."""
    import shlex

    given = ([args.config] if args.config else []) + list(args.recipe_args)
    command = shlex.join(["hybridrl", "eval", *given, "-n", str(args.n)])
    return (f"hybridrl: agent rollout runs the built-in agent loop, and this recipe's episodes are an OpenAI-client "
            f"agent's (task.agent={cfg.task.agent}); `hybridrl eval` runs them through the gateway (greedy and "
            f"sampled accuracy on the validation split):\n    {command}")


def _rollout(cfg, args) -> int:
    import asyncio

    from transformers import AutoTokenizer

    from hybridrl.envs.tasks import get_task

    if cfg.task.agent:       # the gateway's runner sits above this package (hybridrl/gateway/runner.py)
        print(_agent_recipe_refusal(cfg, args), file=sys.stderr)
        return 2
    task = get_task(cfg.task.name, cfg.task)
    instances = (task.validation_split if args.split == "validation" else task.train_split)(args.n)
    model = _model_or_tiny(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.engine == "scripted" and task.name != "calculator":
        print("hybridrl: --engine scripted plays the calculator task only", file=sys.stderr)
        return 2
    engine = _rollout_engine(args.engine, model, tokenizer)
    temperature, source = _rollout_temperature(cfg, args)
    print(f"sampling at temperature {temperature:g} ({source}) on {len(instances)} {args.split} instances",
          file=sys.stderr)
    trajs, stats, wall = asyncio.run(_episodes(cfg, args, task, instances, engine, tokenizer, temperature))
    summary = _rollout_summary(task, args, trajs, stats, wall, temperature=temperature, source=source)
    for t in trajs[: args.show]:
        print(f"--- {t.trajectory_id} [{t.status.value}] reward {t.reward}")
        print(tokenizer.decode(t.prompt_ids + t.response_ids))
    print(json.dumps(summary, indent=2, default=str))
    how = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    print(f"{args.split} accuracy ({how}, {source}): {100 * summary['accuracy']:.1f}% of {len(trajs)} episodes",
          file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0


def _model_or_tiny(cfg) -> str:
    """model.path, or (when empty) a tiny random model built once under the run directory."""
    if cfg.model.path:
        return cfg.model.path
    from pathlib import Path

    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    model = str(Path(cfg.run.dir) / "tiny-qwen2")
    if not Path(model, "config.json").exists():
        build_tiny_model(model, TinyModelSpec())
    print(f"model.path is empty: using a tiny random model at {model}", file=sys.stderr)
    return model


def _rollout_engine(kind: str, model: str, tokenizer):
    """`--engine scripted` (the calculator oracle) or the native engine on the CPU."""
    if kind == "scripted":
        from hybridrl.agent.testing import ScriptedEngine, calculator_oracle

        return ScriptedEngine(tokenizer, calculator_oracle(tokenizer, calls=1), step_latency_s=0.001)
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig

    return NativeEngine.from_pretrained(model, NativeEngineConfig(), device="cpu")


async def _episodes(cfg, args, task, instances, engine, tokenizer, temperature: float):
    """The instances' episodes through the built-in loop: (trajectories, the runner's stats, wall seconds)."""
    import time

    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.envs.tasks import Task

    envs = None
    if type(task).make_env is not Task.make_env:         # a stateful task: through the leased service
        from hybridrl.envs.client import LeasedEnvProvider
        from hybridrl.envs.service import EnvService

        envs = LeasedEnvProvider(EnvService.from_config(cfg.env), cfg.env)
    names = sorted({t for i in instances for t in i.tools})
    async with ToolBox.from_config(cfg.tools, names=names) as tools:
        runner = AgentRunner(engine, tokenizer, agent_cfg=cfg.agent, tools=tools, run_id=cfg.run.name,
                             seed=cfg.run.seed, envs=envs)
        t0 = time.perf_counter()
        trajs = await runner.run(instances, task=task, group_size=args.group_size, temperature=temperature)
        wall = time.perf_counter() - t0
        return trajs, runner.stats(wall), wall


def _rollout_summary(task, args, trajs, stats, wall: float, *, temperature: float, source: str) -> dict:
    from collections import Counter

    statuses = Counter(t.status.value + (f"/{t.truncation.value}" if t.truncation else "") for t in trajs)
    accuracy = sum(t.rewards.get("correct", t.reward) for t in trajs) / len(trajs)
    return {"task": task.name, "engine": args.engine, "split": args.split, "temperature": temperature,
            "temperature_from": source, "episodes": len(trajs), "wall_s": round(wall, 3),
            "accuracy": accuracy, "mean_reward": sum(t.reward for t in trajs) / len(trajs),
            "statuses": dict(statuses),
            "mean_turns": sum(t.turns for t in trajs) / len(trajs),
            "mean_response_tokens": sum(len(t.response_ids) for t in trajs) / len(trajs),
            **{k: v for k, v in stats.items() if k != "tools"}, "tools": stats["tools"]}
