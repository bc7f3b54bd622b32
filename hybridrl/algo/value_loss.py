"""The critic's loss per token: squared error to the GAE returns, with PPO-style value clipping.

    V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
    loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)          (eps_v = 0: 0.5 * (V - R)^2)

V are the critic's values now, V_old the values the advantages were computed from (before this
step's update), R the returns. Clipping keeps one step's value update near the values used to
compute the advantages (as in the PPO baselines' value-function clipping). The engine reduces the
per-token loss with the configured aggregation over the policy tokens (the loss mask).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.data.batch import Batch


def loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
         clip: float = 0.2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All [N, T]; returns (token_loss [N, T], metrics of [N, T])."""
    if clip < 0:
        raise ValueError(f"value clip must be >= 0 (0 disables it), got {clip}")
    unclipped = (values - returns) ** 2
    metrics = {"value": values.detach(), "return": returns.detach(), "value_error": unclipped.detach().sqrt()}
    if clip == 0:
        return 0.5 * unclipped, metrics
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    metrics["value_clip_fraction"] = (clipped > unclipped).float()
    return 0.5 * torch.maximum(unclipped, clipped), metrics


def make_value_loss_fn(clip: float) -> Callable:
    """loss_fn(values [b, T], entropy (unused), micro_batch) for `MegatronEngine.train_step`; the
    micro-batch carries `values` (the old values) and `returns`."""

    def loss_fn(values: torch.Tensor, entropy, mb: Batch):
        old = mb["values"].to(values.device)
        returns = mb["returns"].to(values.device)
        return loss(values, old, returns, clip=clip)

    return loss_fn
