"""Statistical integrity, third round: the objective a config names is the one that trains.

Each test names the defect it guards against; exact categoricals where a gradient is claimed."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.objective import compute_advantages, kl_token_rewards

# one group of four with equal task rewards, and small per-token KL penalties (old vs ref logprobs)
MASK = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
OLD = torch.tensor([[-1.0, -0.5, 0.0, -2.0], [-0.7, -0.2, -1.1, 0.0], [-0.9, 0.0, 0.0, 0.0],
                    [-0.3, -0.6, -0.8, -1.2]])
REF = OLD - torch.tensor([[3e-4, 5e-4, 0.0, 1e-4], [7e-4, 2e-4, 4e-4, 0.0], [13e-4, 0.0, 0.0, 0.0],
                          [1e-4, 1e-4, 2e-4, 6e-4]])


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_kl_in_reward_applies_the_configured_coefficient_in_an_all_equal_group(advantage):
    """Before: the KL was summed into the outcome before the group's std division, so a group of equal
    task rewards got +-1.16-size advantages whatever kl_coef was (its scale was kl_coef / std_g)."""
    rewards = torch.ones(4)
    groups = group_index_of(["g"] * 4)
    adv = {}
    for coef in (0.25, 0.5):
        cfg = AlgoConfig(advantage=advantage, kl_coef=coef, kl_in="reward", drop_all_equal_groups=False)
        tr = kl_token_rewards(cfg, OLD, REF, MASK)
        adv[coef] = compute_advantages(cfg, rewards, groups, MASK, token_rewards=tr)
        k1 = (OLD - REF) * MASK                                   # log pi - log ref
        expected = -coef * torch.flip(torch.cumsum(torch.flip(k1, [-1]), -1), [-1]) * MASK
        torch.testing.assert_close(adv[coef], expected, rtol=1e-6, atol=1e-9)
        assert adv[coef].abs().max() < 1e-3                       # the penalty's size, not +-1
    assert torch.equal(adv[0.5], 2 * adv[0.25])                   # exactly proportional to kl_coef


def test_kl_in_reward_adds_to_the_normalised_task_advantage():
    from hybridrl.algo.groups import token_returns

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = group_index_of(["g"] * 4)
    cfg = AlgoConfig(kl_coef=0.5, kl_in="reward")
    tr = kl_token_rewards(cfg, OLD, REF, MASK)
    without = compute_advantages(AlgoConfig(), rewards, groups, MASK)
    with_kl = compute_advantages(cfg, rewards, groups, MASK, token_rewards=tr)
    torch.testing.assert_close(with_kl - without, token_returns(tr, MASK))
