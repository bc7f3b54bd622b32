"""docs/newcomer.md's commands are valid: every `hybridrl` line parses with the real command line (no
unknown command, option or stray argument), the scaffolds it writes are written, and every recipe it runs
loads with the overrides it gives (keys, types). Its first block is the walk-through that
tests/test_scaffold.py runs end to end, and the README's "Writing a new task" holds the same lines."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from hybridrl.cli import build_parser, main
from hybridrl.config import load_config
from tests.launch import ROOT
from tests.test_scaffold import walkthrough_lines

PAGE = ROOT / "docs" / "newcomer.md"


def commands(text: str) -> list[list[str]]:
    """argv (without `hybridrl`) of every `hybridrl` line in the text's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()]
    return [argv[1:] for argv in lines if argv and argv[0] == "hybridrl"]


def parsed(argv: list[str]) -> argparse.Namespace:
    """The namespace `hybridrl` would run with; stray arguments fail as they do in `main`."""
    args, extra = build_parser().parse_known_args(argv)
    assert all("=" in e and not e.startswith("-") for e in extra) and (not extra or hasattr(args, "recipe_args")), \
        f"hybridrl {' '.join(argv)}: unrecognized {extra}"
    if extra:
        args.recipe_args = [*args.recipe_args, *extra]
    return args


@pytest.fixture
def fresh_modules():
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("feet", "feet_agent")):
            del sys.modules[name]


def test_every_command_of_the_newcomer_page_is_valid(tmp_path, monkeypatch, fresh_modules, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = commands(PAGE.read_text())
    assert {argv[0] for argv in lines} >= {"init", "sft", "train", "eval", "inspect", "export"}
    assert ["init", "agent"] in [argv[:2] for argv in lines] and any("--peft" in argv for argv in lines)
    loaded: dict[tuple, object] = {}                   # (recipe, overrides) -> its config, each loaded once
    for argv in lines:
        args = parsed(argv)
        if argv[0] == "init":                                  # the scaffolds: written here, as a user would
            assert main(argv) == 0, argv
            continue
        recipe = next((a for a in getattr(args, "recipe_args", []) if a.endswith(".yaml")), None)
        if recipe is not None:
            assert Path(recipe).exists(), f"hybridrl {' '.join(argv)}: {recipe} is written by no line before it"
            overrides = tuple(a for a in args.recipe_args if "=" in a)
            if (recipe, overrides) not in loaded:
                loaded[recipe, overrides] = load_config(recipe, list(overrides))
    assert len(loaded) >= 4
    cfg = loaded["feet_agent_grpo.yaml", ()]
    assert cfg.task.name == "feet:FeetTask" and cfg.task.agent == "feet_agent:run"
    assert cfg.model.path == "runs/feet/sft/hf" == loaded["feet_grpo.yaml", ()].model.path
    lora = next(c for (r, o), c in loaded.items() if "train.lora.rank=16" in o)
    assert lora.train.lora.rank == 16 and lora.run.dir == "runs/feet/lora"


def test_a_wrong_command_on_the_page_would_fail():
    for argv in (["train", "feet_grpo.yaml", "--chekc"], ["init", "agnet", "x"], ["export", "runs/x", "stray"]):
        with pytest.raises((AssertionError, SystemExit)):
            parsed(argv)


def test_the_walkthrough_is_the_readme_and_the_page_alike():
    readme = (ROOT / "README.md").read_text().split("### Writing a new task", 1)[1]
    assert walkthrough_lines(readme) == walkthrough_lines(PAGE.read_text())
    assert [argv[0] for argv in commands("```bash\n" + "\n".join(walkthrough_lines(PAGE.read_text())) + "\n```")] \
        == ["init", "agent", "assets", "sft", "agent", "train"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_whole_page_runs_in_miniature(tmp_path, monkeypatch, fresh_modules, capsys):
    """Every line of the page in order, in an empty directory, with fewer steps (the walk-through's own
    miniature): the task, SFT, GRPO, eval, inspect, plot, cost, the agent through the gateway, a LoRA run and
    its PEFT export. The runs launch real ranks; the other commands run in process."""
    from tests.test_scaffold import MINIATURE, hybridrl

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for argv in commands(PAGE.read_text()):
        kind = argv[1] if argv[0] in ("agent", "init") else argv[0]
        argv = [*argv, *MINIATURE.get(kind, []), *(["-n", "2"] if kind == "eval" and "-n" not in argv else [])]
        if argv[0] in ("sft", "train", "export"):
            proc = hybridrl(*argv, cwd=tmp_path, timeout=900)
            assert proc.returncode == 0, (argv, proc.stdout[-2000:] + proc.stderr[-4000:])
        else:
            assert main(argv) == 0, argv
    for run in ("feet/sft", "feet/grpo", "feet_agent/grpo", "feet/lora"):
        assert json.loads((tmp_path / "runs" / run / "run.json").read_text())["status"] == "finished", run
    assert (tmp_path / "runs" / "feet" / "peft" / "adapter_config.json").exists()
    assert (tmp_path / "feet.png").exists() and (tmp_path / "feet.html").exists()
