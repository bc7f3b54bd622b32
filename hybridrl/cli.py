"""The `hybridrl` command. Each subcommand's module is imported only when it runs.

    hybridrl train RECIPE [key=value ...]      start torchrun on this node with the recipe's ranks
    hybridrl sft RECIPE [key=value ...]        the same with run.job=sft (supervised warm start)
    hybridrl config show --config RECIPE [k=v] print the resolved config
    hybridrl config defaults [--write DIR]     the documented defaults of every section
    hybridrl assets tiny-model --arch A --out D
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

EXIT_CONFIG = 2


def _cmd_train(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    nproc = args.nproc_per_node or cfg.distributed.nproc_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "hybridrl.train", "--config", args.recipe, *args.overrides]
    print(f"hybridrl: launching {nproc} rank(s): {' '.join(cmd[1:])}", file=sys.stderr)
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
    return 1  # not reached


def _cmd_sft(args: argparse.Namespace) -> int:
    args.overrides = [*args.overrides, "run.job=sft"]
    return _cmd_train(args)


def _cmd_config_show(args: argparse.Namespace) -> int:
    recipe, overrides = args.config, list(args.overrides)
    if args.recipe is not None:
        if recipe is None and "=" not in args.recipe:
            recipe = args.recipe              # `config show RECIPE k=v`
        else:
            overrides.insert(0, args.recipe)  # the first positional was an override
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(to_yaml(cfg))
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


def _cmd_assets_tiny_model(args: argparse.Namespace) -> int:
    from hybridrl.assets.tiny_model import main

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


def _cmd_demo(args: argparse.Namespace) -> int:
    from hybridrl.demo import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hybridrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run a recipe on this node (starts torchrun)")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: distributed.nproc_per_node")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on a task's demonstrations (train with run.job=sft)")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: distributed.nproc_per_node")
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("config", help="inspect configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("show", help="print the resolved config")
    c.add_argument("recipe", nargs="?", default=None)
    c.add_argument("--config", default=None, help="recipe YAML")
    c.add_argument("overrides", nargs="*", help="section.key=value")
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


    p = sub.add_parser("demo", help="the CPU demo: tiny base model -> SFT -> GRPO with a calculator, accuracy "
                                    "before and after")
    from hybridrl.demo import add_arguments as add_demo_arguments

    add_demo_arguments(p)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
