"""KL(policy || reference) estimators per token (Schulman, "Approximating KL divergence", 2020).

With log_r = ref_logp - logp (samples drawn from the policy):
    k1 = -log_r                     unbiased, high variance, can be negative
    k2 = log_r**2 / 2               biased, low variance
    k3 = exp(log_r) - 1 - log_r     unbiased, low variance, always >= 0
"""

from __future__ import annotations

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
       clamp: float | None = 10.0) -> torch.Tensor:
    log_r = ref_logprobs - logprobs
    if clamp is not None:
        log_r = log_r.clamp(-clamp, clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")
