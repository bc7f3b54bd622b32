"""What a new user runs into before a run starts, replayed with the real `hybridrl` command:
warnings the preflight prints (more CPU ranks than CPUs, GRPO with groups of one), a run directory
given as the model, an unsupported model for `train` and `score` (one line before any rank starts),
an override without `=`, `config show --diff / --section`, and the recipes that ship with the
package (`hybridrl init recipe`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from hybridrl.preflight import usable_cpus
from tests.launch import ROOT, env_with_repo

GRPO = str(ROOT / "recipes" / "calc_grpo_cpu.yaml")


def hybridrl(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", *map(str, args)], cwd=cwd, env=env_with_repo(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2")


def test_preflight_warns_about_more_cpu_ranks_than_cpus_and_refuses_groups_of_one(model, tmp_path):
    ranks = usable_cpus() + 2
    out = hybridrl("train", GRPO, "--check", f"model.path={model}", f"run.dir={tmp_path / 'run'}",
                   f"distributed.nproc_per_node={ranks}")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("hybridrl: warning:")]
    assert len(warnings) == 1, out.stderr
    assert f"{ranks} CPU ranks on {usable_cpus()} CPU(s)" in warnings[0]
    assert f"distributed.nproc_per_node={usable_cpus()}" in warnings[0]
    # a group baseline with groups of one trains nothing: refused before launch (hybridrl/algo/explain.py)
    one = hybridrl("train", GRPO, "--check", f"model.path={model}", f"run.dir={tmp_path / 'run'}",
                   "trainer.group_size=1")
    assert one.returncode == 2 and "trainer.group_size" in one.stderr and "every advantage is 0" in one.stderr
    quiet = hybridrl("train", GRPO, "--check", f"model.path={model}", f"run.dir={tmp_path / 'run'}",
                     "distributed.nproc_per_node=1")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_a_run_directory_as_model_path_names_its_hf_directory(model, tmp_path):
    run = tmp_path / "runs" / "feet" / "sft"          # what a finished SFT run leaves
    shutil.copytree(model, run / "hf")
    (run / "run.json").write_text(json.dumps({"job": "sft", "status": "finished"}))
    (run / "config.json").write_text(json.dumps({"run": {"job": "sft"}}))
    out = hybridrl("train", GRPO, "--check", f"model.path={run}", f"run.dir={tmp_path / 'grpo'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"hybridrl: model.path={run}: that is a run directory, not a model: did you mean model.path={run / 'hf'} "
        "(the HF model a finished run exports)?"]


@pytest.fixture()
def unsupported(model, tmp_path):
    d = tmp_path / "gpt2"
    shutil.copytree(model, d)
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_train_and_score_refuse_an_unsupported_model_in_one_line(unsupported, tmp_path):
    train = hybridrl("train", GRPO, "--check", f"model.path={unsupported}", f"run.dir={tmp_path / 'run'}")
    assert train.returncode == 2
    assert len(train.stderr.strip().splitlines()) == 1 and "unsupported model" in train.stderr
    assert "GPT2LMHeadModel" in train.stderr and "Qwen2ForCausalLM" in train.stderr
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text('{"id": 1, "token_ids": [1, 2, 3]}\n')
    score = hybridrl("score", "--model", unsupported, "--input", seqs, "--output", tmp_path / "out.jsonl")
    assert score.returncode == 2
    assert score.stderr.strip().splitlines() == [train.stderr.strip().replace(
        f"hybridrl: model.path={unsupported}", f"hybridrl score: --model={unsupported}")]
    assert "Traceback" not in score.stderr and "torch.distributed" not in score.stderr


@pytest.mark.parametrize("argv, message", [
    (["train", GRPO, "--check", "trainer.total_steps", "5"],
     "'trainer.total_steps' is not a section.key=value override: write trainer.total_steps=5"),
    (["train", GRPO, "trainer.total_steps", "5", "--check"],
     "'trainer.total_steps' is neither the recipe (it comes first) nor a section.key=value override: "
     "write trainer.total_steps=5"),
    (["train", GRPO, "--overwrite", "trainer.total_steps"],
     "'trainer.total_steps' is not a section.key=value override: write trainer.total_steps=VALUE"),
    (["config", "show", GRPO, "steps"],
     "'steps' is neither the recipe (it comes first) nor a section.key=value override (overrides are "
     "section.key=value, e.g. trainer.total_steps=5)"),
])
def test_an_override_without_equals_is_one_line_naming_it(argv, message):
    out = hybridrl(*argv)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(message), out.stderr
    assert "usage:" not in out.stderr


def test_config_show_diff_and_section():
    diff = hybridrl("config", "show", GRPO, "--diff", "trainer.total_steps=7")
    assert diff.returncode == 0, diff.stderr
    assert "  total_steps: 7   # default: 20\n" in diff.stdout
    assert "  group_size" not in diff.stdout            # 8 in the recipe and in the defaults
    assert "  norm_adv_by_std: false   # default: true\n" in diff.stdout
    parsed = yaml.safe_load(diff.stdout)                 # still YAML: a recipe of the differences
    assert parsed["trainer"] == {"total_steps": 7, "keep_checkpoints": 1} and parsed["model"] == {"path": "runs/demo/sft/hf"}
    full = hybridrl("config", "show", GRPO)
    assert len(diff.stdout.splitlines()) < len(full.stdout.splitlines()) / 4
    section = hybridrl("config", "show", GRPO, "--section", "agent.temperature", "--section", "trainer")
    assert yaml.safe_load(section.stdout) == {"agent": {"temperature": 1.0},
                                              "trainer": yaml.safe_load(full.stdout)["trainer"]}
    both = hybridrl("config", "show", GRPO, "--diff", "--section", "algo")
    assert yaml.safe_load(both.stdout) == {"algo": {"norm_adv_by_std": False}}
    wrong = hybridrl("config", "show", GRPO, "--section", "trainer.group_sise")
    assert wrong.returncode == 2 and "trainer has no 'group_sise'" in wrong.stderr and "group_size" in wrong.stderr
    same = hybridrl("config", "show", "--diff")
    assert same.stdout == "# the same as the defaults\n"


def test_a_copied_recipe_names_an_input_path_found_neither_here_nor_beside_the_shipped_recipes(tmp_path):
    """Whether or not this checkout ran the demo: a path found under neither the working directory nor the
    shipped recipes' base is left as it is, with a note that says how to make it."""
    from hybridrl.shipped import portable

    (tmp_path / "here").mkdir()
    (tmp_path / "origin" / "data").mkdir(parents=True)
    text = "model:\n  path: runs/demo/sft/hf\ntask:\n  data_dir: data\n"
    out, notes = portable(text, tmp_path / "here", tmp_path / "origin", "x", Path("x.yaml"))
    assert notes == ["model.path: runs/demo/sft/hf does not exist here yet (a path relative to where you run "
                     "hybridrl): make it (the recipe's comments say how) or pass model.path=PATH"]
    assert yaml.safe_load(out) == {"model": {"path": "runs/demo/sft/hf"},
                                   "task": {"data_dir": str((tmp_path / "origin" / "data").resolve())}}


