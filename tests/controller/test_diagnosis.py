"""The dead-run diagnosis from what steps counted: each cause, the streak it needs, saying it once, and
the stop `trainer.stop_after_dead_steps` asks for."""

from __future__ import annotations

from hybridrl.controller.diagnosis import SignalWatch, diagnose, explain


def row(step, *, informative=0, episodes=128, succeeded=0, truncated=0, infra=0, std=0.0):
    return {"step": step, "episodes": episodes, "groups/informative": informative, "episodes/succeeded": succeeded,
            "filter/truncated": truncated, "filter/infra_invalid": infra, "reward/admitted_std": std}


def test_each_cause_names_what_was_counted_and_what_to_change():
    never = explain([row(s) for s in range(1, 9)])
    assert never.cause == "never" and never.text.startswith("no learning signal in steps 1-8: no sample succeeded "
                                                            "in 1024 episodes: the policy never solves the task")
    for fix in ("sft.steps", "task.sft_tool_use_fraction", "task.format_weight", "trainer.dynamic_sampling"):
        assert fix in never.text
    always = explain([row(s, succeeded=128) for s in (4, 5, 6)])
    assert always.cause == "always" and "every sample already succeeds (384 of 384 episodes): nothing left to learn" \
        in always.text and always.text.startswith("no learning signal in steps 4-6")
    alike = explain([row(1, succeeded=40)])
    assert alike.cause == "equal_groups" and "40 of 128 episodes succeeded" in alike.text and "trainer.group_size" \
        in alike.text and alike.text.startswith("no learning signal in step 1:")
    assert explain([row(1, truncated=120, succeeded=3)]).cause == "truncated"
    assert "agent.max_response_tokens" in explain([row(1, truncated=64)]).text
    assert explain([row(1, infra=100, truncated=100)]).cause == "infra_invalid"


def test_a_diagnosis_needs_three_dead_steps_in_a_row():
    assert diagnose([row(1), row(2)]) is None
    assert diagnose([row(1), row(2, informative=3), row(3), row(4)]) is None
    found = diagnose([row(0), row(1, informative=2), row(2), row(3), row(4), row(5, informative=1)])
    assert (found.first_step, found.last_step, found.episodes) == (2, 4, 384)
    assert diagnose([row(1), row(2), row(3)], min_steps=3).cause == "never"
    assert diagnose([{"step": 1, "episodes": 4}] * 5) is None           # a run from before the counts: nothing said
    # with a critic (GAE) the signal is any spread of the admitted rewards
    assert diagnose([row(s, std=0.0, informative=1) for s in (1, 2, 3)], group_baseline=False).cause == "never"
    assert diagnose([row(s, std=0.1) for s in (1, 2, 3)], group_baseline=False) is None


def test_the_watch_says_it_once_and_asks_to_stop_when_told():
    said = []
    watch = SignalWatch(group_baseline=True, total_steps=20, stop_after=5, say=said.append)
    watch.on_start({"earlier_metrics": [row(0), row(1)]})        # a resumed run keeps counting its streak
    for step in range(2, 6):
        assert watch.stop_reason is None
        watch.on_step(step, row(step))
    assert said == ["rl: " + explain([row(s) for s in (1, 2, 3)]).text]
    assert watch.stop_reason.startswith("5 steps in a row without a learning signal (trainer.stop_after_dead_steps=5): "
                                        "no learning signal in steps 1-5")
    short = SignalWatch(group_baseline=True, total_steps=2, say=said.append)
    short.on_start({})
    short.on_step(1, row(1))
    short.on_step(2, row(2))
    assert said[-1].startswith("rl: no learning signal in steps 1-2") and short.stop_reason is None


def test_agent_errors_are_named_and_a_run_whose_every_episode_fails_is_a_failed_run():
    """An agent's own errors are called agent errors (not infrastructure faults), and N steps in a row whose
    every episode was an agent error or an infrastructure fault make the run fail (trainer.stop_after_failed_steps)."""
    def failing(step, agent_errors=128, infra=0):
        return {**row(step, infra=infra), "episodes/agent_errors": agent_errors, "status/infra_invalid": infra}

    named = explain([failing(s) for s in (1, 2, 3)])
    assert named.cause == "agent_errors" and "384 of 384 episodes ended in an agent error" in named.text
    watch = SignalWatch(group_baseline=True, total_steps=20, fail_after=3, say=lambda text: None)
    watch.on_start({})
    watch.on_step(1, failing(1))
    watch.on_step(2, failing(2, agent_errors=100, infra=28))          # agent errors and faults together: all failed
    watch.on_step(3, {**failing(3, agent_errors=127), "episodes/succeeded": 1})   # one episode trained: the streak ends
    assert watch.fail_reason is None
    for step in (4, 5, 6):
        watch.on_step(step, failing(step))
    assert watch.fail_reason.startswith("every episode of the last 3 steps failed (trainer.stop_after_failed_steps=3)")
    assert "agent error" in watch.fail_reason
    never = SignalWatch(group_baseline=True, total_steps=20, fail_after=0, say=lambda text: None)
    for step in range(1, 8):
        never.on_step(step, failing(step))
    assert never.fail_reason is None
