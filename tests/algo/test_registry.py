"""The estimator and policy-loss registries: one definition read by the config, the objective and the
run ledger; entries of one's own from outside the package."""

from __future__ import annotations

import pkgutil

import pytest
import torch

import hybridrl.algo.advantages as advantages_package
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.objective import compute_advantages, compute_gae, make_loss_fn
from hybridrl.algo.registry import ESTIMATORS, POLICY_LOSSES, estimator
from hybridrl.config import ConfigValueError, load_config
from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import Trajectory, to_batch
from hybridrl.store.config import StoreConfig
from hybridrl.store.ledger import Ledger

TOY = "tests.algo.toy_algo:TOY_ESTIMATOR"
TOY_LOSS = "tests.algo.toy_algo:TOY_LOSS"


def test_the_shipped_entries_are_the_modules_of_their_packages():
    modules = sorted(m.name for m in pkgutil.iter_modules(advantages_package.__path__))
    assert ESTIMATORS.names() == modules == ["gae", "grpo", "reinforce_pp", "rloo"]
    assert POLICY_LOSSES.shipped() == ["ppo_clip"]
    for name in modules:
        entry = estimator(name)
        assert entry.name == name and entry.summary and "\n" not in entry.summary
    assert [n for n in modules if estimator(n).needs_critic] == ["gae"]
    assert AlgoConfig(advantage="gae").uses_critic and not AlgoConfig().uses_critic


def test_an_unknown_name_is_one_line_naming_the_key():
    with pytest.raises(ConfigValueError, match="did you mean 'grpo'") as err:
        AlgoConfig(advantage="grp")
    assert err.value.field == "advantage"
    with pytest.raises(ConfigValueError, match="not an hybridrl.algo.registry.Estimator") as err:
        AlgoConfig(advantage="tests.algo.toy_algo:_sign")
    with pytest.raises(ConfigValueError) as err:
        AlgoConfig(policy_loss="no_such_module_here:LOSS")
    assert err.value.field == "policy_loss"


def test_an_estimator_and_a_loss_of_ones_own_from_a_config(tmp_path):
    cfg = load_config(None, [f"algo.advantage={TOY}", f"algo.policy_loss={TOY_LOSS}", "algo.tis_cap=0"]).algo
    mask = torch.ones(3, 2)
    adv = compute_advantages(cfg, torch.tensor([2.0, -1.0, 0.0]), torch.tensor([0, 0, 1]), mask)
    assert adv.tolist() == [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]
    lp = torch.zeros(3, 2, requires_grad=True)
    token_loss, metrics = make_loss_fn(cfg, old_from_forward=True)(lp, None, Batch({"advantages": adv}))
    token_loss.sum().backward()
    assert lp.grad.tolist() == [[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]] and "ratio" in metrics
    with pytest.raises(ValueError, match="trains no critic"):
        compute_gae(cfg, torch.zeros(3), torch.zeros(3, 2), mask)


def _batch(rewards):
    trajs = []
    for i, r in enumerate(rewards):
        t = Trajectory(run_id="r", task_id="q", group_id="q@1", attempt=i, prompt_ids=[1, 2])
        t.append([3, 4], policy=True, logprobs=[-0.5, -0.5], version=0)
        t.reward = r
        trajs.append(t)
    batch = to_batch(trajs)
    batch.set("advantages", torch.full(batch["loss_mask"].shape, 0.25))
    return batch, trajs


@pytest.mark.parametrize("algo, formula", [
    (AlgoConfig(advantage="gae"), "GAE(gamma=1.0, lambda=0.95) over the critic's values at the policy tokens, whitened"),
    (AlgoConfig(advantage="reinforce_pp", reinforce_baseline="none"), "whiten(suffix sum of token rewards + r on"),
    (AlgoConfig(advantage="grpo", norm_adv_by_std=False), "r - mean over the admitted members"),
    (AlgoConfig(advantage=TOY), "sign(r)"),
])
def test_the_ledger_describes_each_advantage_from_the_registry(tmp_path, algo, formula):
    batch, trajs = _batch([1.0, 0.0])
    out = Ledger(tmp_path, StoreConfig(), algo=algo)._advantage_explanations(batch, trajs)
    entry = out[trajs[0].trajectory_id]
    assert entry["formula"].startswith(formula) and entry["estimator"] == algo.advantage
    assert "reinforce_baseline" not in entry["formula"] or algo.advantage == "reinforce_pp"


def test_rloo_rows_carry_their_leave_one_out_baseline(tmp_path):
    batch, trajs = _batch([1.0, 0.0, 0.5])
    out = Ledger(tmp_path, StoreConfig(), algo=AlgoConfig(advantage="rloo"))._advantage_explanations(batch, trajs)
    assert [out[t.trajectory_id]["baseline"] for t in trajs] == [0.25, 0.75, 0.5]