def test_init_recipe_copies_a_shipped_recipe_that_loads(tmp_path):
    listed = hybridrl("init", "recipe", "--list", cwd=tmp_path)
    assert "calc_grpo_cpu" in listed.stdout.split() and "calc_sft_cpu" in listed.stdout.split()
    bare = hybridrl("init", "recipe", "calc_grpo_cpu", cwd=tmp_path)      # no demo here: the copy says so
    if (ROOT / "runs" / "demo" / "sft" / "hf").is_dir():      # a checkout where `make demo` ran: found there
        assert bare.returncode == 0 and "note" not in bare.stderr, bare.stderr
        assert yaml.safe_load((tmp_path / "calc_grpo_cpu.yaml").read_text())["model"]["path"] == \
            str((ROOT / "runs" / "demo" / "sft" / "hf").resolve())
    else:
        assert bare.returncode == 0 and "model.path: runs/demo/sft/hf does not exist here yet" in bare.stderr
    (tmp_path / "runs" / "demo" / "sft" / "hf").mkdir(parents=True)          # as `hybridrl demo` leaves it
    made = hybridrl("init", "recipe", "calc_grpo_cpu", "--force", cwd=tmp_path)
    assert made.returncode == 0 and "note" not in made.stderr, made.stderr
    copied = yaml.safe_load((tmp_path / "calc_grpo_cpu.yaml").read_text())
    shipped = yaml.safe_load((ROOT / "recipes" / "calc_grpo_cpu.yaml").read_text())
    # the input path is absolute (the recipe works from any directory), the output run.dir stays where it runs
    assert copied["model"]["path"] == str(tmp_path.resolve() / "runs" / "demo" / "sft" / "hf")
    assert copied["run"]["dir"] == "runs/demo/grpo" and {**copied, "model": shipped["model"]} == shipped
    assert "#   hybridrl train calc_grpo_cpu.yaml" in (tmp_path / "calc_grpo_cpu.yaml").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = hybridrl("config", "show", "../calc_grpo_cpu.yaml", "--section", "run.job", "--section", "model.path",
                     cwd=elsewhere)
    assert shown.returncode == 0 and yaml.safe_load(shown.stdout) == {"run": {"job": "rl"},
                                                                      "model": {"path": copied["model"]["path"]}}
    again = hybridrl("init", "recipe", "calc_grpo_cpu", cwd=tmp_path)
    assert again.returncode == 2 and "exists (--force replaces it)" in again.stderr
    typo = hybridrl("init", "recipe", "calc_grpo", cwd=tmp_path)
    assert typo.returncode == 2 and "did you mean calc_grpo_cpu?" in typo.stderr


