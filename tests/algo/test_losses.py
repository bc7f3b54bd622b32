"""Policy loss, KL estimators, TIS and the assembled objective against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algo import correction, kl
from hybridrl.algo.losses import ppo_clip
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.objective import compute_advantages, make_loss_fn
from hybridrl.config import ConfigValueError
from hybridrl.data.batch import Batch


def test_ppo_clip_asymmetric_and_dual_clip():
    old = torch.zeros(1, 5)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 5.0, 0.9]])
    lp = torch.log(ratios)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0, -1.0]])
    loss, m = ppo_clip.loss(lp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A>0, r=1.5: max(-1.5, -1.28) = -1.28 (clipped high); A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.1: max(2.2, 2.2) = 2.2; A<0, r=5: max(5, 1.28) = 5 -> dual clip min(5, 3) = 3
    # A<0, r=0.9: max(0.9, 0.9) = 0.9
    assert loss[0].tolist() == pytest.approx([-1.28, -0.5, 2.2, 3.0, 0.9])
    assert m["clip_fraction"][0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]   # r=5, A<0: the max keeps the unclipped term
    assert m["dual_clip_fraction"][0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    no_dual, _ = ppo_clip.loss(lp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=None)
    assert no_dual[0, 3].item() == pytest.approx(5.0)
    with pytest.raises(ValueError):
        ppo_clip.loss(lp, old, adv, dual_clip=0.5)


def test_ppo_gradient_is_zero_where_clipped():
    lp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = ppo_clip.loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), clip_high=0.2)
    loss.sum().backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == pytest.approx(-1.0)   # d(-A*r)/dlogp = -A*r


def test_kl_estimators_hand_computed():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    log_r = math.log(0.25) - math.log(0.5)
    assert kl.kl(lp, ref, "k1").item() == pytest.approx(-log_r)
    assert kl.kl(lp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl.kl(lp, ref, "k3").item() == pytest.approx(math.exp(log_r) - 1 - log_r)
    assert kl.kl(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError):
        kl.kl(lp, ref, "k4")


def test_tis_weights_and_mismatch():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    beh = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))
    w = correction.tis_weights(old, beh, cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, 1.0, 0.25])
    m = correction.mismatch_metrics(old, beh, torch.tensor([[1, 1, 0]]))
    assert m["mismatch/max_abs"] == pytest.approx(math.log(2))


def _mb():
    return Batch({"old_logprobs": torch.log(torch.tensor([[0.5, 0.5]])),
                  "behavior_logprobs": torch.log(torch.tensor([[0.25, 0.5]])),
                  "ref_logprobs": torch.log(torch.tensor([[0.5, 0.25]])),
                  "advantages": torch.tensor([[1.0, -1.0]])})


def test_assembled_loss_hand_computed():
    cfg = AlgoConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, tis_cap=1.5, dual_clip=0)
    loss_fn = make_loss_fn(cfg)
    lp = torch.log(torch.tensor([[0.5, 0.5]]))   # ratio 1 to old
    ent = torch.tensor([[2.0, 3.0]])
    token_loss, metrics = loss_fn(lp, ent, _mb())
    k3_tok1 = math.exp(math.log(0.25) - math.log(0.5)) - 1 - (math.log(0.25) - math.log(0.5))
    # token 0: pg -1 * tis 1.5 (old/beh = 2, capped), kl 0, -0.01*2 ; token 1: pg +1 * tis 1, kl k3
    assert token_loss[0].tolist() == pytest.approx([-1.5 - 0.02, 1.0 + 0.1 * k3_tok1 - 0.03])
    assert set(metrics) >= {"clip_fraction", "ratio", "tis_weight", "kl", "entropy", "pg_loss"}


def test_compute_advantages_dispatch_and_kl_in_reward():
    cfg = AlgoConfig(advantage="rloo")
    mask = torch.ones(2, 2)
    adv = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask,
                             token_rewards=torch.tensor([[-0.5, 0.0], [0.0, 0.0]]))
    # token rewards stay outside the group baseline: outcome [1, 0] -> +1 / -1, plus each token's return
    # of the token rewards from it on ([-0.5, 0] on row 0)
    assert adv.tolist() == [[0.5, 1.0], [-1.0, -1.0]]


def test_config_validation():
    assert AlgoConfig(advantage="gae").uses_critic
    with pytest.raises(ConfigValueError, match=r"\[0.0, 1.0\]") as err:
        AlgoConfig(advantage="gae", gamma=1.5)
    assert err.value.field == "gamma"
    with pytest.raises(ConfigValueError):
        AlgoConfig(dual_clip=0.5)
    with pytest.raises(ConfigValueError):
        AlgoConfig(kl_in="advantage")
    for key in ("ppo_epochs", "ppo_mini_batches"):
        with pytest.raises(ConfigValueError, match="must be > 0") as err:
            AlgoConfig(**{key: 0})
        assert err.value.field == key


def test_old_logprobs_from_the_training_forward_give_ratio_one_and_the_policy_gradient():
    cfg = AlgoConfig(tis_cap=2.0, dual_clip=3.0)
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1]])).requires_grad_()
    mb = Batch({"advantages": torch.tensor([[1.0, -2.0, 0.5]]),
                "behavior_logprobs": torch.log(torch.tensor([[0.25, 0.2, 0.1]]))})     # no old_logprobs
    token_loss, metrics = make_loss_fn(cfg, old_from_forward=True)(lp, None, mb)
    assert metrics["ratio"].tolist() == [[1.0, 1.0, 1.0]] and metrics["clip_fraction"].sum() == 0
    assert metrics["tis_weight"][0].tolist() == pytest.approx([2.0, 1.0, 1.0])   # exp(old - behaviour), capped
    token_loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-2.0, 2.0, -0.5])                # -A * w: the policy gradient
