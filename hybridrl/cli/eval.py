"""`hybridrl eval`: a suite on a model or on a run's checkpoints; or, given a recipe, SFT's quick check.

    hybridrl eval SUITE --model DIR [--config RECIPE] [key=value ...]
    hybridrl eval SUITE --run RUN_DIR [--checkpoints all|last|N,M] [--compare] [key=value ...]
    hybridrl eval RECIPE [key=value ...] [--model DIR] [-n N] [--temperature T]     (the recipe form)

The suite form (a name in configs/eval/ or a suite's YAML) runs every sampling of the suite, writes
one result per model to `eval/<suite>/<label>.json` (for a run: RUN_DIR/eval/<suite>/step_N.json),
prints a table, and with --compare draws accuracy and pass@k across the results of the suite as a
PNG beside them (`compare.png`; also on the run's `hybridrl inspect --html` page). Settings other
than the suite's (the rollout engine's cache, the tools' sandbox, the environment service) come from
the run's config (--run), from --config, or from the defaults; `key=value` overrides them. An
evaluation that stops midway resumes where it was: finished episodes are not run again.

The recipe form is the task's validation split greedily and at `agent.temperature`, with a verdict
on whether RL has a signal (what SFT's self-validation reports): `hybridrl.evaluate.episodes`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_CONFIG = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hybridrl.config.cli import add_recipe_arguments

    add_recipe_arguments(p)
    p.add_argument("--model", default=None, help="HF model directory (a run directory means its hf/); the recipe "
                                                 "form's default: model.path")
    p.add_argument("--run", default=None, metavar="RUN_DIR", help="evaluate a run's models (see --checkpoints)")
    p.add_argument("--checkpoints", default=None, metavar="all|last|N,M",
                   help="with --run: which (default all): step 0 is the starting model, the others complete "
                        "checkpoints and the final export")
    p.add_argument("--compare", action="store_true", help="draw the suite's results across steps (compare.png)")
    p.add_argument("--out", default=None, metavar="DIR", help="where results go (default: RUN_DIR/eval/<suite>, or "
                                                              "./eval/<suite> for a model outside a run)")
    p.add_argument("-n", type=int, default=None, help="recipe form: validation instances (default: "
                                                      "task.validation_size)")
    p.add_argument("--temperature", type=float, default=None, help="recipe form: the sampled pass's temperature "
                                                                  "(default: agent.temperature)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the result(s) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")


def main(args: argparse.Namespace) -> int:
    from hybridrl.evaluate.suite import is_suite

    first = args.recipe_args[0] if args.recipe_args and "=" not in args.recipe_args[0] else None
    if args.run or args.checkpoints or args.compare or (first is not None and is_suite(first)):
        return suite_main(args)
    return recipe_main(args)


def suite_main(args: argparse.Namespace) -> int:
    from hybridrl.config import ConfigError
    from hybridrl.evaluate import compare, models
    from hybridrl.evaluate.protect import SuiteOverlap
    from hybridrl.evaluate.runner import run_suite
    from hybridrl.evaluate.suite import SuiteError, load_suite
    from hybridrl.preflight import PreflightError, check_model

    try:
        if not args.recipe_args or "=" in args.recipe_args[0]:
            raise SuiteError("name the suite first: hybridrl eval SUITE --model DIR | --run RUN_DIR")
        suite, overrides = load_suite(args.recipe_args[0]), list(args.recipe_args[1:])
        if bool(args.model) == bool(args.run):
            raise SuiteError("give one of --model DIR or --run RUN_DIR")
        if args.checkpoints and not args.run:
            raise SuiteError("--checkpoints selects a run's models: use it with --run RUN_DIR")
        if args.run:
            run_dir = Path(args.run)
            candidates = models.from_run(run_dir, args.checkpoints or "all")
            cfg = _config(args.config or str(run_dir / "config.json"), overrides)
        else:
            candidate = models.from_model(args.model)
            check_model(str(candidate.path), key="--model")
            candidates, run_dir = [candidate], candidate.run_dir
            # a run's own settings where it kept them (an SFT run of an older version did not: the defaults)
            recipe = args.config or (str(run_dir / "config.json") if run_dir is not None
                                     and (run_dir / "config.json").exists() else None)
            cfg = _config(recipe, overrides)
        if run_dir is not None and (run_dir / "config.json").exists():   # what it trained on, whatever the overrides
            check_against_training(suite, _config(str(run_dir / "config.json"), []),
                                   where=f"the training split of {run_dir}")
        elif args.config:
            check_against_training(suite, cfg, where=f"the training split of {args.config}")
        out_dir = Path(args.out) if args.out else (run_dir / "eval" / suite.name if run_dir is not None
                                                   else Path("eval") / suite.name)
        if args.run:
            models.export_missing(run_dir, candidates)
    except (ConfigError, SuiteError, PreflightError, SuiteOverlap, ValueError, FileNotFoundError) as err:
        print(f"hybridrl eval: {err}", file=sys.stderr)
        return EXIT_CONFIG
    results = []
    for c in candidates:
        result = run_suite(suite, cfg, c.path, out_dir / f"{c.label}.json", label=c.label, model_info=c.info(),
                           device=args.device, progress=not args.no_progress)
        if c.run_dir is not None and c.step is not None:
            record_in_ledger(c.run_dir, result, out_dir / f"{c.label}.json")
        results.append(result)
        print(format_result(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    if args.compare:
        stepped = compare.results_of(out_dir, suite.hash)
        print(compare.table(stepped))
        if stepped:
            png = compare.plot(stepped, out_dir / "compare.png", title=f"{suite.name} (v{suite.spec.version}, "
                                                                       f"{suite.hash}) on {run_dir or out_dir}")
            print(f"wrote {png}")
    return 0


def _config(recipe: str | None, overrides: list[str]) -> Any:
    from hybridrl.config import load_config

    return load_config(recipe, overrides)


def check_against_training(suite: Any, cfg: Any, *, where: str) -> None:
    """The suite shares no instance with the training split of `cfg` (refused, naming them)."""
    from hybridrl.envs.tasks import get_task
    from hybridrl.evaluate.protect import check_disjoint

    task = get_task(cfg.task.name, cfg.task)
    check_disjoint(task.train_split(), [inst for _, inst in suite.instances()], suite=suite.name, where=where)


def record_in_ledger(run_dir: Path, result: dict, path: Path) -> None:
    """A run's model evaluated from the command line: the result joins the run ledger's lineage."""
    from hybridrl.store.ledger import ledger_dir, record_evaluation

    if (ledger_dir(run_dir) / "index.sqlite").exists():
        record_evaluation(run_dir, result, result_path=str(path))


def format_result(result: dict) -> str:
    m = result["model"]
    head = (f"{result['suite']['name']} v{result['suite']['version']} ({result['suite']['hash']}): "
            f"{result['instances']} instances, model {result['label']} ({m['path']}, {m['hash'][:12]}), "
            f"{result['episodes']} episodes ({result['episodes_resumed']} resumed) in {result['seconds']:.0f}s")
    lines = [head]
    for sampling, values in result["metrics"]["sampling"].items():
        passk = "  ".join(f"{k} {100 * v:5.1f}%" for k, v in values.items() if k.startswith("pass@"))
        lines.append(f"  {sampling:12s} accuracy {100 * values.get('accuracy', 0):5.1f}%  {passk + '  ' if passk else ''}"
                     f"reward {values.get('reward', 0):.3f}  tool calls/episode {values.get('tool_calls', 0):.2f}  "
                     f"length {values.get('length', 0):.1f}")
    for task, samplings in result["metrics"].get("per_task", {}).items():
        for sampling, values in samplings.items():
            lines.append(f"    {task}/{sampling}: accuracy {100 * values.get('accuracy', 0):5.1f}%")
    return "\n".join(lines)


def recipe_main(args: argparse.Namespace) -> int:
    """The recipe form: the task's validation split greedily and sampled, and a verdict."""
    from hybridrl.config import ConfigError, load_config
    from hybridrl.config.cli import recipe_and_overrides
    from hybridrl.preflight import PreflightError, check_model

    try:
        recipe, overrides = recipe_and_overrides(args.recipe_args, args.config)
        cfg = load_config(recipe, overrides)
        model = args.model or cfg.model.path
        if model and (Path(model) / "run.json").exists() and (Path(model) / "hf" / "config.json").exists():
            model = str(Path(model) / "hf")                       # a finished run: its exported model
        check_model(model, key="--model" if args.model else "model.path")
    except (ConfigError, PreflightError) as err:
        print(f"hybridrl eval: {err}", file=sys.stderr)
        return 2
    from hybridrl.evaluate.episodes import evaluate

    result = evaluate(cfg, model, n=args.n, temperature=args.temperature, device=args.device)
    g, s = result["greedy"], result["sampled"]
    print(f"{result['task']}: {result['instances']} validation instances, model {model} ({result['seconds']:.0f}s)")
    for name, r in (("greedy", g), (f"sampled T={result['temperature']:g}", s)):
        print(f"  {name:16s} accuracy {100 * r['accuracy']:5.1f}%  reward {r['reward']:.3f}  "
              f"tool calls/episode {r['tool_calls']:.2f}  response tokens {r['response_tokens']:.1f}")
    print(result["verdict"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
