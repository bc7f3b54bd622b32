"""On-policy distillation: a frozen teacher model scores the student's own samples, token by token
(Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
2024; Gu et al., "MiniLLM", 2024).

For each policy token y_t the student sampled, with log-probs at the rollout temperature of the
student before the update (pi, the trainer's old log-probs) and of the teacher (q):

    d_t = log pi(y_t | y_<t) - log q(y_t | y_<t)         an unbiased one-sample estimate of the
                                                         per-token reverse KL(pi || q) under y ~ pi
    G_t = sum_{t' >= t} discount^(k(t') - k(t)) d_t'     the teacher term's return (k: the index of a
                                                         policy token; observation tokens skipped)
    A_t = reward_weight * A_task_t - kl_coef * G_t       the token's advantage

`A_task` is the configured estimator's (`algo.advantage`) advantage of the task's reward;
`reward_weight=0` is pure distillation. What the teacher term's policy gradient is depends on
`distill.discount` (exact on a 2-token categorical in tests/algo/test_integrity_round3.py):

    discount=0 (default)  G_t = d_t: sum_t E_{y<t}[grad KL(pi(.|y<t) || q(.|y<t))] with the prefix
                          distribution held fixed: each token is pushed towards what the teacher would
                          have said at that point of the student's own trajectory (Agarwal et al.'s
                          per-token divergence; low variance). It is the gradient of the sequence
                          reverse KL for a one-token response only: it ignores that an early token
                          changes which later prefixes occur
    discount=1            G_t = the sum of d from t to the end: the policy gradient of the sequence-level
                          reverse KL(pi(y) || q(y)) (`kl.GRADIENTS[('reward', 'k1')]` with the teacher in
                          the reference's place; MiniLLM's objective), more variance

d_t is clamped to +-10 nats in the advantage as the KL penalty is (`kl.kl`); the logged mean
(`distill/reverse_kl`) is not clamped.

Teacher and student must share a tokenizer (the teacher reads the student's token ids):
`tokenizer_difference` says how two model directories' tokenizers differ, and preflight refuses a
teacher whose tokenizer is not the policy's. Import-light: torch only inside the functions.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridrl.config.fields import ConfigValueError, check_positive, check_range, knob

if TYPE_CHECKING:
    import torch

METRIC = "distill/reverse_kl"


@dataclass(kw_only=True)
class DistillConfig:
    """A teacher for on-policy distillation (off while `teacher` is empty)."""

    teacher: str = knob("", "HF directory of the teacher model; empty = no distillation. It must share the policy's "
                            "tokenizer; it runs frozen on the training ranks (train.tp / pp / dtype), beside the actor "
                            "like the reference model")
    kl_coef: float = knob(1.0, "weight of the teacher's per-token term: each policy token's advantage gets "
                               "-kl_coef * (log pi_student - log pi_teacher) of its sampled token (the negative "
                               "per-token reverse KL)")
    reward_weight: float = knob(1.0, "weight of the task reward's advantage (algo.advantage) in the sum; 0 = pure "
                                     "distillation (the reward is logged, not trained on)")
    discount: float = knob(0.0, "the teacher term's return over the later policy tokens: 0 = each token's own "
                                "reverse KL (per-token divergence, prefixes held fixed); 1 = the sum to the end "
                                "(the gradient of the sequence-level reverse KL); see hybridrl/algo/distill.py")

    def __post_init__(self) -> None:
        check_positive("kl_coef", self.kl_coef, allow_zero=True)
        check_positive("reward_weight", self.reward_weight, allow_zero=True)
        check_range("discount", self.discount, 0.0, 1.0)
        if self.teacher and self.kl_coef == 0:
            raise ConfigValueError("kl_coef", "0 with distill.teacher set: the teacher would score every step and "
                                              "train nothing; set distill.kl_coef > 0 (e.g. 1.0) or unset distill.teacher")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)


def enabled(cfg: Any) -> bool:
    """Whether a root config distils (its `distill` section names a teacher)."""
    return cfg.distill.enabled


# ---------------------------------------------------------------------------------------- the estimator

def reverse_kl(logprobs: "torch.Tensor", teacher_logprobs: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """d [N, T] = log pi - log q on each policy token, 0 elsewhere (unclamped)."""
    return (logprobs.float() - teacher_logprobs.float()) * mask


def token_advantages(cfg: DistillConfig, task_advantages: "torch.Tensor", logprobs: "torch.Tensor",
                     teacher_logprobs: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """A [N, T] = reward_weight * task_advantages - kl_coef * G, G the discounted return of clamp(d, +-10)
    over the policy tokens (`discount`), 0 off the policy tokens."""
    from hybridrl.algo import kl

    d = kl.kl(logprobs.float(), teacher_logprobs.float(), "k1") * mask   # log pi - log q, clamped
    g = discounted_returns(d, mask, cfg.discount)
    return ((cfg.reward_weight * task_advantages.float() - cfg.kl_coef * g) * mask).to(task_advantages.dtype)


def discounted_returns(rewards: "torch.Tensor", mask: "torch.Tensor", discount: float) -> "torch.Tensor":
    """[N, T]: sum over the row's policy tokens from t on of discount^(steps) x rewards, where a step is one
    policy token (observation tokens are skipped); 0 off the policy tokens."""
    import torch

    m = mask.to(rewards.dtype)
    if discount == 0.0:
        return rewards * m
    if discount == 1.0:
        return torch.flip(torch.cumsum(torch.flip(rewards * m, [-1]), -1), [-1]) * m
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        on = m[:, t] > 0
        running = torch.where(on, rewards[:, t] + discount * running, running)
        out[:, t] = running * m[:, t]
    return out


def reverse_kl_sums(logprobs: "torch.Tensor", teacher_logprobs: "torch.Tensor",
                    mask: "torch.Tensor") -> "torch.Tensor":
    """float64 [3]: (sum of d, number of policy tokens, sum of |d|), to sum over data-parallel ranks."""
    import torch

    d = reverse_kl(logprobs, teacher_logprobs, mask).double()
    return torch.stack([d.sum(), mask.double().sum(), d.abs().sum()])


def metrics(total: "torch.Tensor") -> dict[str, float]:
    """The step's scalars from the summed `reverse_kl_sums`: the mean per-token reverse KL to the teacher
    and the mean |d| (how far the two log-probs are apart, whatever the sign)."""
    n = max(float(total[1]), 1.0)
    return {METRIC: float(total[0]) / n, "distill/abs_log_ratio": float(total[2]) / n}


# ---------------------------------------------------------------------------------------- the tokenizers

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_PIPELINE = ("normalizer", "pre_tokenizer")


def _vocab(tokenizer: dict) -> dict[str, int]:
    """token -> id of a `tokenizer.json`: the model's vocabulary (a map, or Unigram's list) and the added tokens."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    out = {entry[0]: i for i, entry in enumerate(vocab)} if isinstance(vocab, list) else dict(vocab)
    out.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])})
    return out


