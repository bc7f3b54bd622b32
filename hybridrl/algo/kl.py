"""The KL penalty to the reference policy, and which divergence each option's gradient optimises
(Schulman, "Approximating KL divergence", 2020; Zhang et al., "On the Design of KL-Regularized
Policy Gradient Algorithms for LLM Reasoning", 2025).

Per sampled token y, with log_r = log pi_ref(y) - log pi(y):

    k1 = -log_r                     value: unbiased for KL(pi || ref) under y ~ pi, can be negative
    k2 = log_r**2 / 2               value: biased, low variance, >= 0
    k3 = exp(log_r) - 1 - log_r     value: unbiased for KL(pi || ref) under y ~ pi, >= 0

What trains is the *gradient*, and it depends on where the term goes (`GRADIENTS`; exact on a
categorical policy in tests/algo/test_kl_gradients.py):

  algo.kl_in=loss    autograd differentiates coef * k at the sampled tokens:
      k1  E[grad k1] = E_pi[grad log pi] = 0: no regularisation, only noise (refused)
      k2  E[grad k2] = E_pi[(log pi - log ref) grad log pi] = grad KL(pi || ref)  (default)
      k3  E[grad k3] = E_pi[(1 - ref/pi) grad log pi] = grad KL(ref || pi): the reverse direction
  algo.kl_in=reward  -coef * k is a per-token reward (no gradient through it); the policy
                     gradient gives E_pi[k grad log pi]:
      k1  grad KL(pi || ref), the classic RLHF penalty (default)
      k2  the score-function part of grad E[k2] only: not a KL's gradient, ~0 near the reference
      k3  grad KL(pi || ref) - grad KL(ref || pi): ~0 near the reference

The samples come from the behaviour policy mu (the rollout engine, possibly some versions old),
not from pi: in the loss, each token's KL term is weighted by sg(pi / mu) = sg(ratio to the
proximal policy) x the behaviour weight of `algo/correction.py`, so that E_mu[weight grad k] is
the gradient above (exact when that weight is not truncated or masked).

The log-ratio is clamped to +-10 nats, straight through: the value uses the clamped log_r, the
gradient passes as if the clamp were the identity (d clamp / d log_r = 1). So where the policy has
drifted furthest from the reference, k2's gradient is 10 x grad log pi (bounded), never 0 (a plain
clamp would zero it exactly there); within +-10 nothing changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ESTIMATORS = ("k1", "k2", "k3")
OPTIONS = ("auto", *ESTIMATORS)
DEFAULT = {"loss": "k2", "reward": "k1"}     # algo.kl_estimator=auto: the option whose gradient is grad KL(pi || ref)
FORWARD = {(kl_in, estimator) for kl_in, estimator in DEFAULT.items()}   # the (placement, option) pairs that give it
CLAMP_NATS = 10.0                            # |log(pi / ref)| beyond this saturates in value, straight through

GRADIENTS = {
    ("loss", "k1"): "zero in expectation (E_pi[grad log pi] = 0): adds noise, no regularisation",
    ("loss", "k2"): "grad KL(pi || ref)",
    ("loss", "k3"): "grad KL(ref || pi): the reverse (mass-covering) direction",
    ("reward", "k1"): "grad KL(pi || ref) (through the policy gradient)",
    ("reward", "k2"): "not a KL's gradient (the score-function part of grad E[k2] only); ~0 near the reference",
    ("reward", "k3"): "grad KL(pi || ref) - grad KL(ref || pi); ~0 near the reference",
}


def resolve(estimator: str, kl_in: str) -> str:
    """The estimator `algo.kl_estimator` names where the penalty goes (`auto` -> DEFAULT)."""
    return DEFAULT[kl_in] if estimator == "auto" else estimator


def kl(logprobs: "torch.Tensor", ref_logprobs: "torch.Tensor", estimator: str = "k2",
       clamp: float | None = CLAMP_NATS) -> "torch.Tensor":
    """The estimator's per-token value [N, T] (log_r clamped to +-clamp, straight through: the clamp
    bounds the value and leaves the gradient of log_r, see the module doc)."""
    import torch

    log_r = ref_logprobs - logprobs
    if clamp is not None:
        log_r = log_r + (log_r.clamp(-clamp, clamp) - log_r).detach()
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")
