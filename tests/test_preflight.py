"""Everything a run needs is checked before any process starts: each problem is one line and
exit code 2 from `hybridrl train` (in process: it returns before it would start torchrun), and
from every rank of a torchrun / srun launch before it joins the process group."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from hybridrl.cli import main
from tests.launch import ROOT, env_with_repo

GRPO = str(ROOT / "recipes" / "calc_grpo_cpu.yaml")
SFT = str(ROOT / "recipes" / "calc_sft_cpu.yaml")

# A task written from an old README: the instances name no tools, the demonstrations call one.
NO_TOOLS = '''
from dataclasses import dataclass
from hybridrl.envs.tasks import Task, TaskInstance, register_task, unique_instances
from hybridrl.reward import RewardResult


@dataclass(kw_only=True)
class Opts:
    max_feet: int = 99


@register_task
class {cls}(Task):
    name, Options, action_formats = "{name}", Opts, ("calc",)

    def make_instances(self, n, rng, split):
        def one(r):
            f = r.randint(1, self.options.max_feet)
            return TaskInstance(task=self.name, task_id=f"{{split}}-{{f}}", reference=str(12 * f),
                                messages=({{"role": "user", "content": f"{{f}} ft?"}},){tools})
        return unique_instances(one, n, rng)

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        return [*instance.messages, {{"role": "assistant", "content": "<calc>1</calc>"}},
                {{"role": "tool", "content": "1"}}, {{"role": "assistant", "content": "<answer>1</answer>"}}]

    def score(self, instance, outcome):
        return RewardResult().add("correct", float(outcome.answer == instance.reference), "feet@1")
'''


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


def check(capsys, *argv: str) -> tuple[int, str]:
    code = main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert "launching" not in err
    return code, err


def refused(capsys, *argv: str) -> str:
    code, err = check(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_model_path_config_weights_and_tokenizer(tmp_path, capsys, model):
    run = f"run.dir={tmp_path / 'run'}"
    assert "model.path=/no/such/dir: no such directory" in refused(capsys, GRPO, "model.path=/no/such/dir", run)
    partial = tmp_path / "partial"
    partial.mkdir()
    assert "no config.json there" in refused(capsys, GRPO, f"model.path={partial}", run)
    shutil.copy(model / "config.json", partial)
    assert "no weights: model.safetensors" in refused(capsys, GRPO, f"model.path={partial}", run)
    shutil.copy(model / "model.safetensors", partial)
    assert "no tokenizer files" in refused(capsys, GRPO, f"model.path={partial}", run)
    code, err = check(capsys, GRPO, f"model.path={model}", run, "--check")
    assert code == 0 and "are ready (2 rank(s) per node)" in err


def test_a_task_of_your_own_is_imported_and_checked_before_anything_starts(tmp_path, capsys, monkeypatch, model):
    monkeypatch.chdir(tmp_path)                    # the working directory is importable, as for `python -m`
    common = [GRPO, f"model.path={model}", f"run.dir={tmp_path / 'run'}"]
    err = refused(capsys, *common, "task.name=pf_missing:FeetTask")
    assert "no module 'pf_missing' in the working directory" in err and "PYTHONPATH" in err
    (tmp_path / "pf_broken.py").write_text("x = (\n")
    err = refused(capsys, *common, "task.name=pf_broken:FeetTask")
    assert "importing 'pf_broken' for task 'pf_broken:FeetTask' failed: SyntaxError" in err and "pf_broken.py:1" in err
    (tmp_path / "pf_notools.py").write_text(NO_TOOLS.format(cls="NoToolsTask", name="pf_notools", tools=""))
    (tmp_path / "pf_tools.py").write_text(NO_TOOLS.format(cls="ToolsTask", name="pf_tools",
                                                          tools=', tools=("calculator",)'))
    assert "has no 'Nope'; the Task classes it defines: ['NoToolsTask']" in refused(
        capsys, *common, "task.name=pf_notools:Nope")
    assert "key 'task.options.max_feet': expected int, got 'lots'" in refused(
        capsys, *common, "task.name=pf_tools:ToolsTask", "task.options.max_feet=lots")
    assert "key 'task.options.max_fet': unknown option of task 'pf_tools'; did you mean 'max_feet'?" in refused(
        capsys, *common, "task.name=pf_tools:ToolsTask", "task.options.max_fet=3")
    err = refused(capsys, *common, "task.name=pf_notools:NoToolsTask")
    assert "demonstrations call a tool but its instances allow none" in err and 'tools=("calculator",)' in err
    err = refused(capsys, *common, "task.name=pf_tools:ToolsTask", "task.train_size=500")   # 99 questions in all
    assert "cannot draw the train split (task.train_size=500)" in err and "could not draw 500" in err
    code, err = check(capsys, *common, "task.name=pf_tools:ToolsTask", "task.train_size=40",
                      "task.validation_size=8", "--check")
    assert code == 0, err


def test_builtin_task_errors_and_data_files(tmp_path, capsys, model):
    common = [f"model.path={model}", f"run.dir={tmp_path / 'run'}"]
    err = refused(capsys, GRPO, *common, "task.options.min_digits=three")
    assert err == "hybridrl: config error in the command line: key 'task.options.min_digits': expected int, " \
                  "got 'three' (str)"
    assert "did you mean 'calculator'?" in refused(capsys, GRPO, *common, "task.name=calculater")
    assert "'module:Class'" in refused(capsys, GRPO, *common, "task.name=mytask")
    err = refused(capsys, SFT, *common, "task.name=gsm8k", f"task.options.train_path={tmp_path / 'nope.jsonl'}")
    assert "task.options.train_path: no such file" in err


def test_one_recipe_convention(tmp_path, capsys, model):
    common = [f"model.path={model}", f"run.dir={tmp_path / 'run'}", "--check"]
    assert check(capsys, "--config", GRPO, *common)[0] == 0
    assert check(capsys, GRPO, *common)[0] == 0
    assert "two recipes" in refused(capsys, GRPO, "--config", SFT, *common)
    assert main(["sft", *common[:2], "--config", SFT, "--check"]) == 0          # options before the recipe
    assert main(["agent", "tasks", str(ROOT / "recipes" / "calculator.yaml"), "-n", "1"]) == 0
    assert main(["config", "show", GRPO, "run.seed=3"]) == 0
    assert "seed: 3" in capsys.readouterr().out


def test_a_rank_checks_before_it_joins_the_process_group(tmp_path):
    """torchrun / srun start `python -m hybridrl.train` directly: it stops the same way."""
    proc = subprocess.run([sys.executable, "-m", "hybridrl.train", "--config", GRPO, "model.path=/no/such/dir",
                           f"run.dir={tmp_path}"], cwd=ROOT, env=env_with_repo(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hybridrl: model.path=/no/such/dir: no such directory (an HF model directory: config.json, *.safetensors, "
        "tokenizer files; `hybridrl assets tiny-model --out DIR` makes a small one)"]


def test_share_prefix_is_refused_for_a_mixture_of_experts_model(tmp_path, capsys, tiny_models):
    """The GRPO recipe shares prompts in its packs; a mixture-of-experts model's routing record and
    load-balancing loss are per row token, so the run stops before starting, naming the knob."""
    moe = tiny_models("qwen3_moe", experts=4, experts_per_tok=2, init_std=0.05)
    capsys.readouterr()                                         # the build's progress output
    err = refused(capsys, GRPO, f"model.path={moe}", f"run.dir={tmp_path / 'run'}")
    assert "train.share_prefix=true" in err and "mixture-of-experts" in err and "share_prefix=false" in err
    code, err = check(capsys, GRPO, f"model.path={moe}", f"run.dir={tmp_path / 'run'}", "train.share_prefix=false",
                      "--check")
    assert code == 0, err
