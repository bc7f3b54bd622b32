"""On-policy distillation with real ranks: the advantages `TrainSide.update_policy` trains on, with a teacher
of another shape over two data-parallel ranks, equal a computation from the two models' own logprobs
(transformers, at the rollout temperature) and GRPO's advantage written out here."""

from __future__ import annotations

import json

import pytest
import torch

from tests.controller.test_rl_e2e import hybridrl_train
from tests.workers.test_hybrid import RECIPE

TEMPERATURE, REWARD_WEIGHT, KL_COEF = 0.7, 0.5, 2.0


def _logprobs(hf, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """logprobs[b, t] = log softmax(logits[b, t-1] / T)[ids[b, t]], 0 at t = 0 (the engines' alignment)."""
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=attention).logits.float() / TEMPERATURE
    picked = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), picked], dim=1)


def _grpo(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + 1e-6) over each group (unbiased std), per row."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for g in groups.unique():
        member = groups == g
        r = rewards[member].double()
        std = r.std() if len(r) > 1 else torch.tensor(0.0, dtype=torch.float64)
        out[member] = (r - r.mean()) / (std + 1e-6) if std > 0 else 0.0
    return out


@pytest.mark.slow              # a distillation job with a teacher on real ranks: ~9 s
def test_distillation_advantage_equals_an_independent_computation_from_both_models(tmp_path, tiny_models, hf_model):
    student, teacher = tiny_models("qwen2", init_std=0.1), tiny_models("qwen2", init_std=0.1, layers=3)
    proc = hybridrl_train(RECIPE, "run.job=tests.workers.distill_jobs:DISTILL", f"model.path={student}",
                          f"run.dir={tmp_path}", f"distill.teacher={teacher}", f"agent.temperature={TEMPERATURE}",
                          f"distill.reward_weight={REWARD_WEIGHT}", f"distill.kl_coef={KL_COEF}",
                          "publish.parity_prompts=0", "train.micro_batch_size=3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    ids, attention = torch.tensor(r["input_ids"]), torch.tensor(r["attention_mask"])
    mask = torch.tensor(r["loss_mask"])
    pi, q = _logprobs(hf_model(student), ids, attention) * mask, _logprobs(hf_model(teacher), ids, attention) * mask
    # both engines' logprobs are the models' own (the teacher scores the student's tokens at its temperature)
    assert torch.allclose(torch.tensor(r["old_logprobs"]) * mask, pi, atol=1e-4)
    assert torch.allclose(torch.tensor(r["teacher_logprobs"]) * mask, q, atol=1e-4)
    d = (pi - q).clamp(-10, 10)
    task = _grpo(torch.tensor(r["reward"]), torch.tensor(r["group_index"])).float()[:, None]
    expected = (REWARD_WEIGHT * task - KL_COEF * d) * mask
    got = torch.tensor(r["advantages"])
    assert torch.allclose(got, expected, atol=2e-4), float((got - expected).abs().max())
    assert float(d.abs().max()) > 0.05 and float(task.abs().max()) > 0.5     # both terms matter here
    m = r["metrics"]
    assert m["distill/reverse_kl"] == pytest.approx(float((pi - q)[mask > 0].mean()), abs=1e-4)
    assert m["passes/teacher_logprobs"] == 1 and m["passes/old_logprobs"] == 1 and m["passes/train"] == 1
