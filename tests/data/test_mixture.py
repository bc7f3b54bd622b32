"""The mixture stream: task shares by weight, the difficulty sampler (prompts every sample solves, or none
does, drawn less, never below the floor), and its checkpoint state."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from hybridrl.data.episode import TaskInstance
from hybridrl.data.mixture import MixtureStream, launch_step
from hybridrl.data.trajectory import TrajectoryStatus


def _instances(task: str, n: int) -> list[TaskInstance]:
    return [TaskInstance(task=task, task_id=f"{task}-{i}", messages=({"role": "user", "content": f"q{i}"},),
                         reference=str(i)) for i in range(n)]


def _episode(task_id: str, solved: bool, group: str) -> SimpleNamespace:
    return SimpleNamespace(task_id=task_id, rewards={"correct": 1.0 if solved else 0.0}, reward=float(solved),
                           response_ids=[1, 2, 3], timings={"total_s": 0.5}, group_id=group,
                           status=TrajectoryStatus.COMPLETED)


def test_uniform_draws_hold_the_declared_weights():
    stream = MixtureStream({"a": _instances("a", 10), "b": _instances("b", 10)}, {"a": 3.0, "b": 1.0}, seed=0)
    drawn = Counter(inst.task for _ in range(10) for inst in stream.next(4))
    assert drawn == {"a": 30, "b": 10}
    firsts = [inst.task_id for inst in stream.next(20) if inst.task == "a"]
    assert len(set(firsts[:10])) == 10          # within a task: its shuffled order, every prompt once an epoch


def test_the_difficulty_sampler_draws_solved_prompts_less_and_keeps_the_floor():
    """12 prompts: 4 always solved, 4 solved half the time, 4 never. Over a 300-draw run the always-solved
    (and never-solved) prompts are drawn less than the half-solved ones, and no prompt's probability ever
    falls below floor / N."""
    floor, n = 0.25, 12
    stream = MixtureStream({"t": _instances("t", n)}, {"t": 1.0}, seed=1, sampler="difficulty", floor=floor,
                           window=8)
    rate = {f"t-{i}": (1.0, 0.5, 0.0)[i // 4] for i in range(n)}
    drawn: Counter = Counter()
    lowest = 1.0
    for step in range(1, 101):
        for inst in stream.next(3):
            drawn[inst.task_id] += 1
            solved = [k < 4 * rate[inst.task_id] for k in range(4)]       # 4 samples, a fixed fraction solved
            stream.observe([_episode(inst.task_id, s, f"{inst.task_id}@{step}") for s in solved], step)
        probs = stream.probabilities("t")
        assert sum(probs) == pytest.approx(1.0)
        lowest = min(lowest, *probs)
    always = sum(drawn[f"t-{i}"] for i in range(4))
    half = sum(drawn[f"t-{i}"] for i in range(4, 8))
    never = sum(drawn[f"t-{i}"] for i in range(8, 12))
    print("draws over the run: always solved", always, "half solved", half, "never solved", never,
          "lowest probability", round(lowest, 4), "floor / N", round(floor / n, 4))
    assert always < half / 2 and never < half / 2
    assert min(drawn.values()) > 0                                      # nobody starves
    assert lowest >= floor / n - 1e-12
    assert lowest < 1 / n                                               # the sampler did move away from uniform
    totals = stream.step_metrics([_episode("t-4", True, "t-4@100"), _episode("t-4", False, "t-4@100")])
    assert totals["task/t/success_rate"] == 0.5 and totals["task/t/groups"] == 1.0


def test_a_resumed_stream_draws_what_the_uninterrupted_one_draws():
    def make():
        return MixtureStream({"a": _instances("a", 6), "b": _instances("b", 6)}, {"a": 1.0, "b": 1.0}, seed=3,
                             sampler="difficulty")

    straight, resumed = make(), make()
    for s in (straight, resumed):
        for step in range(1, 4):
            batch = s.next(4)
            s.observe([_episode(i.task_id, i.task_id.endswith(("0", "1")), f"{i.task_id}@{step}") for i in batch],
                      step)
    again = make()
    again.load_state_dict(resumed.state_dict())
    assert [i.task_id for i in straight.next(8)] == [i.task_id for i in again.next(8)]


def test_a_groups_launch_step_comes_from_its_id():
    assert [launch_step(g) for g in ("calc-1@12", "calc-1@12.1", "calc-1@12.s1", "calc-1@12r", "x@eval")] == \
        [12, 12, 12, 12, None]
