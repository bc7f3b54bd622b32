from __future__ import annotations

import pytest
import torch

from hybridrl.data.trajectory import Trajectory, TrajectoryStatus, Truncation, to_batch


def make(prompt=(5, 6, 7), attempt=0):
    t = Trajectory(run_id="r", task_id="t1", group_id="g1", attempt=attempt, prompt_ids=list(prompt))
    t.append([10, 11], policy=True, logprobs=[-0.5, -0.25], version=3)
    t.append([20, 21, 22], policy=False)
    t.append([12], policy=True, logprobs=[-1.0], version=4)
    return t


def test_append_and_validate():
    t = make()
    assert t.response_mask == [1, 1, 0, 0, 0, 1]
    assert t.policy_versions == [3, 3, -1, -1, -1, 4] and t.versions == {3, 4}
    assert t.num_policy_tokens == 3
    t.validate()
    assert t.trajectory_id == "r/t1/g1/0" and len(t.trace_id) == 16
    with pytest.raises(ValueError, match="needs as many logprobs"):
        t.append([1, 2], policy=True, logprobs=[0.0], version=1)
    with pytest.raises(ValueError, match="version"):
        t.append([1], policy=True, logprobs=[0.0])
    bad = make()
    bad.status = TrajectoryStatus.TRUNCATED
    with pytest.raises(ValueError, match="TRUNCATED needs"):
        bad.validate()
    bad.truncation = Truncation.MAX_TURNS
    bad.validate()


def test_to_batch_is_token_aligned():
    a, b = make(), make(prompt=(5,), attempt=1)
    batch = to_batch([a, b], pad_id=99)
    assert batch["input_ids"].shape == (2, 9)
    assert batch["input_ids"][1].tolist() == [5, 10, 11, 20, 21, 22, 12, 99, 99]
    assert batch["attention_mask"][1].tolist() == [1] * 7 + [0, 0]
    # loss mask marks exactly the positions holding policy-sampled tokens
    assert batch["loss_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert batch["behavior_logprobs"][0, 3:5].tolist() == [-0.5, -0.25]
    assert batch["behavior_logprobs"][0, 8].item() == -1.0
    assert batch["policy_version"][0].tolist() == [-1, -1, -1, 3, 3, -1, -1, -1, 4]
    ids = batch["input_ids"]
    sampled = ids[batch["loss_mask"].bool()].tolist()
    assert sampled == [10, 11, 12, 10, 11, 12]
    assert batch["group_id"] == ["g1", "g1"] and batch["prompt_len"].tolist() == [3, 1]
    assert torch.equal(batch["reward"], torch.zeros(2))


def test_from_batch_inverts_to_batch():
    from hybridrl.data.trajectory import ToolCallRecord, from_batch

    a, b = make(), make(prompt=(5,), attempt=1)
    b.status, b.truncation = TrajectoryStatus.TRUNCATED, Truncation.MAX_TURNS
    b.tool_calls = [ToolCallRecord(turn=0, name="calculator", ok=False, error="bad", latency_s=0.5)]
    b.rewards, b.reward = {"correct": 1.0}, 1.0
    batch = to_batch([a, b], pad_id=99).pad_to(3)
    back = from_batch(batch)
    assert len(back) == 2
    for orig, got in zip([a, b], back):
        assert got.to_dict() == orig.to_dict()


def test_routing_replay_keeps_the_latest_record_of_a_recomputed_position():
    """R3 over several turns. Before: positions recorded by an earlier turn kept that record even when a later
    turn (a newer policy version) recomputed the context with other routes; now the latest record wins, and
    positions only the earlier turn computed keep its record."""
    import torch

    from hybridrl.data.trajectory import Trajectory

    t = Trajectory(run_id="r", task_id="x", group_id="x@0", attempt=0, prompt_ids=[1, 2, 3])
    first = torch.zeros(4, 2, 1, dtype=torch.int8)                   # turn 1: prompt + 1 token, version 0
    t.append([7, 8], policy=True, logprobs=[-0.1, -0.2], version=0, routed_experts=first)
    t.append([9], policy=False)
    second = torch.ones(6, 2, 1, dtype=torch.int8)                   # turn 2 recomputed it all at version 1
    t.append([10], policy=True, logprobs=[-0.3], version=1, routed_experts=second)
    assert t.routed_experts.shape == (6, 2, 1) and bool((t.routed_experts == 1).all())
    shorter = torch.full((3, 2, 1), 2, dtype=torch.int8)             # a record of a prefix only: the rest stays
    t.append([11], policy=True, logprobs=[-0.4], version=2, routed_experts=shorter)
    assert t.routed_experts[:, 0, 0].tolist() == [2, 2, 2, 1, 1, 1]
