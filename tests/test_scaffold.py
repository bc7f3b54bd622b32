"""`hybridrl init task` and the walk-through of docs/newcomer.md (its first block; the README's "Writing a new
task" holds the same lines, tests/docs/test_newcomer.py checks it): the scaffolded task
loads, draws and scores (in process), the walk-through runs as written through a miniature SFT +
GRPO, and the scaffold learns (slow: >= 25 validation points within 15 minutes)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

import pytest

from hybridrl.cli import main
from hybridrl.config import ConfigError, load_config
from hybridrl.agent.actions import ActionParser
from hybridrl.envs.tasks import EpisodeOutcome
from hybridrl.envs.tasks.registry import get_task
from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo

# What makes the walk-through a miniature: appended to its lines (argparse and the config take the last value).
MINIATURE = {
    "assets": ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128"],
    "sft": ["sft.steps=2", "sft.num_demonstrations=32", "sft.batch_size=16", "sft.log_every=1",
            "train.lr_warmup_steps=1", "train.micro_batch_size=8"],
    "rollout": ["-n", "4"],
    "train": ["trainer.total_steps=1", "trainer.prompts_per_step=2", "trainer.group_size=2",
              "task.validation_size=4", "trainer.checkpoint_every=1", "train.micro_batch_size=4",
              "rollout.native.kv_cache_mb=8", "publish.bucket_mb=1", "agent.max_new_tokens_per_turn=8",
              "agent.max_response_tokens=24"],
}


def walkthrough_lines(text: str) -> list[str]:
    """The walk-through's lines: the first bash block of docs/newcomer.md (or of the README's "Writing a new
    task", given that section's text)."""
    return re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()


def walkthrough() -> list[list[str]]:
    """The newcomer page's walk-through: one argv (without `hybridrl`) per line of its first bash block."""
    block = "\n".join(walkthrough_lines((ROOT / "docs" / "newcomer.md").read_text()))
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    assert all(argv[0] == "hybridrl" for argv in lines if argv)
    return [argv[1:] for argv in lines if argv]


