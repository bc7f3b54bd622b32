"""Behaviour weights (TIS truncate / decoupled-PPO mask, MIS at token, sequence and geometric level)
against hand-computed values, through the assembled loss, and counted in the engine's metrics."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algo import correction
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.objective import make_loss_fn
from hybridrl.config import ConfigValueError
from hybridrl.data.batch import Batch

# ratios pi_old / pi_behaviour per token; row 1 has one padding position (mask 0)
RATIOS = torch.tensor([[1.0, 3.0, 0.4, 1.5], [0.9, 1.2, 1.1, 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
OLD = torch.log(torch.full_like(RATIOS, 0.5))
BEHAVIOUR = OLD - torch.log(RATIOS)


def close(t, rows):
    return torch.allclose(t.double(), torch.tensor(rows, dtype=torch.float64), atol=1e-9)


def weights(**kw):
    return correction.behavior_weights(AlgoConfig(**kw), OLD, BEHAVIOUR, MASK)


def test_truncate_is_tis_and_mask_is_the_decoupled_ppo_weight():
    w, m = weights(tis_cap=2.0)
    assert close(w, [[1.0, 2.0, 0.4, 1.5], [0.9, 1.2, 1.1, 2.0]])
    assert m["tis_capped"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    w, _ = weights(tis_cap=2.0, tis_mode="mask")
    assert close(w, [[1.0, 0.0, 0.4, 1.5], [0.9, 1.2, 1.1, 0.0]])
    assert torch.equal(correction.tis_weights(OLD, BEHAVIOUR, 2.0), weights(tis_cap=2.0)[0])
    w, m = weights(tis_cap=0.0)
    assert torch.equal(w, torch.ones_like(w)) and "tis_capped" not in m


def test_mis_token_level_drops_tokens_outside_the_band():
    w, m = weights(tis_cap=0.0, mis="token", mis_low=0.5, mis_high=2.0)
    assert w.tolist() == [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    assert m["mis_masked"].tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]
    w, _ = weights(tis_cap=2.0, mis="token", mis_low=0.5, mis_high=2.0)   # IcePop: ratio weight inside the band
    assert close(w, [[1.0, 0.0, 0.0, 1.5], [0.9, 1.2, 1.1, 0.0]])


def test_mis_sequence_and_geometric_levels_drop_whole_rows():
    # row 0: prod = 1 * 3 * 0.4 * 1.5 = 1.8, geometric 1.8 ** (1/4); row 1 (padding not counted): 0.9*1.2*1.1
    prod0, prod1 = 1.8, 0.9 * 1.2 * 1.1
    w, m = weights(tis_cap=0.0, mis="sequence", mis_low=0.5, mis_high=1.5)
    assert prod0 > 1.5 and 0.5 < prod1 < 1.5
    assert w.tolist() == [[0.0] * 4, [1.0] * 4]
    w, _ = weights(tis_cap=0.0, mis="geometric", mis_low=0.9, mis_high=1.2)
    assert 0.9 < prod0 ** 0.25 < 1.2 and 0.9 < prod1 ** (1 / 3) < 1.2
    assert w.tolist() == [[1.0] * 4, [1.0] * 4]
    w, _ = weights(tis_cap=0.0, mis="geometric", mis_low=0.9, mis_high=math.exp(math.log(prod0) / 4) - 1e-6)
    assert w.tolist() == [[0.0] * 4, [1.0] * 4]


def test_mis_in_the_loss_removes_the_tokens_gradient_and_is_counted():
    cfg = AlgoConfig(tis_cap=0.0, mis="sequence", mis_low=0.5, mis_high=1.5)
    lp = OLD.clone().float().requires_grad_()
    mb = Batch({"advantages": torch.ones(2, 4), "behavior_logprobs": BEHAVIOUR.float(), "loss_mask": MASK.float()})
    token_loss, metrics = make_loss_fn(cfg, old_from_forward=True)(lp, None, mb)
    token_loss.sum().backward()
    assert lp.grad[0].abs().sum() == 0 and lp.grad[1].tolist() == pytest.approx([-1.0] * 4)
    assert metrics["mis_masked"].tolist() == [[1.0] * 4, [0.0] * 4] and "ratio" in metrics


def test_config_checks():
    with pytest.raises(ConfigValueError) as err:
        AlgoConfig(mis="row")
    assert err.value.field == "mis"
    with pytest.raises(ConfigValueError) as err:
        AlgoConfig(mis="token", mis_low=2.0, mis_high=1.0)
    assert err.value.field == "mis_high"
    with pytest.raises(ConfigValueError) as err:
        AlgoConfig(tis_mode="clip")
    assert err.value.field == "tis_mode"
    assert AlgoConfig(tis_cap=0.0, mis="token").corrects_behavior and not AlgoConfig(tis_cap=0.0).corrects_behavior
