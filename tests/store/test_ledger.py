"""The run ledger on synthetic steps (no ranks): written once, read back exactly, lineage, rewind, retention."""

from __future__ import annotations

import os
import sqlite3

import pytest
import torch

from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.filters import filter_trajectories
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.objective import compute_advantages
from hybridrl.data.trace import trace
from hybridrl.data.trajectory import Trajectory, TrajectoryStatus, Truncation, to_batch
from hybridrl.inspect.query import RunLedger
from hybridrl.store.config import StoreConfig
from hybridrl.store.ledger import Ledger


class Tok:
    def decode(self, ids):
        return " ".join(f"<{i}>" for i in ids)

    def batch_decode(self, rows):
        return [self.decode(r) for r in rows]


def make(step: int, task: str, attempt: int, reward: float, *, version: int = 0,
         status=TrajectoryStatus.COMPLETED) -> Trajectory:
    t = Trajectory(run_id="r", task_id=task, group_id=f"{task}@{step}", attempt=attempt, prompt_ids=[1, 2, 3])
    t.append([10 + attempt, 11], policy=True, logprobs=[-0.5, -0.25 - attempt], version=version)
    t.append([7, 8, 9], policy=False)
    t.append([12], policy=True, logprobs=[-1.0], version=version)
    t.status = status
    if status == TrajectoryStatus.TRUNCATED:
        t.truncation = Truncation.MAX_TURNS
    t.reward, t.rewards, t.reward_evaluators = reward, {"correct": reward}, {"correct": "exact@1"}
    trace(t, "generate", turn=0, version=version, tokens=2, start=0, end=2)
    t.metadata["answer"] = "42"
    return t


def one_step(ledger: Ledger, step: int, trajectories, algo: AlgoConfig, version: int):
    kept = filter_trajectories(trajectories, drop_truncated=True, drop_all_equal_groups=True)
    batch = to_batch(kept.kept)
    batch.set("old_logprobs", batch["behavior_logprobs"] + 0.01)
    batch.set("advantages", compute_advantages(algo, batch["reward"], group_index_of(batch["group_id"]),
                                               batch["loss_mask"]))
    seconds = ledger.record_step(step, trajectories=trajectories, kept=kept, batch=batch,
                                 switch={"release": {"policy_version": version, "training_step": step,
                                                     "checkpoint_hash": f"h{version}"}},
                                 rollout_version=version, version_after=version + 1,
                                 metrics={"time/step_s": 1.0, "time/T_rollout": 0.5},
                                 checkpoint=str(ledger.run_dir / "checkpoints" / f"step_{step:06d}"))
    assert seconds > 0
    return batch


def step_trajectories(step: int, version: int = 0):
    return [make(step, "a", 0, 1.0, version=version), make(step, "a", 1, 0.0, version=version),
            make(step, "b", 0, 1.0, version=version), make(step, "b", 1, 1.0, version=version),      # equal group
            make(step, "c", 0, 0.0, version=version, status=TrajectoryStatus.TRUNCATED),
            make(step, "c", 1, 1.0, version=version), make(step, "c", 2, 0.0, version=version)]


def test_written_once_read_back_exactly_with_lineage(tmp_path):
    algo = AlgoConfig()
    ledger = Ledger(tmp_path, StoreConfig(), tokenizer=Tok(), algo=algo)
    trajectories = step_trajectories(1)
    batch = one_step(ledger, 1, trajectories, algo, version=0)
    shard = tmp_path / "ledger" / "data" / "step_000001.parquet"
    assert not os.access(shard, os.W_OK) or os.geteuid() == 0
    assert oct(shard.stat().st_mode & 0o777) == "0o444"
    assert sqlite3.connect(tmp_path / "ledger" / "index.sqlite").execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    view = RunLedger(tmp_path)
    assert [r["id"] for r in view.select(step=1)] == [t.trajectory_id for t in trajectories]
    consumed = {r["id"]: r for r in view.select() if r["consumed_step"] == 1}
    assert sorted(consumed) == sorted(batch["trajectory_id"])          # a0, a1, c1, c2 (c0 truncated, b equal)
    reasons = {r["id"]: r["filter_reason"] for r in view.select() if r["consumed_step"] is None}
    assert reasons == {"r/b/b@1/0": "all_equal_group", "r/b/b@1/1": "all_equal_group", "r/c/c@1/0": "truncated"}

    t = trajectories[1]
    e = view.explain(t.trajectory_id)
    assert e["tokens"]["response_ids"] == t.response_ids and e["tokens"]["mask"] == t.response_mask
    assert e["tokens"]["versions"] == t.policy_versions
    assert e["tokens"]["behavior_logprobs"] == pytest.approx(t.behavior_logprobs)
    row = batch["trajectory_id"].index(t.trajectory_id)
    p, n = 3, 3 + len(t.response_ids)
    assert e["tokens"]["advantages"] == pytest.approx(batch["advantages"][row, p:n].tolist())
    assert e["tokens"]["old_logprobs"] == pytest.approx(batch["old_logprobs"][row, p:n].tolist())
    # GRPO over the admitted members of group a (rewards 1, 0): mean 0.5, unbiased std 0.7071
    adv = e["advantage"]
    assert adv["group_rewards"] == [1.0, 0.0] and adv["group_mean"] == 0.5
    assert adv["value"] == pytest.approx((0.0 - 0.5) / (0.5 ** 0.5 + 1e-6), rel=1e-5)
    assert adv["value"] == pytest.approx(batch["advantages"][row, p].item())
    assert e["update"] == {"consumed": True, "step": 1, "batch_row": row, "tokens_trained": 3,
                           "policy_version_before": 0, "policy_version_after": 1}
    assert e["reward"]["components"] == {"correct": {"value": 0.0, "evaluator": "exact@1"}}
    assert e["policy"]["by_version"] == {0: {"tokens": 3, "release": {"checkpoint_hash": "h0", "training_step": 1,
                                                                       "published_at_step": 1}}}
    assert e["checkpoint"]["release"] is None and e["checkpoint"]["checkpoint"]["step"] == 1
    assert e["text"]["answer"] == "42" and e["text"]["pieces"][:2] == ["<11>", "<11>"]
    # the truncated one: no advantage, no update, the reason said
    e = view.explain("r/c/c@1/0")
    assert e["update"] == {"consumed": False, "filter_reason": "truncated"} and not e["advantage"]["computed"]
    assert view.resolve(t.trace_id) == t.trajectory_id and view.resolve("r/a/a@1/1") == t.trajectory_id
    with pytest.raises(KeyError, match="names 2 trajectories"):
        view.resolve("r/a/a@1/")
    # the next step's switch publishes v1: the release that resulted from step 1's update
    one_step(ledger, 2, step_trajectories(2, version=1), algo, version=1)
    assert RunLedger(tmp_path).explain(t.trajectory_id)["checkpoint"]["release"] == {"checkpoint_hash": "h1",
                                                                                     "published_at_step": 2}


