"""Behaviour weights: the correction for tokens sampled by a policy other than the proximal one.

The rollout engine samples with its own numerics (kernels, precision, parallel layout) and, with
partial rollouts, a disaggregated placement or a queue, with weights up to a few versions old.
Its behaviour logprobs mu then differ from the trainer's old (proximal) logprobs pi_old, and a
policy-gradient term computed as if the samples came from pi_old is biased. Per policy token,
with r = pi_old / mu = exp(old_logp - behaviour_logp):

    algo.tis_cap > 0, tis_mode=truncate   w = min(r, cap)           truncated importance sampling
                                                                     (TIS, Yao et al., 2025)
    algo.tis_cap > 0, tis_mode=mask       w = r if r <= cap else 0  AReaL's decoupled-PPO behaviour
                                                                     weight (Fu et al., 2025)
    algo.tis_cap = 0                      w = 1                      no correction
    algo.mis=token                        w = 0 where r leaves [mis_low, mis_high]
                                          (masked importance sampling at token level: IcePop's
                                          double-sided token rejection, Ling team 2025)
    algo.mis=sequence | geometric         w = 0 on every token of a row whose prod_t r_t
                                          (sequence) or its geometric mean (geometric) leaves
                                          the band (MIS at sequence level)

The weight is detached and multiplies the per-token policy loss (and, with the ratio to the
proximal policy, the KL term: `algo/kl.py`). A weight of 0 removes the token's gradient; the
token still counts in the loss's denominators (counted before the first backward), as any token
with a weight would. The fractions truncated/masked are the step's `train/tis_capped` and
`train/mis_masked` metrics.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MIS_LEVELS = ("off", "token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")


def tis_weights(old_logprobs: "torch.Tensor", behavior_logprobs: "torch.Tensor", cap: float) -> "torch.Tensor":
    """min(exp(old - behaviour), cap), detached (TIS)."""
    import torch

    if cap <= 0:
        raise ValueError(f"truncated importance sampling cap must be > 0, got {cap}")
    return torch.exp(old_logprobs - behavior_logprobs).clamp(max=cap).detach()


def behavior_weights(cfg: Any, old_logprobs: "torch.Tensor", behavior_logprobs: "torch.Tensor",
                     mask: "torch.Tensor | None" = None) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
    """The behaviour weight [N, T] (detached) per `cfg` (an AlgoConfig) and its per-token metrics.
    `mask` [N, T] (the loss mask) is needed by the sequence-level levels only."""
    import torch

    log_r = (old_logprobs - behavior_logprobs).detach()
    ratio = torch.exp(log_r)
    metrics: dict[str, torch.Tensor] = {}
    if cfg.tis_cap > 0:
        over = ratio > cfg.tis_cap
        weight = ratio.clamp(max=cfg.tis_cap) if cfg.tis_mode == "truncate" else torch.where(over, 0.0, ratio)
        metrics["tis_capped"] = over.float()
    else:
        weight = torch.ones_like(ratio)
    if cfg.mis != "off":
        keep = _mis_keep(cfg, log_r, mask)
        weight = weight * keep
        metrics["mis_masked"] = (~keep).float()
    metrics["tis_weight"] = weight
    return weight, metrics


def _mis_keep(cfg: Any, log_r: "torch.Tensor", mask: "torch.Tensor | None") -> "torch.Tensor":
    import torch

    low = math.log(cfg.mis_low) if cfg.mis_low > 0 else -math.inf
    high = math.log(cfg.mis_high)
    if cfg.mis == "token":
        return (log_r >= low) & (log_r <= high)
    if mask is None:
        raise ValueError(f"algo.mis={cfg.mis} needs the loss mask [N, T] (whole rows in each micro-batch)")
    m = (mask > 0).to(log_r.dtype)
    row = (log_r * m).sum(dim=-1, keepdim=True)                              # log prod_t r_t
    if cfg.mis == "geometric":
        row = row / m.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return ((row >= low) & (row <= high)).expand_as(log_r)


def mismatch_metrics(old_logprobs: "torch.Tensor", behavior_logprobs: "torch.Tensor",
                     mask: "torch.Tensor") -> dict[str, float]:
    """How far the rollout's logprobs are from the trainer's on the policy tokens."""
    import torch

    m = mask.bool()
    if not m.any():
        return {"mismatch/max_abs": 0.0, "mismatch/mean_abs": 0.0, "mismatch/k3": 0.0}
    log_r = (old_logprobs - behavior_logprobs)[m]   # samples come from the behaviour policy
    return {"mismatch/max_abs": float(log_r.abs().max()), "mismatch/mean_abs": float(log_r.abs().mean()),
            "mismatch/k3": float((torch.exp(log_r) - 1 - log_r).mean())}


def mismatch_sums(old_logprobs: "torch.Tensor", behavior_logprobs: "torch.Tensor",
                  mask: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """The pieces of `mismatch_metrics` that add up over ranks: 'sums' [3] float64 (tokens, sum of
    |log r|, sum of k3) and 'max_abs' (a 0-d float64 tensor; -inf on no token), on the inputs' device."""
    import torch

    m = mask > 0
    log_r = torch.where(m, old_logprobs - behavior_logprobs, torch.zeros_like(old_logprobs)).double()
    k3 = torch.where(m, torch.exp(log_r) - 1 - log_r, torch.zeros_like(log_r))
    sums = torch.stack([m.sum().double(), log_r.abs().sum(), k3.sum()])
    max_abs = log_r.abs().max() if m.any() else torch.tensor(0.0, dtype=torch.float64, device=log_r.device)
    return {"sums": sums, "max_abs": max_abs}
