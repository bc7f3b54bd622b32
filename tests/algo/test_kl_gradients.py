"""The KL options' expected gradients, computed exactly on a small categorical policy and compared
with the divergence `hybridrl/algo/kl.py` documents for each (estimator, placement).

A categorical policy pi_theta over V tokens (one decision): the expectation over the sampled token
y ~ mu is the sum over every y weighted by mu(y), so E_mu[grad loss(y)] is exact (no sampling).
The losses are the project's own: `make_loss_fn` (KL in the loss) and `kl_token_rewards` plus the
policy loss (KL in the reward)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algo import kl
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.objective import kl_token_rewards, make_loss_fn
from hybridrl.config import ConfigValueError
from hybridrl.data.batch import Batch

V = 6
GEN = torch.Generator().manual_seed(3)
THETA = torch.randn(V, generator=GEN, dtype=torch.float64)          # the policy's logits now
REF = torch.randn(V, generator=GEN, dtype=torch.float64)            # the reference's
STALE = THETA + 0.7 * torch.randn(V, generator=GEN, dtype=torch.float64)   # an older policy that sampled


def exact_gradient(divergence) -> torch.Tensor:
    theta = THETA.clone().requires_grad_()
    divergence(torch.log_softmax(theta, -1), torch.log_softmax(REF, -1)).backward()
    return theta.grad


def kl_forward(logp, logref):     # KL(pi || ref)
    return (logp.exp() * (logp - logref)).sum()


def kl_reverse(logp, logref):     # KL(ref || pi)
    return (logref.exp() * (logref - logp)).sum()


def score_function_of(k_name):    # E_pi[k(y) grad log pi(y)] with k frozen: the policy gradient of reward k
    def div(logp, logref):
        k = kl.kl(logp.detach(), logref, k_name, clamp=None)
        return (logp.exp() * k).sum()          # grad = sum_y grad pi(y) k(y)
    return div


# what kl.GRADIENTS says, as exact gradients
EXPECTED = {
    ("loss", "k1"): lambda: torch.zeros(V, dtype=torch.float64),
    ("loss", "k2"): lambda: exact_gradient(kl_forward),
    ("loss", "k3"): lambda: exact_gradient(kl_reverse),
    ("reward", "k1"): lambda: exact_gradient(kl_forward),
    ("reward", "k2"): lambda: exact_gradient(score_function_of("k2")),
    ("reward", "k3"): lambda: exact_gradient(kl_forward) - exact_gradient(kl_reverse),
}


def test_every_documented_option_is_checked_and_says_its_divergence():
    assert set(EXPECTED) == set(kl.GRADIENTS) == {(p, e) for p in ("loss", "reward") for e in kl.ESTIMATORS}
    assert kl.FORWARD == {("loss", "k2"), ("reward", "k1")} == {(p, kl.DEFAULT[p]) for p in ("loss", "reward")}
    for key, text in kl.GRADIENTS.items():                 # auto picks the options whose gradient is grad KL(pi || ref)
        assert (text == "grad KL(pi || ref)" or text.startswith("grad KL(pi || ref) (")) == (key in kl.FORWARD), key
    assert kl.GRADIENTS[("loss", "k3")].startswith("grad KL(ref || pi)")
    assert kl.GRADIENTS[("loss", "k1")].startswith("zero")


def expected_loss_gradient(cfg: AlgoConfig, behaviour_logits: torch.Tensor, *, old_logits=None) -> torch.Tensor:
    """E_{y ~ mu}[grad_theta loss(y)] of `make_loss_fn(cfg)` with advantages 0 (the KL term alone)."""
    theta = THETA.clone().requires_grad_()
    ys = torch.arange(V)
    logp = torch.log_softmax(theta, -1)[ys].unsqueeze(0)                       # [1, V]: one row per y
    old = logp.detach() if old_logits is None else torch.log_softmax(old_logits, -1)[ys].unsqueeze(0)
    mu = torch.softmax(behaviour_logits, -1)
    mb = Batch({"old_logprobs": old, "advantages": torch.zeros(1, V, dtype=torch.float64),
                "behavior_logprobs": torch.log(mu)[ys].unsqueeze(0),
                "ref_logprobs": torch.log_softmax(REF, -1)[ys].unsqueeze(0), "loss_mask": torch.ones(1, V)})
    token_loss, _ = make_loss_fn(cfg)(logp, None, mb)
    (mu.unsqueeze(0) * token_loss).sum().backward()
    return theta.grad


def expected_reward_gradient(cfg: AlgoConfig) -> torch.Tensor:
    """E_{y ~ pi}[grad loss(y)] of the policy loss with advantage = the KL token reward (one token,
    no baseline): the policy gradient the reward placement gives, divided by kl_coef, negated."""
    theta = THETA.clone().requires_grad_()
    ys = torch.arange(V)
    logp = torch.log_softmax(theta, -1)[ys].unsqueeze(0)
    ref = torch.log_softmax(REF, -1)[ys].unsqueeze(0)
    adv = kl_token_rewards(cfg, logp.detach(), ref, torch.ones(1, V, dtype=torch.float64))
    mb = Batch({"advantages": adv, "behavior_logprobs": logp.detach(), "loss_mask": torch.ones(1, V)})
    token_loss, _ = make_loss_fn(cfg, old_from_forward=True)(logp, None, mb)
    pi = torch.softmax(THETA, -1)
    (pi.unsqueeze(0) * token_loss).sum().backward()
    return theta.grad / cfg.kl_coef


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_in_the_loss_on_policy(estimator):
    cfg = AlgoConfig(kl_coef=1.0, kl_in="loss", kl_estimator=estimator, entropy_coef=0.0)
    got = expected_loss_gradient(cfg, THETA)
    assert torch.allclose(got, EXPECTED[("loss", estimator)](), atol=1e-12), (got, EXPECTED[("loss", estimator)]())


def test_k1_in_the_loss_has_zero_expected_gradient_and_is_refused():
    cfg = AlgoConfig(kl_coef=0.0, kl_in="loss", kl_estimator="k1")
    object.__setattr__(cfg, "kl_coef", 1.0)             # past validation, to show why it refuses
    assert torch.allclose(expected_loss_gradient(cfg, THETA), torch.zeros(V, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ConfigValueError, match="expected gradient of 0") as err:
        AlgoConfig(kl_coef=0.1, kl_in="loss", kl_estimator="k1")
    assert err.value.field == "kl_estimator"


def test_the_default_in_the_loss_is_the_forward_kl_gradient_even_on_stale_samples():
    """Samples from an older policy mu: the KL term is importance-weighted by sg(pi / mu) (ratio to the
    proximal policy x behaviour weight), so its expectation is still grad KL(pi || ref)."""
    want = EXPECTED[("loss", "k2")]()
    cfg = AlgoConfig(kl_coef=1.0, tis_cap=1e6)           # auto -> k2; a cap that truncates nothing
    assert cfg.kl_option == "k2"
    assert torch.allclose(expected_loss_gradient(cfg, STALE), want, atol=1e-12)
    # the same with the proximal policy between them (a second PPO epoch: old != current)
    assert torch.allclose(expected_loss_gradient(cfg, STALE, old_logits=(THETA + STALE) / 2), want, atol=1e-12)
    # without the behaviour weight the stale samples are taken as on-policy: not the KL's gradient
    uncorrected = expected_loss_gradient(AlgoConfig(kl_coef=1.0, tis_cap=0.0), STALE)
    assert (uncorrected - want).abs().max() > 1e-3


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_reward(estimator):
    cfg = AlgoConfig(kl_coef=0.5, kl_in="reward", kl_estimator=estimator, tis_cap=0.0)
    got = expected_reward_gradient(cfg)
    assert torch.allclose(got, EXPECTED[("reward", estimator)](), atol=1e-12)
    if estimator != "k1":                                # only k1 is a KL's gradient as a reward
        assert (got - exact_gradient(kl_forward)).abs().max() > 1e-3
    assert AlgoConfig(kl_in="reward").kl_option == "k1"
