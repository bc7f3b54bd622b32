"""Curriculum shares and quotas count the groups an update trains (admitted), not those collected; the
difficulty sampler learns nothing from episodes that are not the policy's (infra-invalid, aborted)."""

from __future__ import annotations

from types import SimpleNamespace

from hybridrl.algo.config import AlgoConfig
from hybridrl.controller import curriculum
from hybridrl.controller.collection import admitted
from hybridrl.data.episode import TaskInstance
from hybridrl.data.mixture import MixtureStream
from hybridrl.data.trajectory import Trajectory, TrajectoryStatus


def _stream(share_policy: str = "none") -> MixtureStream:
    tasks = {name: [TaskInstance(task=name, task_id=f"{name}-{i}", messages=({"role": "user", "content": "q"},),
                                 reference="1") for i in range(8)] for name in ("easy", "hard")}
    return MixtureStream(tasks, {"easy": 1.0, "hard": 1.0}, seed=0, share_policy=share_policy)


def _group(task_id: str, label: str, rewards: list[float],
           status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> list[Trajectory]:
    return [Trajectory(run_id="r", task_id=task_id, group_id=f"{task_id}@{label}", attempt=i, prompt_ids=[1],
                       response_ids=[2], response_mask=[1], behavior_logprobs=[-0.5], policy_versions=[0],
                       reward=r, rewards={"correct": r}, status=status) for i, r in enumerate(rewards)]


def _cfg(share_policy: str, quorum: int = 4):
    return SimpleNamespace(algo=AlgoConfig(), agent=SimpleNamespace(max_response_tokens=64),
                           task=SimpleNamespace(share_policy=share_policy, share_tolerance=0.1,
                                                share_max_wait_rounds=0),
                           trainer=SimpleNamespace(quorum_groups=quorum, groups_in_flight=8))


def test_the_share_reported_is_of_trained_groups():
    """Before: `share/<task>` counted the groups collected, before the filters: easy 0.5 / hard 0.5 while only
    the easy groups trained (the hard ones, never solved, were all-equal and dropped)."""
    stream, cfg = _stream(), _cfg("none")
    trajectories = (_group("easy-0", "1", [1.0, 0.0]) + _group("easy-1", "1", [0.0, 1.0])
                    + _group("hard-0", "1", [0.0, 0.0]) + _group("hard-1", "1", [0.0, 0.0]))
    collection = SimpleNamespace(run=SimpleNamespace(stream=stream, version=0), cfg=cfg)
    _, metrics = curriculum.after_rollout(collection, 1, trajectories, {})
    assert not any(k.startswith("share/") for k in metrics)          # nothing is a share before admission
    kept = admitted(cfg, trajectories, 0).kept
    shares = curriculum.after_admission(cfg, stream, kept)
    assert shares["share/easy"] == 1.0 and shares["share/hard"] == 0.0
    assert shares["share/outside_tolerance"] == 1.0                  # the run trains easy only: said so
    assert stream.trained == {"easy": 2}


def test_a_quota_counts_the_groups_admission_keeps():
    """Before: the all-equal hard groups filled the hard quota and were then dropped at admission (the hard
    task trained 0 of its 2 groups, reported as none short), while its informative group was held."""
    stream, cfg = _stream("launch"), _cfg("launch")
    pool = (_group("easy-0", "1", [1.0, 0.0]) + _group("hard-0", "1", [0.0, 0.0]) + _group("hard-1", "1", [0.0, 0.0])
            + _group("easy-1", "1", [0.0, 1.0]) + _group("easy-2", "1", [1.0, 0.0]) + _group("hard-2", "1", [1.0, 0.0]))
    collection = SimpleNamespace(run=SimpleNamespace(stream=stream, version=0), cfg=cfg, in_flight={},
                                 returned_instances={})
    taken, counts = curriculum.keep_shares(collection, 1, pool)
    trained = admitted(cfg, taken, 0).kept
    by_task = {name: len({t.group_id for t in trained if t.task_id.startswith(name)}) for name in ("easy", "hard")}
    assert by_task == {"easy": 2, "hard": 1}
    assert counts["share/short_groups"] == 1.0                        # hard lacks one trained group: counted
    assert [m[0].group_id for _, m in stream.held] == ["easy-2@1"]    # the extra easy group waits


def test_the_difficulty_sampler_ignores_infra_invalid_and_aborted_episodes():
    """Before: an engine or tool failure counted as the prompt's failure (its success rate, hence its draw
    probability, moved for a reason that is not the policy's)."""
    stream = _stream()
    stream.observe(_group("easy-0", "1", [1.0, 1.0]), 1)
    before = stream.probabilities("easy")
    for status in (TrajectoryStatus.INFRA_INVALID, TrajectoryStatus.ABORTED):
        stream.observe(_group("easy-0", f"2{status.value}", [0.0, 0.0], status=status), 2)
    assert stream.recent["easy-0"] == [1.0, 1.0]
    assert stream.probabilities("easy") == before
    assert stream.totals["easy"]["attempts"] == 2 and stream.totals["easy"]["not_scored"] == 4
    assert stream.step_metrics(_group("easy-0", "3", [0.0], status=TrajectoryStatus.INFRA_INVALID)
                               + _group("easy-1", "3", [1.0]))["task/easy/success_rate"] == 1.0
