"""The `hybridrl` command. Each subcommand's module is imported only when it runs. A recipe is
given the same way everywhere: as the first positional argument or with --config.

    hybridrl train RECIPE [key=value ...]      check the run's inputs, start torchrun on this node
               [--overwrite] [--check]         (--overwrite: replace an earlier run in run.dir)
    hybridrl sft RECIPE [key=value ...]        the same with run.job=sft (supervised warm start)
    hybridrl config show RECIPE [k=v]          print the resolved config [--diff] [--section S[.KEY]]
                                               [--explain]: and the objective it trains, refusals, warnings
    hybridrl init task NAME [--dir D]          a runnable task module + its SFT and GRPO recipes
    hybridrl init recipe NAME [--out F]        copy a shipped recipe here (--list: their names)
    hybridrl config defaults [--write DIR]     the documented defaults of every section
    hybridrl assets tiny-model --arch A --out D
    hybridrl assets tiny-classifier --policy P --out D
    hybridrl doctor [--json]                   versions, devices, a 2-rank self-test
    hybridrl bench mode-switch --model D --cycles N --json OUT   the hybrid engine's switch cost
    hybridrl agent sandbox-check|tasks|rollout the agent layer (see hybridrl/cli/agent.py)
    hybridrl gateway check [RECIPE] [--socket S | --url U --key K]   the gateway's attack set, PASS/FAIL each
    hybridrl score --model D --input I --output O [--tp T --pp P]   per-token logprobs (parity checks)
    hybridrl generate --model D --input I --output O --max-new-tokens N   token ids or text in, samples out
    hybridrl replica --model D [--registry DIR]   a rollout replica for rollout.engine=replicas (HTTP)
    hybridrl chat MODEL                        text in, text out (chat template applied)
    hybridrl eval RECIPE [--model DIR] [-n N]  greedy and sampled accuracy on the validation split + a verdict
    hybridrl eval SUITE --model DIR | --run RUN_DIR [--checkpoints all|last|N,M] [--compare]   a suite (configs/eval/)
    hybridrl plot RUN [RUN ...] [--out F.png]  curves of one or more runs as a PNG
    hybridrl compare A B                       config differences and a metric table of two runs
    hybridrl demo [--dir D] [key=value | sft:key=value | grpo:key=value ...]   base model -> SFT -> GRPO
    hybridrl cost RUN_DIR [RUN_DIR ...] [--json]   device-seconds by stage, what never trained, money
    hybridrl plan RUN_DIR [--measure] [--target-tokens-per-s X | --ranks N] [--what-if k=v]   capacity plan
    hybridrl export RUN [--step N] [--peft] --out DIR   a checkpoint as an HF (or PEFT) directory (torchrun)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from hybridrl import __version__
from hybridrl.config import ConfigError, load_config
from hybridrl.config.cli import add_recipe_arguments, recipe_and_overrides
from hybridrl.distributed.process_exit import torchrun_command
from hybridrl.registry import Lazy

EXIT_CONFIG = 2


def _cmd_train(args: argparse.Namespace) -> int:
    from hybridrl.jobs import owns_run_dir
    from hybridrl.store import rundir
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
        if args.overwrite and not args.check and owns_run_dir(cfg.run.job):
            removed = rundir.remove_outputs(cfg.run.dir)
            notes = [n for n in notes if n.startswith("warning:")]
            notes += [f"--overwrite: removed {', '.join(removed)} from {cfg.run.dir}"] if removed else []
    except (ConfigError, PreflightError) as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    for note in notes:
        print(f"hybridrl: {note}", file=sys.stderr)
    nproc = args.nproc_per_node or cfg.distributed.nproc_per_node
    restarts = cfg.trainer.max_restarts if cfg.run.job == "rl" else 0
    cmd = torchrun_command(nproc, *([f"--max-restarts={restarts}"] if restarts else []),
                           "-m", "hybridrl.train", *(["--config", recipe] if recipe else []), *overrides)
    if args.check:
        nodes = f" x {args.nnodes} nodes" if args.nnodes > 1 else ""
        print(f"hybridrl: checked {recipe or 'the defaults'}: config, model, task and run.dir are ready "
              f"({nproc} rank(s) per node{nodes})", file=sys.stderr)
        return 0
    print(f"hybridrl: launching {nproc} rank(s): {' '.join(cmd[1:])}", file=sys.stderr)
    sys.stderr.flush()
    from hybridrl.launcher import supervise

    return supervise(cmd, run_dir=cfg.run.dir if owns_run_dir(cfg.run.job) else None)   # Ctrl-C: see launcher.py


def _cmd_config_show(args: argparse.Namespace) -> int:
    from hybridrl.config.cli import show_text

    try:
        cfg = load_config(*recipe_and_overrides(args.recipe_args, args.config))
        text = show_text(cfg, diff=args.diff, sections=args.section)
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(text)
    if args.explain:         # the objective in words and the checks (hybridrl/algo/explain.py)
        from hybridrl.algo.explain import REFUSE, explain

        text, found = explain(cfg)
        sys.stdout.write("".join(f"# {line}\n" for line in text.splitlines()))
        refused = [f for f in found if f.level == REFUSE]
        for f in refused:
            print(f"hybridrl: refused: {f}", file=sys.stderr)
        return EXIT_CONFIG if refused else 0
    return 0


def _cmd_init_task(args: argparse.Namespace) -> int:
    from hybridrl.scaffold import main

    return main(args)


def _cmd_init_agent(args: argparse.Namespace) -> int:
    from hybridrl.scaffold_agent import main

    return main(args)


def _cmd_init_recipe(args: argparse.Namespace) -> int:
    from hybridrl import shipped

    if args.list or not args.name:
        for name in shipped.recipe_names():
            print(name)
        return 0
    try:
        target, notes = shipped.copy_recipe(args.name, Path(args.out), force=args.force)
    except (FileNotFoundError, FileExistsError) as err:
        print(f"hybridrl init recipe: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {target} (from the shipped recipe {args.name}); run it with: hybridrl train {target}")
    for note in notes:
        print(f"hybridrl init recipe: note: {note}", file=sys.stderr)
    return 0


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


def _cmd_config_reference(args: argparse.Namespace) -> int:
    from hybridrl.config.reference import markdown

    text = markdown()
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(text)
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
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
    from hybridrl.cli.agent import main

    return main(args)


def _cmd_gateway(args: argparse.Namespace) -> int:
    from hybridrl.cli.gateway import main

    return main(args)


def _cmd_score(args: argparse.Namespace) -> int:
    from hybridrl.cli.score import main
    from hybridrl.preflight import PreflightError, check_model

    try:                           # before torchrun: one line, not a traceback per rank
        check_model(args.model, key="--model")
    except PreflightError as err:
        print(f"hybridrl score: {err}", file=sys.stderr)
        return EXIT_CONFIG

    return main(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from hybridrl.cli.generate import main

    return main(args)


def _cmd_bench_mode_switch(args: argparse.Namespace) -> int:
    from hybridrl.bench.cli import mode_switch_main

    return mode_switch_main(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from hybridrl.inspect.cli import main

    return main(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from hybridrl.cli.eval import main

    return main(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    from hybridrl.telemetry.plot import main

    return main(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from hybridrl.compare import main

    return main(args)


def _cmd_replica(args: argparse.Namespace) -> int:
    from hybridrl.backends.replicas.server import main

    return main(args)


def _cmd_chat(args: argparse.Namespace) -> int:
    from hybridrl.chat import main

    return main(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from hybridrl.cli.export import main

    return main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hybridrl.demo import main

    return main(args)


def _cmd_cost(args: argparse.Namespace) -> int:
    from hybridrl.cost.cli import cost_main

    return cost_main(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from hybridrl.cost.cli import plan_main

    return plan_main(args)


def _train_parsers(sub: Any) -> None:
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
                            "during the step's rollout; disk_full at its checkpoint; nan, mismatch in its update "
                            "(hybridrl/controller/faults.py)")
        p.set_defaults(func=_cmd_train, job_overrides=job)


def _config_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="inspect configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("show", help="print the resolved config")
    add_recipe_arguments(c)
    c.add_argument("--diff", action="store_true", help="only what differs from the defaults (each with its default)")
    c.add_argument("--section", action="append", default=[], metavar="SECTION[.KEY]",
                   help="only this section or key (repeatable), e.g. --section trainer --section agent.temperature")
    c.add_argument("--explain", action="store_true", help="also say what objective it trains and refuse or warn on "
                                                          "combinations that would train something else (exit 2)")
    c.set_defaults(func=_cmd_config_show)
    c = csub.add_parser("defaults", help="the documented defaults (what configs/ holds)")
    c.add_argument("--write", default=None, metavar="DIR")
    c.set_defaults(func=_cmd_config_defaults)
    c = csub.add_parser("reference", help="every section and knob as a Markdown page (docs/reference/config.md)")
    c.add_argument("--write", default=None, metavar="FILE", help="write the page there (default: print it)")
    c.set_defaults(func=_cmd_config_reference)


def _nested(sub: Any, name: str, help_text: str, dest: str, commands: Sequence[tuple]) -> None:
    """A command with sub-commands, each (name, help, "module:add_arguments", handler)."""
    nested = sub.add_parser(name, help=help_text).add_subparsers(dest=dest, required=True)
    for command in commands:
        _delegated(nested, *command)


def _delegated(sub: Any, name: str, help_text: str, add_arguments: str, handler: Any) -> None:
    """A command whose own module adds its arguments (`add_arguments`: 'module:function(parser)')."""
    p = sub.add_parser(name, help=help_text)
    Lazy(add_arguments)(p)
    p.set_defaults(func=handler)


def _doctor_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="versions, devices and a 2-rank self-test")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--no-selftest", action="store_true")
    p.set_defaults(func=_cmd_doctor)


def _init_parser(sub: Any) -> None:
    isub = sub.add_parser("init", help="start something of your own from a template").add_subparsers(
        dest="init_command", required=True)
    _delegated(isub, "task", "a runnable task module with its SFT and GRPO recipes",
               "hybridrl.scaffold:add_arguments", _cmd_init_task)
    _delegated(isub, "agent", "an agent written with the OpenAI client, with its GRPO recipe (through the gateway)",
               "hybridrl.scaffold_agent:add_arguments", _cmd_init_agent)
    i = isub.add_parser("recipe", help="copy a recipe that ships with hybridrl here (--list: their names)")
    i.add_argument("name", nargs="?", default=None, help="e.g. calc_grpo_cpu (see --list)")
    i.add_argument("--out", default=".", help="a file, or a directory to write NAME.yaml in (default: here)")
    i.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    i.add_argument("--list", action="store_true", help="list the shipped recipes")
    i.set_defaults(func=_cmd_init_recipe)


# the commands whose own module adds their arguments, in the order of `hybridrl --help` after `doctor`
_COMMANDS = (
    ("agent", "agent layer: sandbox check, task data, episodes", "hybridrl.cli.agent:add_arguments", _cmd_agent),
    ("gateway", "the OpenAI-compatible gateway: its attack set (check)", "hybridrl.cli.gateway:add_arguments",
     _cmd_gateway),
    ("score", "per-token logprobs of given token ids (starts torchrun)", "hybridrl.backends.megatron.score:add_arguments",
     _cmd_score),
    ("generate", "sample from an HF model with a rollout engine (token ids or text in, JSONL)",
     "hybridrl.cli.generate:add_arguments", _cmd_generate),
    ("replica", "a rollout replica: a native engine behind HTTP for a run with rollout.engine=replicas",
     "hybridrl.backends.replicas.server:add_arguments", _cmd_replica),
    ("inspect", "the run ledger of an RL run: trajectories, lineage, trace questions, HTML",
     "hybridrl.inspect.cli:add_arguments", _cmd_inspect),
    ("eval", "a suite (configs/eval/) on a model or a run's checkpoints; or, given a recipe, greedy and sampled "
             "accuracy on a task's validation split and whether RL has a signal", "hybridrl.cli.eval:add_arguments",
     _cmd_eval),
    ("chat", "talk to a model: text in, text out, its chat template applied", "hybridrl.chat:add_arguments", _cmd_chat),
    ("plot", "a run's curves as a PNG (reward, accuracy, KL, entropy, loss, stage times); several runs overlaid",
     "hybridrl.telemetry.plot:add_arguments", _cmd_plot),
    ("compare", "two runs side by side: config differences and a metric table", "hybridrl.compare:add_arguments",
     _cmd_compare),
    ("export", "a run's checkpoint as an HF directory, or a LoRA run's adapters as a PEFT directory (--peft); "
               "starts torchrun",
     "hybridrl.cli.export:add_arguments", _cmd_export),
    ("cost", "what a run cost: device-seconds by stage, never-trained work, money",
     "hybridrl.cost.cli:add_cost_arguments", _cmd_cost),
    ("plan", "capacity plan: stage capacities, the bottleneck, placement, ranks, lag",
     "hybridrl.cost.cli:add_plan_arguments", _cmd_plan),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hybridrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parsers(sub)
    _config_parser(sub)
    _nested(sub, "assets", "make local assets (nothing is downloaded)", "assets_command", (
        ("tiny-model", "a tiny HF model directory (config, weights, tokenizer)",
         "hybridrl.assets.tiny_model:add_arguments", _cmd_assets_tiny_model),
        ("tiny-classifier", "a tiny reward model (1-label classifier) with a known scoring rule",
         "hybridrl.assets.tiny_classifier:add_arguments", _cmd_assets_tiny_classifier)))
    _doctor_parser(sub)
    for command in _COMMANDS[:3]:
        _delegated(sub, *command)
    _nested(sub, "bench", "benchmarks (each writes JSON)", "bench_command", (
        ("mode-switch", "TRAIN -> ROLLOUT -> TRAIN cycles against the copy floor",
         "hybridrl.bench.cli:add_mode_switch_arguments", _cmd_bench_mode_switch),))
    for command in _COMMANDS[3:]:
        _delegated(sub, *command)
    _init_parser(sub)
    _delegated(sub, "demo", "the CPU demo: tiny base model -> SFT -> GRPO with a calculator, accuracy before and "
                            "after", "hybridrl.demo:add_arguments", _cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from hybridrl.envs.tasks.registry import importable_from_cwd
    from hybridrl.host_memory import choose_blas_path, choose_pages

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:      # key=value after an option (`train R.yaml --overwrite k=v`): overrides all the same
        if not hasattr(args, "recipe_args"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        stray = next((i for i, e in enumerate(extra) if "=" not in e or e.startswith("-")), None)
        if stray is not None:
            if extra[stray].startswith("-"):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            from hybridrl.config.cli import not_an_override

            print(f"hybridrl: {not_an_override(extra, stray)}", file=sys.stderr)
            return EXIT_CONFIG
        args.recipe_args = [*args.recipe_args, *extra]
    importable_from_cwd()          # task.name=module:Class from the working directory, as on the ranks
    choose_pages()                 # in-process commands; the ranks of a run choose for their placement
    choose_blas_path()             # before the first matrix product; inherited by every process started
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
