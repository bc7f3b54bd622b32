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


# ------------------------------------------------------------------ item 7: the KL clamp keeps the gradient

def test_k2_gradient_is_bounded_not_zero_beyond_the_clamp():
    """Before: log_r was clamped with `clamp`, whose gradient is 0 outside +-10: exactly where the policy had
    drifted furthest from the reference, the KL term stopped pulling it back."""
    from hybridrl.algo import kl

    logp = torch.tensor([[-0.5, -0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-12.5, -5.5, 11.5]], dtype=torch.float64)            # log_r = -12, -5, +12
    k = kl.kl(logp, ref, "k2")
    assert k.tolist() == [[50.0, 12.5, 50.0]]                                   # values clamped at 10 nats
    k.sum().backward()
    assert logp.grad.tolist() == [[10.0, 5.0, -10.0]]                           # d k2 / d log pi = -clamp(log_r)


def test_k2_in_the_loss_on_a_categorical_far_from_the_reference():
    """Exact expectation over a 3-token categorical whose reference all but excludes token 0 (log ref = -30):
    the KL term's expected gradient is E_pi[clamp(log pi - log ref, +-10) grad log pi], which points the way
    grad KL(pi || ref) does; the plain clamp gave token 0 no gradient at all."""
    from hybridrl.algo.objective import make_loss_fn
    from hybridrl.data.batch import Batch

    theta0 = torch.tensor([1.0, 0.2, -0.3], dtype=torch.float64)
    logref = torch.tensor([-30.0, -0.1, -2.4], dtype=torch.float64)
    theta = theta0.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1).unsqueeze(0)                          # [1, 3]: one row per y
    mb = Batch({"advantages": torch.zeros(1, 3, dtype=torch.float64), "behavior_logprobs": logp.detach(),
                "ref_logprobs": logref.unsqueeze(0), "loss_mask": torch.ones(1, 3)})
    token_loss, _ = make_loss_fn(AlgoConfig(kl_coef=1.0, tis_cap=0.0), old_from_forward=True)(logp, None, mb)
    pi = torch.softmax(theta0, -1)
    (pi.unsqueeze(0) * token_loss).sum().backward()
    # the same expectation, written out: sum_y pi(y) clamp(log pi(y) - log ref(y)) grad log pi(y)
    t = theta0.clone().requires_grad_()
    lp = torch.log_softmax(t, -1)
    (pi * (lp.detach() - logref).clamp(-10, 10) * lp).sum().backward()
    torch.testing.assert_close(theta.grad, t.grad, rtol=0, atol=1e-12)
    t2 = theta0.clone().requires_grad_()
    lp2 = torch.log_softmax(t2, -1)
    (lp2.exp() * (lp2 - logref)).sum().backward()                              # grad KL(pi || ref), exact
    assert theta.grad[0] > 0 and t2.grad[0] > 0                                 # both push token 0 down
    cos = torch.nn.functional.cosine_similarity(theta.grad, t2.grad, dim=0)
    assert cos > 0.99, cos


# ------------------------------------------------------------------ item 6: distillation, exactly

def _two_token_distillation_gradient(discount: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every 2-token response of a categorical student over 3 tokens (first token: logits A; second: logits
    B[y1]), each weighted by its probability: the exact expected gradient (w.r.t. A, B) of the project's
    distillation advantage trained by its policy loss (reward_weight 0, kl_coef 1, ratio 1)."""
    from hybridrl.algo import distill
    from hybridrl.algo.objective import make_loss_fn
    from hybridrl.data.batch import Batch

    g = torch.Generator().manual_seed(7)
    a0, b0 = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    qa, qb = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    seqs = [(i, j) for i in range(3) for j in range(3)]
    logp = torch.stack([torch.stack([torch.log_softmax(a, -1)[i], torch.log_softmax(b[i], -1)[j]]) for i, j in seqs])
    logq = torch.stack([torch.stack([torch.log_softmax(qa, -1)[i], torch.log_softmax(qb[i], -1)[j]]) for i, j in seqs])
    mask = torch.ones(9, 2, dtype=torch.float64)
    cfg = distill.DistillConfig(teacher="t", kl_coef=1.0, reward_weight=0.0, discount=discount)
    adv = distill.token_advantages(cfg, torch.zeros(9, 2, dtype=torch.float64), logp.detach(), logq, mask)
    mb = Batch({"advantages": adv, "behavior_logprobs": logp.detach(), "loss_mask": mask})
    token_loss, _ = make_loss_fn(AlgoConfig(tis_cap=0.0), old_from_forward=True)(logp, None, mb)
    weight = logp.detach().sum(-1).exp()                                         # pi(y1, y2)
    (weight.unsqueeze(-1) * token_loss).sum().backward()
    # the exact references: the sequence reverse KL, and the first token's own KL
    ea, eb = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    la, lqa = torch.log_softmax(ea, -1), torch.log_softmax(qa, -1)
    lb, lqb = torch.log_softmax(eb, -1), torch.log_softmax(qb, -1)
    per_position = (lb.exp() * (lb - lqb)).sum(-1)                               # KL at the second position
    sequence = (la.exp() * (la - lqa + per_position)).sum()
    grad_seq_a, = torch.autograd.grad(sequence, ea)
    fa = a0.clone().requires_grad_()
    lfa = torch.log_softmax(fa, -1)
    grad_first_a, = torch.autograd.grad((lfa.exp() * (lfa - lqa)).sum(), fa)
    return a.grad, grad_seq_a, grad_first_a


def test_distillation_discount_one_is_the_sequence_reverse_kl_gradient():
    """discount=1 (new): the first token's gradient is that of KL(pi(y1, y2) || q(y1, y2)) exactly."""
    got, sequence, _ = _two_token_distillation_gradient(1.0)
    torch.testing.assert_close(got, sequence, rtol=0, atol=1e-6)       # advantages in float32


def test_distillation_discount_zero_is_the_per_token_kl_as_documented():
    """discount=0 (the default, as before): the first token's gradient is its own position's KL only, not the
    sequence KL's (the old docstring claimed the reverse KL's gradient); the difference is real."""
    got, sequence, first = _two_token_distillation_gradient(0.0)
    torch.testing.assert_close(got, first, rtol=0, atol=1e-6)
    assert (got - sequence).abs().max() > 0.02


# ------------------------------------------------------------------ item 5: no entropy bonus on rejected tokens

@pytest.mark.parametrize("correction", [dict(mis="token"), dict(tis_cap=2.0, tis_mode="mask")])
def test_a_rejected_token_gets_no_entropy_bonus(correction):
    """Before: MIS / IcePop / decoupled-PPO rejected a token's policy gradient but still gave it the entropy
    bonus, so the tokens judged too far off-policy kept being pushed."""
    from hybridrl.algo.objective import make_loss_fn
    from hybridrl.data.batch import Batch

    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -3.0, -1.2]])             # ratio e^0 = 1, e^2 = 7.4 (rejected), e^0.2
    entropy = torch.tensor([[0.5, 0.5, 0.5]], requires_grad=True)
    mb = Batch({"old_logprobs": old, "advantages": torch.zeros(1, 3), "behavior_logprobs": behaviour,
                "loss_mask": torch.ones(1, 3)})
    cfg = AlgoConfig(entropy_coef=0.1, **{"tis_cap": 0.0, **correction})
    token_loss, metrics = make_loss_fn(cfg)(old.clone().requires_grad_(), entropy, mb)
    token_loss.sum().backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.1, 0.0, -0.1])