def _json_difference(a: dict, b: dict) -> str | None:
    va, vb = _vocab(a), _vocab(b)
    if len(va) != len(vb):
        return f"vocabularies of {len(va)} and {len(vb)} tokens"
    by_id = {i: t for t, i in vb.items()}
    for token, i in sorted(va.items(), key=lambda kv: kv[1]):
        if by_id.get(i) != token:
            return f"token id {i} is {token!r} in one and {by_id.get(i)!r} in the other"
    model_a, model_b = a.get("model", {}), b.get("model", {})
    if model_a.get("type") != model_b.get("type"):
        return f"tokenizer models {model_a.get('type')} and {model_b.get('type')}"
    if model_a.get("merges") != model_b.get("merges"):
        return "the same vocabulary with different BPE merges"
    for part in _PIPELINE:
        if a.get(part) != b.get(part):
            return f"different {part.replace('_', '-')}s"
    return None


def tokenizer_difference(student: str | Path, teacher: str | Path) -> str | None:
    """How the tokenizers of two HF model directories differ (one phrase), or None when they are the same:
    the vocabulary (token ids), merges and text pipeline of `tokenizer.json`, else the bytes of the other
    tokenizer files. Padding, truncation and chat templates are not compared (they do not change ids)."""
    a, b = Path(student), Path(teacher)
    if (a / "tokenizer.json").exists() and (b / "tokenizer.json").exists():
        return _json_difference(json.loads((a / "tokenizer.json").read_text()),
                                json.loads((b / "tokenizer.json").read_text()))
    for name in _TOKENIZER_FILES:
        here, there = (a / name).exists(), (b / name).exists()
        if here != there:
            return f"{name} only in the {'student' if here else 'teacher'}'s directory"
        if here and _digest(a / name) != _digest(b / name):
            return f"different {name} files"
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_problem(student: str, teacher: str) -> str | None:
    """The one-line refusal of a teacher whose tokenizer is not the student's, or None."""
    difference = tokenizer_difference(student, teacher)
    if difference is None:
        return None
    return (f"distill.teacher={teacher} and model.path={student} do not share a tokenizer ({difference}): the "
            "teacher scores the student's token ids, so distil from a teacher with the student's tokenizer")
