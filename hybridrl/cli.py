"""The `hybridrl` command. Each subcommand's module is imported only when it runs. A recipe is
given the same way everywhere: as the first positional argument or with --config.

    hybridrl train RECIPE [key=value ...]      check the run's inputs, start torchrun on this node
               [--overwrite] [--check]         (--overwrite: replace an earlier run in run.dir)
    hybridrl sft RECIPE [key=value ...]        the same with run.job=sft (supervised warm start)
    hybridrl config show RECIPE [k=v]          print the resolved config
    hybridrl init task NAME [--dir D]          a runnable task module + its SFT and GRPO recipes
    hybridrl config defaults [--write DIR]     the documented defaults of every section
    hybridrl assets tiny-model --arch A --out D
    hybridrl assets tiny-classifier --policy P --out D
    hybridrl doctor [--json]                   versions, devices, a 2-rank self-test
    hybridrl bench mode-switch --model D --cycles N --json OUT   the hybrid engine's switch cost
    hybridrl agent sandbox-check|tasks|rollout the agent layer (see hybridrl/agent/cli.py)
    hybridrl score --model D --input I --output O [--tp T --pp P]   per-token logprobs (parity checks)
    hybridrl generate --model D --input I --output O --max-new-tokens N   token ids in, samples out
    hybridrl demo [--dir D] [key=value | sft:key=value | grpo:key=value ...]   base model -> SFT -> GRPO
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from hybridrl import __version__
from hybridrl.config import ConfigError, load_config, to_yaml
from hybridrl.config.cli import add_recipe_arguments, recipe_and_overrides

EXIT_CONFIG = 2


def _cmd_train(args: argparse.Namespace) -> int:
    from hybridrl.controller import rundir
    from hybridrl.preflight import PreflightError, preflight

    try:
        recipe, overrides = recipe_and_overrides(args.recipe_args, args.config, extra=args.job_overrides)
        if args.inject:
            overrides = [*overrides, f"trainer.inject=[{','.join(args.inject)}]"]
        cfg = load_config(recipe, overrides)
        if args.nnodes > 1 and not args.check:
            raise ConfigError("--nnodes > 1 goes with --check: start a multi-node run with torchrun on every node "
                              "or with recipes/slurm/train.sbatch")
        notes = preflight(cfg, overwrite=args.overwrite,
                          world_size=args.nnodes * (args.nproc_per_node or cfg.distributed.nproc_per_node))
        if args.overwrite and not args.check and cfg.run.job in rundir.JOBS:
            removed = rundir.remove_outputs(cfg.run.dir)
            notes = [f"--overwrite: removed {', '.join(removed)} from {cfg.run.dir}"] if removed else []
    except (ConfigError, PreflightError) as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    for note in notes:
        print(f"hybridrl: {note}", file=sys.stderr)
    nproc = args.nproc_per_node or cfg.distributed.nproc_per_node
    restarts = cfg.trainer.max_restarts if cfg.run.job == "rl" else 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *([f"--max-restarts={restarts}"] if restarts else []),
           "-m", "hybridrl.train", *(["--config", recipe] if recipe else []), *overrides]
    if args.check:
        nodes = f" x {args.nnodes} nodes" if args.nnodes > 1 else ""
        print(f"hybridrl: checked {recipe or 'the defaults'}: config, model, task and run.dir are ready "
              f"({nproc} rank(s) per node{nodes})", file=sys.stderr)
        return 0
    print(f"hybridrl: launching {nproc} rank(s): {' '.join(cmd[1:])}", file=sys.stderr)
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
    return 1  # not reached


def _cmd_config_show(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(*recipe_and_overrides(args.recipe_args, args.config))
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(to_yaml(cfg))
    return 0


def _cmd_init_task(args: argparse.Namespace) -> int:
    from hybridrl.scaffold import main

    return main(args)


def _cmd_config_defaults(args: argparse.Namespace) -> int:
    from hybridrl.config.loader import defaults_yaml

    texts = defaults_yaml()
    if args.write:
        out = Path(args.write)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (out / f"{name}.yaml").write_text(text)
        print(f"wrote {len(texts)} files to {out}")
    else:
        sys.stdout.write("\n".join(texts.values()))
    return 0


def _cmd_assets_tiny_model(args: argparse.Namespace) -> int:
    from hybridrl.assets.tiny_model import main

    return main(args)


def _cmd_assets_tiny_classifier(args: argparse.Namespace) -> int:
    from hybridrl.assets.tiny_classifier import main

    return main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from hybridrl.doctor import main

    return main(args)


def _cmd_agent(args: argparse.Namespace) -> int:
    from hybridrl.agent.cli import main

    return main(args)


def _cmd_score(args: argparse.Namespace) -> int:
    from hybridrl.backends.megatron.score import main

    return main(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from hybridrl.backends.native.cli import main

    return main(args)


def _cmd_bench_mode_switch(args: argparse.Namespace) -> int:
    from hybridrl.bench.cli import mode_switch_main

    return mode_switch_main(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from hybridrl.inspect.cli import main

    return main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hybridrl.demo import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hybridrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, job, help_text in (("train", [], "run a recipe on this node (checks its inputs, starts torchrun)"),
                                 ("sft", ["run.job=sft"], "supervised warm start on a task's demonstrations "
                                                          "(train with run.job=sft)")):
        p = sub.add_parser(name, help=help_text)
        add_recipe_arguments(p)
        p.add_argument("--nproc-per-node", type=int, default=None, help="default: distributed.nproc_per_node")
        p.add_argument("--overwrite", action="store_true",
                       help="remove an earlier run's outputs from run.dir first (else a finished run, a run without "
                            "a checkpoint or another run's checkpoint there is refused)")
        p.add_argument("--check", action="store_true", help="check the config and the run's inputs; start nothing")
        p.add_argument("--nnodes", type=int, default=1,
                       help="with --check: the nodes the run will span (world size = nnodes x ranks per node; "
                            "recipes/slurm/train.sbatch passes SLURM's)")
        p.add_argument("--inject", action="append", default=[], metavar="KIND@STEP[:MOMENT]",
                       help="inject a fault, once per run directory (what trainer.inject sets): kill_job or "
                            "kill_rank[N] at switch|rollout|train|log|checkpoint; engine, tool, reward, env_kill "
                            "during the step's rollout; disk_full at its checkpoint (hybridrl/controller/faults.py)")
        p.set_defaults(func=_cmd_train, job_overrides=job)

    p = sub.add_parser("config", help="inspect configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("show", help="print the resolved config")
    add_recipe_arguments(c)
    c.set_defaults(func=_cmd_config_show)
    c = csub.add_parser("defaults", help="the documented defaults (what configs/ holds)")
    c.add_argument("--write", default=None, metavar="DIR")
    c.set_defaults(func=_cmd_config_defaults)

    p = sub.add_parser("assets", help="make local assets (nothing is downloaded)")
    asub = p.add_subparsers(dest="assets_command", required=True)
    a = asub.add_parser("tiny-model", help="a tiny HF model directory (config, weights, tokenizer)")
    from hybridrl.assets.tiny_model import add_arguments

    add_arguments(a)
    a.set_defaults(func=_cmd_assets_tiny_model)
    a = asub.add_parser("tiny-classifier", help="a tiny reward model (1-label classifier) with a known scoring rule")
    from hybridrl.assets.tiny_classifier import add_arguments as add_classifier_arguments

    add_classifier_arguments(a)
    a.set_defaults(func=_cmd_assets_tiny_classifier)

    p = sub.add_parser("doctor", help="versions, devices and a 2-rank self-test")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--no-selftest", action="store_true")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("agent", help="agent layer: sandbox check, task data, episodes")
    from hybridrl.agent.cli import add_arguments as add_agent_arguments

    add_agent_arguments(p)
    p.set_defaults(func=_cmd_agent)
    p = sub.add_parser("score", help="per-token logprobs of given token ids (starts torchrun)")
    from hybridrl.backends.megatron.score import add_arguments as add_score_arguments

    add_score_arguments(p)
    p.set_defaults(func=_cmd_score)
    p = sub.add_parser("generate", help="sample from an HF model with a rollout engine (token ids in/out, JSONL)")
    from hybridrl.backends.native.cli import add_arguments as add_generate_arguments

    add_generate_arguments(p)
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("bench", help="benchmarks (each writes JSON)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    b = bsub.add_parser("mode-switch", help="TRAIN -> ROLLOUT -> TRAIN cycles against the copy floor")
    from hybridrl.bench.cli import add_mode_switch_arguments

    add_mode_switch_arguments(b)
    b.set_defaults(func=_cmd_bench_mode_switch)


    p = sub.add_parser("inspect", help="the run ledger of an RL run: trajectories, lineage, trace questions, HTML")
    from hybridrl.inspect.cli import add_arguments as add_inspect_arguments

    add_inspect_arguments(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("init", help="start something of your own from a template")
    isub = p.add_subparsers(dest="init_command", required=True)
    i = isub.add_parser("task", help="a runnable task module with its SFT and GRPO recipes")
    from hybridrl.scaffold import add_arguments as add_scaffold_arguments

    add_scaffold_arguments(i)
    i.set_defaults(func=_cmd_init_task)

    p = sub.add_parser("demo", help="the CPU demo: tiny base model -> SFT -> GRPO with a calculator, accuracy "
                                    "before and after")
    from hybridrl.demo import add_arguments as add_demo_arguments

    add_demo_arguments(p)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from hybridrl.envs.tasks.registry import importable_from_cwd

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:      # key=value after an option (`train R.yaml --overwrite k=v`): overrides all the same
        if not hasattr(args, "recipe_args") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.recipe_args = [*args.recipe_args, *extra]
    importable_from_cwd()          # task.name=module:Class from the working directory, as on the ranks
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
