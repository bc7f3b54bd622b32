"""Generalised advantage estimation (Schulman et al., 2016, arXiv:1506.02438) over the policy
tokens of agent episodes, with a learned critic.

A row is one trajectory, token-aligned: `mask[t] = 1` on the tokens the policy chose, 0 on the
prompt, on observation (tool / environment) tokens and on padding. Only policy tokens are
decisions: observation tokens carry no reward, hold no value and are skipped by the recursion,
so the "next" state of a policy token is the next *policy* token of the row, whatever
observation lies between (as multi-turn PPO does elsewhere). Let p_1 < ... < p_K be the policy
positions of a row and r, V its token rewards and the critic's values there:

    delta_k = r(p_k) + gamma * V(p_{k+1}) - V(p_k)            V(p_{K+1}) = 0 (the episode ended)
    A(p_k)  = delta_k + gamma * lam * A(p_{k+1})              A(p_{K+1}) = 0
    R(p_k)  = A(p_k) + V(p_k)                                  (the value loss's target)

gamma and lam apply once per policy token, not per observation token. Off-policy positions of
A and R are 0. Token rewards are the outcome reward on the row's last policy token plus, when
configured, per-token rewards (e.g. -beta * KL) on every policy token (`token_rewards`). With
algo.gae_whiten the advantages are whitened over the batch's policy tokens (all ranks').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.algo.registry import AdvantageInputs, Estimator

if TYPE_CHECKING:
    import torch


def advantages(token_rewards: "torch.Tensor", values: "torch.Tensor", mask: "torch.Tensor", *,
               gamma: float = 1.0, lam: float = 0.95) -> tuple["torch.Tensor", "torch.Tensor"]:
    """token_rewards, values, mask [N, T] -> (advantages [N, T], returns [N, T]); 0 off-mask."""
    import torch

    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae needs 0 <= gamma, lam <= 1, got gamma={gamma}, lam={lam}")
    mask = mask.to(torch.float32)
    rewards = token_rewards.to(torch.float32) * mask
    values = values.to(torch.float32) * mask
    n, t = mask.shape
    adv = torch.zeros(n, t, device=mask.device)
    next_value = torch.zeros(n, device=mask.device)
    next_adv = torch.zeros(n, device=mask.device)
    for i in range(t - 1, -1, -1):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = a * m
        # an observation token (m = 0) passes the next policy token's value and advantage through
        next_value = torch.where(m > 0, values[:, i], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    return adv, (adv + values) * mask


def outcome_token_rewards(rewards: "torch.Tensor", mask: "torch.Tensor",
                          token_rewards: "torch.Tensor | None" = None) -> "torch.Tensor":
    """rewards [N] (outcome) placed on each row's last policy token, plus token_rewards [N, T] on
    the policy tokens -> [N, T]. A row without policy tokens gets nothing."""
    import torch

    mask = mask.to(torch.float32)
    out = torch.zeros_like(mask) if token_rewards is None else token_rewards.to(torch.float32) * mask
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] += rewards.to(torch.float32)[rows]
    return out


def _compute(cfg, x: AdvantageInputs):
    from hybridrl.algo.groups import whiten

    if x.values is None:
        raise ValueError("gae needs the critic's values [N, T] (AdvantageInputs.values)")
    adv, returns = advantages(outcome_token_rewards(x.rewards, x.mask, x.token_rewards), x.values, x.mask,
                              gamma=cfg.gamma, lam=cfg.lam)
    if cfg.gae_whiten:
        adv = whiten(adv, x.mask, eps=1e-8, reduce=x.reduce, single="keep")
    return adv, returns


ESTIMATOR = Estimator(
    name="gae",
    summary="GAE(gamma, lambda) over the policy tokens with a learned critic's values (trains the critic: "
            "see the critic section), whitened with algo.gae_whiten",
    compute=_compute,
    formula=lambda cfg: (f"GAE(gamma={cfg.gamma}, lambda={cfg.lam}) over the critic's values at the policy tokens"
                         + (", whitened over the batch's policy tokens" if cfg.gae_whiten else "")),
    group_baseline=lambda cfg: False,
    needs_critic=True,
)