def test_a_resumed_run_moves_the_abandoned_attempt_aside_and_ids_stay_unique(tmp_path):
    algo = AlgoConfig()
    first = Ledger(tmp_path, StoreConfig(), tokenizer=Tok(), algo=algo)
    for step in (1, 2, 3):
        one_step(first, step, step_trajectories(step, version=step - 1), algo, version=step - 1)
    again = Ledger(tmp_path, StoreConfig(), tokenizer=Tok(), algo=algo)       # resumed from step 1's checkpoint
    # its first record may be a validation's switch (step 2 validates before the step is recorded)
    again.record_switch(2, {"release": {"policy_version": 2, "training_step": 2, "checkpoint_hash": "again"}})
    one_step(again, 2, step_trajectories(2, version=1), algo, version=1)
    assert {v: r["checkpoint_hash"] for v, r in RunLedger(tmp_path).releases().items()} == {0: "h0", 1: "h1",
                                                                                             2: "again"}
    view = RunLedger(tmp_path)
    assert [s["step"] for s in view.steps()] == [1, 2]
    ids = [r["id"] for r in view.select()]
    assert len(ids) == len(set(ids)) == 14
    moved = sorted(p.name for p in (tmp_path / "ledger" / "abandoned").iterdir())
    assert sorted(m.split(".")[1] for m in moved) == ["step_000002", "step_000002", "step_000003", "step_000003"]
    rewind = [e for e in view.summary()["events"] if e["kind"] == "rewind"]
    assert len(rewind) == 1 and rewind[0]["step"] == 2 and '"trajectories":14' in rewind[0]["detail"]


def test_retention_deletes_old_shards_and_keeps_the_lineage(tmp_path):
    algo = AlgoConfig()
    ledger = Ledger(tmp_path, StoreConfig(keep_steps=2, text=False), tokenizer=Tok(), algo=algo)
    for step in (1, 2, 3):
        one_step(ledger, step, step_trajectories(step, version=step - 1), algo, version=step - 1)
    assert sorted(p.name for p in (tmp_path / "ledger" / "data").iterdir()) == ["step_000002.parquet",
                                                                                "step_000003.parquet"]
    assert not any((tmp_path / "ledger" / "text").iterdir())
    view = RunLedger(tmp_path)
    e = view.explain("r/a/a@1/0")
    assert e["data"] == "pruned by retention" and e["update"]["step"] == 1 and "tokens" not in e
    assert view.summary()["pruned_steps"] == [1]
    capped = Ledger(tmp_path / "cap", StoreConfig(max_mb=1e-6), tokenizer=Tok(), algo=algo)
    for step in (1, 2):
        one_step(capped, step, step_trajectories(step), algo, version=0)
    assert [s["pruned"] for s in RunLedger(tmp_path / "cap").steps()] == [1, 0]   # never the newest


def test_bad_store_config_names_the_key():
    from hybridrl.config.fields import ConfigValueError

    with pytest.raises(ConfigValueError, match="expected one of"):
        StoreConfig(compression="lz5")
    with pytest.raises(ConfigValueError):
        StoreConfig(keep_steps=-1)
