"""GAE over agent episodes and the clipped value loss, against hand-computed values and an
independent computation (the closed-form sum over each row's compacted policy tokens)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algo import value_loss
from hybridrl.algo.advantages import gae
from hybridrl.algo.groups import whiten


def _independent(rewards, values, mask, gamma, lam):
    """Per row: keep only the policy tokens, then A_k = sum_l (gamma*lam)^l delta_{k+l} (no recursion)."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for row in range(mask.shape[0]):
        pos = [t for t in range(mask.shape[1]) if mask[row, t] > 0]
        r = [float(rewards[row, t]) for t in pos]
        v = [float(values[row, t]) for t in pos] + [0.0]
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(pos))]
        for k, t in enumerate(pos):
            adv[row, t] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(pos) - k))
    return adv, (adv + values.double()) * mask.double()


# unequal lengths (right padding), observation gaps of 1 and 2 tokens, prompt positions, an empty row
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 0],
                     [0, 0, 1, 0, 1, 0, 0, 0, 0],
                     [0, 1, 1, 1, 1, 1, 1, 1, 1],
                     [0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)


def test_gae_hand_computed_with_an_observation_gap():
    # policy, observation, observation, policy, policy; reward 1 at the end; gamma 0.9, lam 0.8
    r = torch.tensor([[0.0, 5.0, 5.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 9.0, 0.3, 0.7]])
    m = torch.tensor([[1, 0, 0, 1, 1]])
    adv, ret = gae.advantages(r, v, m, gamma=0.9, lam=0.8)
    d4 = 1.0 + 0.9 * 0.0 - 0.7               # last decision: nothing after it
    d3 = 0.0 + 0.9 * 0.7 - 0.3
    d0 = 0.0 + 0.9 * 0.3 - 0.5               # the next decision is position 3: one discount, not three
    a4 = d4
    a3 = d3 + 0.72 * a4
    a0 = d0 + 0.72 * a3
    assert adv[0].tolist() == pytest.approx([a0, 0.0, 0.0, a3, a4])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, 0.0, 0.0, a3 + 0.3, a4 + 0.7])


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (0.7, 0.0), (0.99, 1.0)])
def test_gae_equals_an_independent_computation(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards = gae.outcome_token_rewards(torch.tensor([1.0, -0.5, 2.0, 3.0]), MASK,
                                        token_rewards=0.1 * torch.randn(MASK.shape, generator=g))
    values = torch.randn(MASK.shape, generator=g)
    adv, ret = gae.advantages(rewards, values, MASK, gamma=gamma, lam=lam)
    want_adv, want_ret = _independent(rewards * MASK, values, MASK, gamma, lam)
    assert torch.allclose(adv.double(), want_adv, atol=1e-5)
    assert torch.allclose(ret.double(), want_ret, atol=1e-5)
    assert adv[3].abs().sum() == 0 and ret[3].abs().sum() == 0       # a row without decisions
    assert (adv[MASK == 0] == 0).all() and (ret[MASK == 0] == 0).all()
    # values and rewards on observation tokens do not matter
    noise = torch.randn(MASK.shape, generator=g) * (1 - MASK)
    adv2, ret2 = gae.advantages(rewards + noise, values + noise, MASK, gamma=gamma, lam=lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_outcome_reward_goes_on_the_last_policy_token():
    out = gae.outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), MASK,
                                    token_rewards=torch.full(MASK.shape, -0.1))
    assert out[0].tolist() == pytest.approx([0, -0.1, -0.1, 0, 0, -0.1, 0.9, 0, 0])
    assert out[1].tolist() == pytest.approx([0, 0, -0.1, 0, 1.9, 0, 0, 0, 0])
    assert out[2, 8].item() == pytest.approx(2.9) and out[3].abs().sum() == 0


def test_whiten_over_policy_tokens_only():
    adv = torch.arange(36, dtype=torch.float32).view(4, 9)
    w = whiten(adv, MASK, eps=0.0)
    vals = adv[MASK > 0]
    assert torch.allclose(w[MASK > 0], (vals - vals.mean()) / vals.std(), atol=1e-6)
    assert (w[MASK == 0] == 0).all()


def test_gae_rejects_out_of_range_gamma_lambda():
    with pytest.raises(ValueError, match="gamma"):
        gae.advantages(MASK, MASK, MASK, gamma=1.5)


def test_value_loss_with_clipping_hand_computed():
    values = torch.tensor([[1.0, 0.5, -0.2, 0.0]])
    old = torch.tensor([[0.5, 0.4, 0.3, 0.0]])
    returns = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    token_loss, metrics = value_loss.loss(values, old, returns, clip=0.2)
    # token 0: V moved +0.5 -> clipped to 0.7; (1-2)^2=1 vs (0.7-2)^2=1.69 -> max 1.69 (clipped)
    # token 1: moved +0.1 (inside the clip); (0.5)^2 = 0.25 either way
    # token 2: moved -0.5 -> 0.1; (-0.2+1)^2=0.64 vs (0.1+1)^2=1.21 -> 1.21 (clipped)
    # token 3: not moved; 1.0
    assert token_loss[0].tolist() == pytest.approx([0.5 * 1.69, 0.5 * 0.25, 0.5 * 1.21, 0.5 * 1.0])
    assert metrics["value_clip_fraction"][0].tolist() == [1.0, 0.0, 1.0, 0.0]
    # pessimistic: a move past the clip range toward the return is scored at the clipped value
    # (1.0 -> 1.9 is clipped to 1.2: (1.2 - 2)^2 = 0.64 > (1.9 - 2)^2 = 0.01)
    t2, m2 = value_loss.loss(torch.tensor([[1.9]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]), clip=0.2)
    assert t2.item() == pytest.approx(0.5 * 0.64) and m2["value_clip_fraction"].item() == 1.0
    plain, _ = value_loss.loss(values, old, returns, clip=0.0)
    assert plain[0].tolist() == pytest.approx([0.5, 0.125, 0.32, 0.5])
    with pytest.raises(ValueError):
        value_loss.loss(values, old, returns, clip=-1.0)


def test_value_loss_gradient_is_zero_where_clipped():
    values = torch.tensor([[1.0, 0.5]], requires_grad=True)
    token_loss, _ = value_loss.loss(values, torch.tensor([[0.5, 0.4]]), torch.tensor([[2.0, 0.0]]), clip=0.2)
    token_loss.sum().backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5])        # clipped: no gradient; else V - R
