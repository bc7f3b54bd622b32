"""An episode paused mid-turn, handed over at a checkpoint and taken back by a new collector (a resumed
process: a fresh engine, runner and loop) continues as a new segment of its turn, not from its prompt."""

from __future__ import annotations

import pickle

from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks import TaskInstance
from tests.agent.test_collector import LONG, _instance, _setup


def test_a_handed_over_episode_continues_in_a_new_process_as_a_new_segment(tokenizer):
    engine, loop, collector = _setup(tokenizer)
    slow = TaskInstance(task="calculator", task_id="slow", messages=({"role": "user", "content": "2 + 3? (take your time)"},),
                        reference="5", tools=("calculator",), metadata={})
    try:
        out, stats = collector.collect([(_instance("fast"), 0, "fast@1"), (slow, 0, "slow@1")], quorum=1, poll_s=0.01)
        assert [t.group_id for t in out] == ["fast@1"] and stats.interrupted == 1 and stats.live == 1
        held = pickle.loads(pickle.dumps(collector.hand_over()))     # what a checkpoint keeps
        assert collector.pending_groups() == [] and not collector.live
    finally:
        collector.close()
        loop.close()
    [group] = held
    [saved] = group.saved
    assert group.group_id == "slow@1" and group.expected == 1 and not group.ended and not group.again
    kept = saved.traj.response_ids + [t for s in saved.turn.segments for t in s.token_ids]
    assert kept and saved.turn.segment == 1 and saved.policy_tokens == len(kept)

    engine2, loop2, collector2 = _setup(tokenizer)                   # the resumed process
    try:
        loop2.run_until_complete(engine2.update_weights([], 1))
        out2, _ = collector2.collect([], quorum=1, poll_s=0.01, held=held)
    finally:
        collector2.close()
        loop2.close()
    [t] = out2
    assert t.trajectory_id == saved.traj.trajectory_id and t.status == S.COMPLETED and t.reward == 1.0
    assert t.metadata["restored"] == 1 and t.metadata["interruptions"] == 1
    # the whole reply, exactly once: the saved tokens, then the rest from the new process's engine
    assert t.response_ids == list(tokenizer.encode(LONG, add_special_tokens=False)) + engine.eos_token_ids
    assert t.response_ids[:len(kept)] == kept
    k = len(kept)
    assert t.policy_versions == [0] * k + [1] * (len(t.response_ids) - k)          # two segments, in order
    [request] = engine2.requests                                     # continued, not generated from the prompt
    assert request.input_ids == t.prompt_ids + kept and request.request_id.endswith("/t0.1")
