"""Generalised advantage estimation (Schulman et al., 2016) over the policy tokens of a sequence.

Observation tokens (mask 0) are not decisions: they are skipped, so the value of the next
decision is the value at the next *policy* token, whatever observation lies between. Needs a
critic's values per token; the critic model itself is not built yet (this is the estimator).

    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lam * A_next(t)          (V and A after the last token are 0)
"""

from __future__ import annotations

import torch


def advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
               gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """token_rewards, values, mask [N, T] -> (advantages [N, T], returns [N, T]); 0 off-mask."""
    mask = mask.to(torch.float32)
    rewards = token_rewards.to(torch.float32) * mask
    values = values.to(torch.float32) * mask
    n, t = mask.shape
    adv = torch.zeros(n, t)
    next_value = torch.zeros(n)
    next_adv = torch.zeros(n)
    for i in range(t - 1, -1, -1):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = a * m
        # carry past observation tokens unchanged
        next_value = torch.where(m > 0, values[:, i], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    return adv, (adv + values) * mask
