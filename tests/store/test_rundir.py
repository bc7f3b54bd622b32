"""A run directory knows what it is: a launch continues only a run of the same task, model and
shapes that is not finished; anything else is refused in one line (exit 2) unless the user says
what to do (--overwrite, trainer.resume=never). metrics.jsonl never holds two rows for one step."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.store import rundir
from hybridrl.store.checkpoints import CheckpointManager
from hybridrl.telemetry.metrics import MetricsLogger, read_metrics
from tests.launch import ROOT

GRPO = str(ROOT / "recipes" / "calc_grpo_cpu.yaml")
SFT = str(ROOT / "recipes" / "calc_sft_cpu.yaml")


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory):
    copy = tmp_path_factory.mktemp("rundir") / "model"          # its own copy: one test rewrites the weights
    shutil.copytree(tiny_models("qwen2", init_std=0.05), copy)
    return copy


def config(run_dir, model, *overrides, recipe=GRPO):
    return load_config(recipe, [f"model.path={model}", f"run.dir={run_dir}", *overrides])


def earlier_run(cfg, *, steps, checkpoint=None, finished=False):
    """What a run leaves behind: run.json, metrics rows, a checkpoint, maybe the finished mark."""
    rundir.prepare(cfg)
    logger = MetricsLogger(cfg.run.dir, tensorboard=False)
    for step in steps:
        logger.log(step, {"reward/mean": 0.5})
    if checkpoint is not None:
        path = CheckpointManager(cfg.run.dir).path(checkpoint)
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"step": checkpoint, "identity": rundir.identity(cfg)}))
        (path / "COMPLETE").write_text("")
    if finished:
        rundir.mark_finished(cfg.run.dir, steps[-1])


def refusal(cfg) -> str:
    with pytest.raises(rundir.RunDirError) as info:
        rundir.plan(cfg)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_fresh_run_records_what_it_is(tmp_path, model):
    cfg = config(tmp_path / "run", model, "task.options.min_digits=3")
    rundir.record_origin(GRPO, ["task.options.min_digits=3"])
    assert rundir.prepare(cfg).action == "fresh"
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "running" and record["recipe"] == GRPO and record["job"] == "rl"
    assert record["task"] == {"name": "calculator", "version": 1, "seed": 0, "options": {"min_digits": 3}}
    assert record["model"]["path"] == str(model) and "model.safetensors" in record["model"]["weights"]
    assert record["shapes"]["hidden_size"] == json.loads((model / "config.json").read_text())["hidden_size"]
    assert record["shapes"]["train.tp"] == 1


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path, model):
    cfg = config(tmp_path, model)
    earlier_run(cfg, steps=[0, 1, 2, 3], checkpoint=2)
    plan = rundir.plan(cfg)
    assert (plan.action, plan.checkpoint.name) == ("resume", "step_000002")
    assert "steps 3-3 run again" in plan.note


@pytest.mark.parametrize("change, words", [
    (["task.name=guess_number"], "task.name was 'calculator', is 'guess_number'"),
    (["task.options.min_digits=3"], "task.options.min_digits was '(default)', is 3"),
    (["task.seed=4"], "task.seed was 0, is 4"),
    (["train.tp=2"], "train.tp was 1, is 2"),
    (["model.path=OTHER"], "model.path was"),
])
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, model, change, words):
    earlier_run(config(tmp_path / "run", model), steps=[0, 1, 2], checkpoint=2)
    other = shutil.copytree(model, tmp_path / "other")           # the same model elsewhere is another model.path
    message = refusal(config(tmp_path / "run", model, *[c.replace("OTHER", str(other)) for c in change]))
    assert message.startswith(f"run.dir {tmp_path / 'run'} holds a checkpoint of another run (step_000002): ")
    assert words in message and "--overwrite" in message and "trainer.resume=never" in message


def test_rewritten_weights_and_other_shapes_are_refused(tmp_path, model):
    earlier_run(config(tmp_path, model), steps=[0, 1], checkpoint=1)
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert f"the weights in model.path {model} were rewritten since" in refusal(config(tmp_path, model))
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "metrics.jsonl").unlink()
    earlier_run(config(tmp_path, model), steps=[0, 1], checkpoint=1)
    wider = shutil.copytree(model, tmp_path / "wider")
    spec = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**spec, "hidden_size": 2 * spec["hidden_size"]}))
    message = refusal(config(tmp_path, model, f"model.path={wider}"))
    assert "model.path was" in message and "(and 1 more difference(s))" in message     # and hidden_size
    assert "model hidden_size was" in rundir.differences(rundir.identity(config(tmp_path, model)),
                                                          rundir.identity(config(tmp_path, wider)))[1]


def test_a_finished_run_is_refused_unless_told(tmp_path, model, capsys):
    cfg = config(tmp_path / "run", model, "trainer.total_steps=3")
    earlier_run(cfg, steps=[0, 1, 2, 3], checkpoint=2, finished=True)
    assert "holds a finished run (step 3 of trainer.total_steps=3); raise trainer.total_steps" in refusal(cfg)
    more = rundir.plan(config(tmp_path / "run", model, "trainer.total_steps=5"))   # continue it
    assert more.action == "resume" and more.checkpoint.name == "step_000002"
    # through the command: one line, exit 2; --overwrite and trainer.resume=never say what to do
    argv = ["train", GRPO, f"model.path={model}", f"run.dir={tmp_path / 'run'}", "trainer.total_steps=3", "--check"]
    assert main(argv) == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main([*argv, "--overwrite"]) == 0 and "--overwrite: an earlier run's outputs" in capsys.readouterr().err
    assert main([*argv, "trainer.resume=never"]) == 0
    assert f"moves to {tmp_path / 'run'}.old-1" in capsys.readouterr().err
    (tmp_path / "run" / "notes.txt").write_text("mine")
    refusal(cfg)
    assert set(rundir.remove_outputs(tmp_path / "run")) == {"run.json", "metrics.jsonl", "checkpoints"}
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]      # nothing else is touched
    assert rundir.plan(cfg).action == "fresh"


def test_a_run_without_a_checkpoint_is_refused_and_never_moves_it_aside(tmp_path, model):
    cfg = config(tmp_path / "run", model)
    earlier_run(cfg, steps=[0, 1, 2, 3, 4, 5, 6], finished=True)
    message = refusal(cfg)
    assert "holds a finished rl run (steps 0-6) without a checkpoint to resume from" in message
    never = config(tmp_path / "run", model, "trainer.resume=never")
    assert rundir.prepare(never).action == "move_aside"
    assert [r["step"] for r in read_metrics(tmp_path / "run.old-1")] == list(range(7))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json"]
    assert rundir.plan(cfg).action == "fresh"


def test_a_model_inside_the_run_directory_is_never_moved_or_removed(tmp_path, model, capsys):
    inside = shutil.copytree(model, tmp_path / "run" / "base")        # a base model kept in the run directory
    cfg = config(tmp_path / "run", inside, recipe=SFT)
    earlier_run(cfg, steps=[10, 20], finished=True)
    never = config(tmp_path / "run", inside, "trainer.resume=never", recipe=SFT)
    assert f"model.path {inside} is inside {tmp_path / 'run'}, and trainer.resume=never moves" in refusal(never)
    hf = shutil.copytree(model, tmp_path / "run" / "hf")               # SFT again on its own output
    argv = ["sft", SFT, f"model.path={hf}", f"run.dir={tmp_path / 'run'}", "--overwrite", "--check"]
    assert main(argv) == 2 and "and --overwrite removes it: keep the model outside run.dir" in capsys.readouterr().err


def test_a_finished_sft_run_is_refused(tmp_path, model):
    cfg = config(tmp_path, model, recipe=SFT)
    earlier_run(cfg, steps=[10, 20], finished=True)
    assert "holds a finished sft run (steps 10-20); pass --overwrite" in refusal(cfg)


def test_metrics_never_hold_two_rows_for_one_step(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(0, {"a": 1.0})
    logger.log(1, {"a": 2.0})
    with pytest.raises(ValueError, match="step 1 logged after step 1"):
        logger.log(1, {"a": 3.0})
    with pytest.raises(FileExistsError, match="already holds steps 0-1"):
        MetricsLogger(tmp_path, tensorboard=False)
    MetricsLogger(tmp_path, tensorboard=False, resume_from_step=0).log(1, {"a": 4.0})
    assert [(r["step"], r["a"]) for r in read_metrics(tmp_path)] == [(0, 1.0), (1, 4.0)]