def test_a_copied_recipe_finds_its_inputs_in_the_checkout_it_came_from(tmp_path):
    """A path that is not under the working directory but under the checkout the recipe came from (where the
    demo ran) is written as that absolute path; one in neither place is left and named."""
    from hybridrl.shipped import portable

    here, checkout = tmp_path / "here", tmp_path / "checkout"
    (checkout / "runs" / "demo" / "sft" / "hf").mkdir(parents=True)
    here.mkdir()
    text = ("# see recipes/x.yaml and recipes/y.yaml\nrun:\n  dir: runs/demo/sft\nmodel:\n  path: runs/demo/sft/hf   # warm\n"
            "task:\n  options:\n    train_path: data/train.jsonl\n")
    out, notes = portable(text, here, checkout, "x", Path("x.yaml"))
    assert out.splitlines()[0] == "# see x.yaml and y.yaml (hybridrl init recipe y)"
    assert f"  path: {checkout.resolve()}/runs/demo/sft/hf   # warm" in out and "  dir: runs/demo/sft\n" in out
    assert "train_path: data/train.jsonl" in out and len(notes) == 1 and notes[0].startswith("task.options.train_path")


def test_export_peft_refuses_a_run_without_adapters_in_one_line(tmp_path, capsys):
    """Checked before torchrun starts: a full fine-tune has no adapters; a LoRA run without checkpoints is
    pointed at the adapters its end wrote (hf_peft/)."""
    from hybridrl.cli import main

    full, lora = tmp_path / "full", tmp_path / "lora"
    for run, rank in ((full, 0), (lora, 4)):
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"train": {"lora": {"rank": rank}}}))
    assert main(["export", str(full), "--peft", "--out", str(tmp_path / "a")]) == 2
    assert "trained the full model (train.lora.rank is 0)" in capsys.readouterr().err
    assert main(["export", str(lora), "--peft", "--out", str(tmp_path / "a")]) == 2
    assert f"the final policy is {lora / 'hf_peft'}" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_a_wheel_carries_the_recipes(tmp_path):
    """What a pip-installed user gets: the shipped recipes inside the package."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("hybridrl-*.whl"))).namelist()
    for recipe in (ROOT / "recipes").glob("*.yaml"):
        assert f"hybridrl/recipes/{recipe.name}" in names
