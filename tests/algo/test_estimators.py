"""Advantage estimators against hand-computed values (masks, unequal groups, unequal lengths)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algo.advantages import gae, grpo, reinforce_pp, rloo
from hybridrl.algo.groups import group_index_of

# three groups of unequal size: g0 = {1, 0, 0}, g1 = {1, 1} (all equal), g2 = {0.5} (alone)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
GROUPS = group_index_of(["a", "a", "a", "b", "b", "c"])
# unequal lengths, and an observation token (0) inside row 0
MASK = torch.tensor([[1, 1, 0, 1],
                     [1, 0, 0, 0],
                     [1, 1, 1, 0],
                     [1, 1, 0, 0],
                     [0, 1, 1, 1],
                     [1, 1, 1, 1]])


def test_group_index_is_dense_in_first_seen_order():
    assert group_index_of(["x", "y", "x", "z"]).tolist() == [0, 1, 0, 2]


def test_grpo_hand_computed():
    # g0: mean 1/3, unbiased std = sqrt(((2/3)^2 + 2*(1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    adv = grpo.advantages(REWARDS, GROUPS, MASK, norm_by_std=True, eps=0.0)
    assert adv[0].tolist() == pytest.approx([(2 / 3) / std, (2 / 3) / std, 0.0, (2 / 3) / std])
    assert adv[1].tolist() == pytest.approx([(-1 / 3) / std, 0, 0, 0])
    assert adv[3].abs().sum() == 0 and adv[4].abs().sum() == 0   # all-equal group: 0 (not NaN)
    assert adv[5].abs().sum() == 0                                # a group of one: no baseline
    plain = grpo.advantages(REWARDS, GROUPS, MASK, norm_by_std=False)
    assert plain[2].tolist() == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 0])
    assert torch.isfinite(adv).all()


def test_rloo_hand_computed():
    adv = rloo.advantages(REWARDS, GROUPS, MASK)
    # g0: r - mean(others): 1 - 0 = 1; 0 - (1+0)/2 = -0.5
    assert adv[0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert adv[1].tolist() == [-0.5, 0.0, 0.0, 0.0]
    assert adv[2].tolist() == [-0.5, -0.5, -0.5, 0.0]
    assert adv[3:5].abs().sum() == 0 and adv[5].abs().sum() == 0


def test_reinforce_pp_returns_baseline_and_whitening():
    rewards = torch.tensor([1.0, 0.0])
    groups = torch.tensor([0, 0])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    token_rewards = torch.tensor([[-0.1, 5.0, -0.2], [-0.3, -0.4, 9.0]])   # off-mask values are ignored
    adv = reinforce_pp.advantages(rewards, groups, mask, token_rewards=token_rewards, baseline="group")
    # outcome minus group mean (0.5): +0.5 / -0.5 on the last policy token; returns = suffix sums
    returns = torch.tensor([[-0.1 - 0.2 + 0.5, 0.0, -0.2 + 0.5], [-0.3 - 0.4 - 0.5, -0.4 - 0.5, 0.0]])
    vals = returns[mask.bool()]
    expected = (returns - vals.mean()) / vals.std() * mask
    assert torch.allclose(adv, expected, atol=1e-5)
    with pytest.raises(ValueError):
        reinforce_pp.advantages(rewards, groups, mask, baseline="median")


def test_gae_skips_observation_tokens():
    # one sequence: policy, observation, policy; reward 1 at the end; gamma=1, lam=0.5
    r = torch.tensor([[0.0, 7.0, 1.0]])
    v = torch.tensor([[0.2, 9.0, 0.6]])
    m = torch.tensor([[1, 0, 1]])
    adv, ret = gae.advantages(r, v, m, gamma=1.0, lam=0.5)
    a2 = 1.0 - 0.6                       # last decision: r - V
    a0 = (0.0 + 0.6 - 0.2) + 0.5 * a2    # next decision is position 2, not the observation
    assert adv.tolist()[0] == pytest.approx([a0, 0.0, a2])
    assert ret.tolist()[0] == pytest.approx([a0 + 0.2, 0.0, a2 + 0.6])
