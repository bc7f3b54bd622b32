"""On-policy distillation's estimator and its refusals (`hybridrl/algo/distill.py`): the per-token advantage
against a computation written out here, the summed reverse KL, and a teacher with another tokenizer refused
in one line by `hybridrl train` before anything starts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridrl.algo import distill
from hybridrl.algo.distill import DistillConfig
from hybridrl.cli import main
from hybridrl.config.fields import ConfigValueError
from tests.launch import ROOT

RECIPE = str(ROOT / "recipes" / "calc_distill_cpu.yaml")


def _batch(n: int = 5, t: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = -torch.rand(n, t, generator=g) * 4
    teacher = -torch.rand(n, t, generator=g) * 4
    teacher[0, 3] = -40.0                                  # a token the teacher all but excludes: clamped at 10 nats
    mask = (torch.rand(n, t, generator=g) > 0.3).float()
    mask[0, 3] = 1.0
    task = torch.randn(n, 1, generator=g).expand(n, t) * mask
    return student, teacher, mask, task


@pytest.mark.parametrize("reward_weight,kl_coef", [(0.0, 1.0), (1.0, 0.5), (0.3, 2.0)])
def test_token_advantage_is_the_weighted_task_advantage_minus_the_reverse_kl(reward_weight, kl_coef):
    student, teacher, mask, task = _batch()
    cfg = DistillConfig(teacher="t", kl_coef=kl_coef, reward_weight=reward_weight)
    got = distill.token_advantages(cfg, task, student, teacher, mask)
    expected = torch.zeros_like(task)
    for i in range(task.shape[0]):
        for j in range(task.shape[1]):
            if mask[i, j]:
                d = max(-10.0, min(10.0, float(student[i, j]) - float(teacher[i, j])))
                expected[i, j] = reward_weight * float(task[i, j]) - kl_coef * d
    assert torch.allclose(got, expected, atol=1e-6)
    assert got[0, 3] == pytest.approx(reward_weight * float(task[0, 3]) - kl_coef * 10.0, abs=1e-5)
    assert (got[mask == 0] == 0).all()


def test_reverse_kl_metric_is_the_unclamped_mean_over_policy_tokens_of_every_rank():
    student, teacher, mask, _ = _batch()
    halves = [distill.reverse_kl_sums(student[a:b], teacher[a:b], mask[a:b]) for a, b in ((0, 2), (2, 5))]
    got = distill.metrics(halves[0] + halves[1])             # what dp_sum gives two data-parallel ranks
    on = mask > 0
    d = (student - teacher)[on].double()
    assert got[distill.METRIC] == pytest.approx(float(d.mean()), rel=1e-9)
    assert got["distill/abs_log_ratio"] == pytest.approx(float(d.abs().mean()), rel=1e-9)
    assert float(d.max()) > 10                               # the metric is not clamped


def test_a_teacher_that_trains_nothing_is_refused():
    with pytest.raises(ConfigValueError, match="kl_coef"):
        DistillConfig(teacher="some/dir", kl_coef=0.0)
    assert not DistillConfig().enabled and DistillConfig(kl_coef=0.0).kl_coef == 0.0


def test_tokenizers_compared_by_their_ids(tmp_path, tiny_models):
    student = tiny_models("qwen2", init_std=0.05)
    assert distill.tokenizer_difference(student, student) is None
    other = tiny_models("qwen2", init_std=0.05, seed=1)     # another corpus sample: another BPE vocabulary
    assert distill.tokenizer_difference(student, other) is not None
    renamed = tmp_path / "renamed"
    shutil.copytree(student, renamed)
    tok = json.loads((renamed / "tokenizer.json").read_text())
    tok["added_tokens"][-1]["content"] = "<other>"
    (renamed / "tokenizer.json").write_text(json.dumps(tok))
    assert "is '<other>' in one and" in distill.tokenizer_difference(renamed, student)


def test_hybridrl_train_refuses_a_teacher_with_another_tokenizer_in_one_line(tmp_path, capsys, tiny_models):
    student = tiny_models("qwen2", init_std=0.05)
    other = tiny_models("qwen2", init_std=0.05, seed=1)
    common = [RECIPE, f"model.path={student}", f"run.dir={tmp_path / 'run'}"]
    code = main(["train", *common, f"distill.teacher={other}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "launching" not in err
    assert f"distill.teacher={other}" in err and f"model.path={student}" in err and "do not share a tokenizer" in err
    code = main(["train", *common, f"distill.teacher={tmp_path / 'nope'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"distill.teacher={tmp_path / 'nope'}: no such directory" in err
    deeper = tiny_models("qwen2", init_std=0.05, layers=3)    # another shape, the same tokenizer: accepted
    code = main(["train", *common, f"distill.teacher={deeper}", "--check"])
    err = capsys.readouterr().err
    assert code == 0, err