@pytest.fixture
def fresh_modules():
    """The scaffolded module is imported by name: forget it afterwards, so tests do not share it."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "feet" or name.startswith(("feet.", "tasks")):
            del sys.modules[name]


def test_the_scaffold_is_a_task_that_loads_draws_and_scores(tmp_path, monkeypatch, fresh_modules, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["init", "task", "feet"]) == 0
    assert "hybridrl sft feet_sft.yaml" in capsys.readouterr().out
    assert main(["init", "task", "feet"]) == 2                       # never overwrites without --force
    assert main(["init", "task", "Feet-2"]) == 2                     # not a module name
    cfg = load_config("feet_grpo.yaml", ["task.options.max_feet=50"])
    assert cfg.task.name == "feet:FeetTask" and cfg.task.options == {"max_feet": 50}   # "50" -> 50
    assert cfg.run.dir == "runs/feet/grpo" and load_config("feet_sft.yaml").run.dir == "runs/feet/sft"
    with pytest.raises(ConfigError, match=r"key 'task.options.max_feet': expected int, got 'lots'"):
        load_config("feet_grpo.yaml", ["task.options.max_feet=lots"])
    with pytest.raises(ConfigError, match=r"key 'task.options.max_feet': must be in"):
        load_config("feet_grpo.yaml", ["task.options.max_feet=0"])

    task = get_task(cfg.task.name, cfg.task)
    train, val = task.train_split(200), task.validation_split(20)
    assert not {t.task_id for t in train} & {v.task_id for v in val} and train == task.train_split(200)
    assert all(i.tools == ("calculator",) for i in train + val)
    parser = ActionParser(task.action_formats)
    for inst, demo in zip(train, task.sft_demonstrations(20, tool_use_fraction=1.0)):
        roles = [m["role"] for m in demo]
        assert roles[-3:] == ["assistant", "tool", "assistant"]
        call = parser.parse(demo[-3]["content"]).calls[0]
        assert call.name == "calculator" and demo[-2]["content"] == str(eval(call.arguments["expression"]))  # noqa: S307
    for inst in val:
        outcome = lambda answer: EpisodeOutcome(answer=answer, num_answers=1, final_text="", completed=True)  # noqa: E731
        assert task.score(inst, outcome(inst.reference)).total == 1.0
        assert task.score(inst, outcome(str(int(inst.reference) + 1))).total == 0.0

    assert main(["init", "task", "feet", "--dir", "tasks"]) == 0      # a subdirectory: named by its dotted path
    assert load_config("tasks/feet_sft.yaml").task.name == "tasks.feet:FeetTask"


def hybridrl(*argv: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", *argv], cwd=cwd, env=env_with_repo(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow              # two real runs (SFT, GRPO) of the walk-through: ~20 s of the default suite
def test_the_newcomer_walkthrough_runs_as_written(tmp_path, monkeypatch, fresh_modules, capsys):
    """Every line of the walk-through, in order, in an empty directory, with fewer steps: the SFT
    and GRPO lines launch real ranks; the others run in process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = walkthrough()
    assert [argv[:2] if argv[0] in ("init", "agent", "assets") else argv[:1] for argv in lines] == [
        ["init", "task"], ["agent", "tasks"], ["assets", "tiny-model"], ["sft"], ["agent", "rollout"], ["train"]]
    for argv in lines:
        kind = {"assets": "assets", "sft": "sft", "train": "train"}.get(argv[0], argv[1] if argv[0] == "agent" else "")
        argv = [*argv, *MINIATURE.get(kind, [])]
        if argv[0] in ("sft", "train"):
            proc = hybridrl(*argv, cwd=tmp_path)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
            outputs = proc.stdout
        else:
            assert main(argv) == 0, argv
            outputs = capsys.readouterr()
        if argv[:2] == ["agent", "tasks"]:
            demos = [json.loads(line)["messages"] for line in outputs.out.splitlines()]
            assert len(demos) == 2 and all(d[-1]["content"].startswith("<answer>") for d in demos)
        if argv[:2] == ["agent", "rollout"]:
            assert "validation accuracy (greedy, trainer.validation_temperature)" in outputs.err

    sft = tmp_path / "runs" / "feet" / "sft"
    assert (sft / "hf" / "config.json").exists() and json.loads((sft / "run.json").read_text())["status"] == "finished"
    grpo = tmp_path / "runs" / "feet" / "grpo"
    rows = read_metrics(grpo)
    assert [r["step"] for r in rows] == [0, 1]                       # one row per step
    assert rows[0]["val/accuracy"] is not None and rows[1]["val/accuracy"] is not None
    # the SFT model of 2 steps scores nothing: no group has a learning signal, the step does not
    # update, and the run checkpoints (before any optimizer step) and goes on
    assert rows[1]["train/updated"] == 0.0 and rows[1]["policy/version"] == 0
    # the agent's counters: a step's are its training episodes', a validation's its own
    assert rows[1]["agent/episodes"] == rows[1]["episodes"] == 4
    assert rows[0]["val/agent/episodes"] == rows[1]["val/agent/episodes"] == rows[1]["val/episodes"] == 4
    state = json.loads((grpo / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["policy_version"] == 0 and state["identity"]["task"]["name"] == "feet:FeetTask"
    assert "rl: 1 step (1 without an update" in outputs and "validation accuracy (greedy" in outputs
    assert "HF model runs/feet/grpo/hf" in outputs
    record = json.loads((grpo / "run.json").read_text())
    assert record["status"] == "finished" and record["step"] == 1 and record["recipe"].endswith("feet_grpo.yaml")

    # the same line again: the finished run is refused before anything starts
    started = time.perf_counter()
    assert main([*lines[-1], *MINIATURE["train"]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a finished run (step 1 of trainer.total_steps=1)" in err
    assert "--overwrite" in err and time.perf_counter() - started < 20


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_walkthrough_as_written_gains_25_validation_points_within_15_minutes(tmp_path):
    """The walk-through's lines as they are (no miniature): base model, SFT, GRPO on this machine."""
    seconds = {}
    for argv in walkthrough():
        started = time.perf_counter()
        proc = hybridrl(*argv, cwd=tmp_path, timeout=1500)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        seconds[" ".join(argv[:2])] = round(time.perf_counter() - started, 1)
    vals = [(r["step"], r["val/accuracy"]) for r in read_metrics(tmp_path / "runs" / "feet" / "grpo")
            if r.get("val/accuracy") is not None]
    improvement = 100 * (vals[-1][1] - vals[0][1])
    total = sum(seconds.values())
    print(json.dumps({"validation": vals, "improvement_points": improvement, "seconds": seconds, "total_s": total}))
    assert improvement >= 25, vals
    assert total < 15 * 60, seconds


@pytest.mark.slow              # a scaffolded task trained by real ranks: ~17 s
def test_init_task_from_data_scaffolds_a_data_task_that_runs(tmp_path, monkeypatch, capsys):
    """`--from data`: two rows, a score function and two recipes; the task reads the rows, scores with
    the function, and a miniature SFT (on the file) + GRPO run with real ranks."""
    from hybridrl.envs.tasks.data import load_score

    monkeypatch.chdir(tmp_path)
    assert main(["init", "task", "mins", "--from", "data"]) == 0
    assert "hybridrl train mins_grpo.yaml" in capsys.readouterr().out
    assert main(["init", "task", "mins", "--from", "data"]) == 2               # never overwrites without --force
    cfg = load_config("mins_grpo.yaml")
    assert cfg.task.name == "data" and cfg.task.options["score"] == "mins_score.py:compute_score"
    task = get_task("data", cfg.task)
    train, val = task.train_split(), task.validation_split()
    assert sorted(i.reference for i in train) == sorted(i.reference for i in val) == ["135", "195"]
    val = [i for i in val if i.reference == "195"]
    score = load_score("mins_score.py:compute_score")
    for text, want in (("<calc>3*60+15</calc>", 0.0), ("<answer>195</answer>", 1.0), ("<answer>194</answer>", 0.0)):
        got = task.score(val[0], EpisodeOutcome(answer=None, num_answers=0, final_text=text, completed=True))
        assert got.total == score(text, "195")["score"] == want and set(got.rewards) == {"score", "correct", "format"}

    assert main(["assets", "tiny-model", *MINIATURE["assets"], "--out", "runs/mins/base"]) == 0
    for argv in (["sft", "mins_sft.yaml", *MINIATURE["sft"]],
                 ["train", "mins_grpo.yaml", *MINIATURE["train"]]):
        proc = hybridrl(*argv, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads((tmp_path / "runs" / "mins" / "sft" / "run.json").read_text())["status"] == "finished"
    rows = read_metrics(tmp_path / "runs" / "mins" / "grpo")
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["val/episodes"] == 2
