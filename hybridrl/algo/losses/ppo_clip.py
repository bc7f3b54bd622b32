"""PPO-clip policy loss per token, with asymmetric clip ranges and dual clip.

    ratio = exp(logp - old_logp)          old: the proximal policy (the trainer's own logprobs
                                          before this step's first update)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    dual clip (A < 0 only, Ye et al., 2020): loss = min(loss, -A * c),  c > 1

With stale or mismatched samples the objective multiplies this by the behaviour weight
pi_old / pi_behaviour (`algo/correction.py`): the ratio is clipped against the proximal policy,
not the one that sampled, which is decoupled PPO (Hilton et al., 2021; AReaL, Fu et al., 2025).

Returns per-token losses (the engine aggregates them with the configured mode and global
denominators) and per-token metric values (clip fractions, ratio, approximate KL to old).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.algo.registry import PolicyLoss

if TYPE_CHECKING:
    import torch


def loss(logprobs: "torch.Tensor", old_logprobs: "torch.Tensor", advantages: "torch.Tensor", *,
         clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = 3.0
         ) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
    """All inputs [N, T]; returns (token_loss [N, T], metrics of [N, T])."""
    import torch

    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_fraction": (clipped > unclipped).float(), "ratio": ratio.detach(),
               "approx_kl_old": (0.5 * log_ratio.detach() ** 2)}
    if dual_clip is not None:
        floor = -advantages * dual_clip
        dual = (advantages < 0) & (token_loss > floor)
        token_loss = torch.where(dual, floor, token_loss)
        metrics["dual_clip_fraction"] = dual.float()
    return token_loss, metrics


POLICY_LOSS = PolicyLoss(
    name="ppo_clip",
    summary="PPO's clipped surrogate of the ratio to the proximal policy (algo.clip_low/clip_high, dual clip "
            "algo.dual_clip for A < 0)",
    compute=lambda cfg, logprobs, old, adv: loss(logprobs, old, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                                 dual_clip=cfg.dual_clip or None),
)
