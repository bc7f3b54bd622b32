"""Extension points used from outside the package, in one short RL job with real ranks: a placement of
one's own (tests/controller/toy_placement.py: the disaggregated ranks and link, each step waiting for its
own rollout) and an advantage estimator and policy loss of one's own (tests/algo/toy_algo.py)."""

from __future__ import annotations

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train


def test_a_toy_placement_and_a_toy_estimator_from_outside_run_an_rl_job(tmp_path, rl_model):
    proc = hybridrl_train(RECIPE, f"model.path={rl_model}", f"run.dir={tmp_path}", "trainer.total_steps=2",
                          "placement.mode=tests.controller.toy_placement:LOCKSTEP", "placement.rollout_ranks=1",
                          "algo.max_policy_lag=0", "algo.advantage=tests.algo.toy_algo:TOY_ESTIMATOR",
                          "algo.policy_loss=tests.algo.toy_algo:TOY_LOSS", "algo.drop_all_equal_groups=false")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/updated"] == 1.0 for r in rows)
    assert [r["policy/version"] for r in rows] == [1.0, 2.0]
    for r in rows:
        # the sync collection over a rollout rank of its own: every token on the policy being trained,
        # published to the rollout rank before its rollout (no stream metrics: not the stream collection)
        assert r["policy/lag_max"] == 0 and not any(k.startswith("stream/") for k in r)
        assert r["episodes"] == 16 and r["mismatch/max_abs"] < 1e-4
    assert rows[1]["publish/refused"] == 0 and rows[1]["switch/publish_s"] > 0
    from hybridrl.inspect.query import RunLedger

    ledger = RunLedger(tmp_path)
    trajectory = ledger.select(step=1)[0]
    assert "sign(r)" in ledger.explain(trajectory["id"])["advantage"]["formula"]
