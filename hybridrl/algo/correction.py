"""Truncated importance sampling for the rollout/trainer mismatch (Yao et al., 2025).

The rollout engine samples with its own numerics (kernels, precision, parallel layout), so its
behaviour logprobs differ from the trainer's recomputed old logprobs. The policy-gradient term
is reweighted per token by the ratio of the two, truncated at `cap` (and detached):

    w_t = min(exp(old_logp_t - behaviour_logp_t), cap)
"""

from __future__ import annotations

import torch


def tis_weights(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    if cap <= 0:
        raise ValueError(f"truncated importance sampling cap must be > 0, got {cap}")
    return torch.exp(old_logprobs - behavior_logprobs).clamp(max=cap).detach()


def mismatch_metrics(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's logprobs are from the trainer's on the policy tokens."""
    m = mask.bool()
    if not m.any():
        return {"mismatch/max_abs": 0.0, "mismatch/mean_abs": 0.0, "mismatch/k3": 0.0}
    log_r = (old_logprobs - behavior_logprobs)[m]   # samples come from the behaviour policy
    return {"mismatch/max_abs": float(log_r.abs().max()), "mismatch/mean_abs": float(log_r.abs().mean()),
            "mismatch/k3": float((torch.exp(log_r) - 1 - log_r).mean())}


def mismatch_sums(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The pieces of `mismatch_metrics` that add up over ranks: 'sums' [3] float64 (tokens, sum of
    |log r|, sum of k3) and 'max_abs' (a 0-d float64 tensor; -inf on no token), on the inputs' device."""
    m = mask > 0
    log_r = torch.where(m, old_logprobs - behavior_logprobs, torch.zeros_like(old_logprobs)).double()
    k3 = torch.where(m, torch.exp(log_r) - 1 - log_r, torch.zeros_like(log_r))
    sums = torch.stack([m.sum().double(), log_r.abs().sum(), k3.sum()])
    max_abs = log_r.abs().max() if m.any() else torch.tensor(0.0, dtype=torch.float64, device=log_r.device)
    return {"sums": sums, "max_abs": max_abs}
