"""GRPO advantages: each sample's outcome reward against its group (Shao et al., 2024).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     (std normalisation: algo.norm_adv_by_std)

The same scalar is broadcast to every policy token of the sample. A group of one sample has no
baseline to compare with: its advantage is 0. The std is the unbiased sample std (as in the
paper's reference code and veRL).

Per-token rewards (the KL penalty with algo.kl_in=reward) stay outside the group statistics: each
policy token's advantage is the one above plus the return of the token rewards from that token on
(`groups.token_returns`), so -kl_coef * KL trains with the coefficient configured, in every group.
Summed into the outcome before the std division, its scale would be kl_coef / std_g (about 1000x in
a group of equal task rewards, where std_g is the KL's own spread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.algo.registry import AdvantageInputs, Estimator

if TYPE_CHECKING:
    import torch

    from hybridrl.algo.groups import Reduce


def advantages(rewards: "torch.Tensor", group_index: "torch.Tensor", mask: "torch.Tensor", *,
               norm_by_std: bool = True, eps: float = 1e-6, num_groups: int | None = None,
               reduce: "Reduce | None" = None) -> "torch.Tensor":
    """rewards [N], group_index [N] (ints), mask [N, T] -> advantages [N, T] (0 where mask is 0).
    A batch split over ranks: `reduce` and `num_groups` as in `groups.group_stats`."""
    import torch

    from hybridrl.algo.groups import broadcast_to_tokens, group_stats

    mean, std, size = group_stats(rewards, group_index, num_groups=num_groups, reduce=reduce)
    centred = rewards.to(torch.float64) - mean
    if norm_by_std:  # an all-equal group has std 0 and centred 0: its advantage is 0, not NaN
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    centred = torch.where(size > 1, centred, torch.zeros_like(centred))
    return broadcast_to_tokens(centred, mask)


def _compute(cfg, x: AdvantageInputs):
    from hybridrl.algo.groups import token_returns

    outcome = advantages(x.rewards, x.group_index, x.mask, norm_by_std=cfg.norm_adv_by_std,
                         num_groups=x.num_groups, reduce=x.reduce)
    return outcome + token_returns(x.token_rewards, x.mask), None


ESTIMATOR = Estimator(
    name="grpo",
    summary="the sample's reward minus its group's mean (divided by the group's std with algo.norm_adv_by_std), "
            "on every policy token",
    compute=_compute,
    formula=lambda cfg: ("(r - mean) / (std + 1e-6)" if cfg.norm_adv_by_std else "r - mean")
                        + " over the admitted members of the group (0 for a group of one or of equal rewards)"
                        + " + the token rewards' return from the token on (KL in the reward)",
)
