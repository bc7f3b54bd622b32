"""Suites and their metrics: pass@k against an enumeration of every k-subset, the suite's hash and its
one-line errors, and the disjointness check that refuses a suite overlapping a run's training split."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from hybridrl.evaluate.metrics import pass_at_k, sampling_metrics, suite_metrics
from hybridrl.evaluate.suite import SuiteError, load_suite, seed_list

SUITE = Path(__file__).with_name("mix_tiny.yaml")


def enumerated_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the samples holding at least one success (what the unbiased
    estimator computes in closed form)."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_success(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(n, 0, n + 1)


def _records(outcomes: dict[str, list[int]], sampling: str = "sampled", task: str = "calculator") -> list[dict]:
    return [{"task_id": tid, "task": task, "sampling": sampling, "attempt": a, "correct": float(c),
             "reward": float(c), "status": "completed", "tool_calls": a % 2, "response_tokens": 10 + a}
            for tid, cs in outcomes.items() for a, c in enumerate(cs)]


def test_a_samplings_metrics_average_per_instance_and_skip_k_above_the_samples():
    outcomes = {"a": [1, 0, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0], "d": [0, 1, 0, 1]}
    m = sampling_metrics(_records(outcomes), pass_k=[1, 2, 4, 8], metrics=["accuracy", "pass@k", "tool_calls",
                                                                         "length"], samples=4)
    for k in (1, 2, 4):
        independent = statistics.fmean(enumerated_pass_at_k([bool(x) for x in cs], k) for cs in outcomes.values())
        assert m[f"pass@{k}"] == pytest.approx(independent)
    assert "pass@8" not in m                       # 8 > 4 samples: no unbiased estimate
    assert m["accuracy"] == pytest.approx(7 / 16)
    assert m["pass@1"] == pytest.approx(m["accuracy"])   # equal samples per instance: pass@1 is the accuracy
    assert m["tool_call_rate"] == 0.5 and m["length"] == 11.5 and m["status/completed"] == 16


def test_suite_metrics_split_by_sampling_and_by_task():
    suite = load_suite(SUITE)
    records = (_records({"x": [1]}, "greedy") + _records({"g": [0]}, "greedy", task="guess_number")
               + _records({"x": [1, 1, 0, 0]}) + _records({"g": [0, 0, 0, 1]}, task="guess_number"))
    m = suite_metrics(suite, records)
    assert m["sampling"]["greedy"]["accuracy"] == 0.5 and "pass@2" not in m["sampling"]["greedy"]
    assert m["sampling"]["sampled"]["pass@2"] == pytest.approx((1 - 1 / 6 + 0.5) / 2)
    assert m["per_task"]["guess_number"]["sampled"]["pass@4"] == 1.0
    assert m["per_task"]["calculator"]["greedy"]["accuracy"] == 1.0


def test_a_suite_is_hashed_over_its_definition(tmp_path):
    suite = load_suite(SUITE)
    assert suite.name == "mix_tiny" and suite.tasks() == ["calculator", "guess_number"]
    assert len(suite.instances()) == 8
    text = SUITE.read_text()
    other = tmp_path / "other.yaml"
    other.write_text(text.replace("size: 4}", "size: 3}", 1))
    assert load_suite(other).hash != suite.hash
    same = tmp_path / "same.yaml"
    same.write_text("# a comment changes nothing\n" + text)
    assert load_suite(same).hash == suite.hash
    assert seed_list("0-2,5") == [0, 1, 2, 5]


@pytest.mark.parametrize("edit, message", [
    (("pass_k:", "pass_kk:"), "unknown key 'pass_kk'; did you mean 'pass_k'"),
    (("split: validation, seeds", "split: test, seeds"), "split"),
    (("samples: 1}", "samples: 3}"), "greedy samples of one instance are the same episode"),
    (("max_turns: 3", "max_turn: 3"), "agent.max_turn"),
    (("task: calculator", "task: calculatr"), "calculatr"),
])
def test_a_bad_suite_is_refused_in_one_line_naming_the_file_and_key(tmp_path, edit, message):
    path = tmp_path / "bad.yaml"
    path.write_text(SUITE.read_text().replace(*edit, 1))
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SuiteError, match="no suite 'mix_tin'"):
        load_suite("mix_tin")


def test_infra_invalid_and_aborted_episodes_are_not_failures_and_their_counts_are_logged():
    """Before: an engine or tool failure in an evaluation counted as a wrong answer (accuracy 0.5 here instead
    of 1.0), and the status counts were dropped from what `flat` logs."""
    from hybridrl.evaluate.metrics import flat

    records = _records({"a": [1, 1], "b": [1, 1]})
    records[1]["status"], records[1]["correct"] = "infra_invalid", 0.0
    records[3]["status"], records[3]["correct"] = "aborted", 0.0
    m = sampling_metrics(records, pass_k=[1, 2], metrics=["accuracy", "pass@k", "reward"], samples=2)
    assert m["accuracy"] == 1.0 and m["reward"] == 1.0 and m["pass@1"] == 1.0
    assert "pass@2" not in m and m["pass@2_instances"] == 0.0       # no instance has 2 scored samples
    assert m["scored"] == 2.0 and m["episodes"] == 4.0
    logged = flat({"sampling": {"sampled": m}}, "eval")
    assert logged["eval/sampled/status/infra_invalid"] == 1.0 and logged["eval/sampled/status/aborted"] == 1.0


def test_validation_leaves_infra_invalid_episodes_out_of_accuracy():
    from hybridrl.controller.metrics import validation_metrics
    from hybridrl.data.trajectory import Trajectory, TrajectoryStatus

    def episode(i, correct, status=TrajectoryStatus.COMPLETED):
        return Trajectory(run_id="r", task_id=f"t{i}", group_id=f"t{i}@0", attempt=0, prompt_ids=[1],
                          response_ids=[2], response_mask=[1], behavior_logprobs=[0.0], policy_versions=[0],
                          reward=correct, rewards={"correct": correct}, status=status)

    out = validation_metrics([episode(0, 1.0), episode(1, 0.0, TrajectoryStatus.INFRA_INVALID), episode(2, 1.0)])
    assert out["val/accuracy"] == 1.0 and out["val/scored"] == 2.0 and out["val/episodes"] == 3
    assert out["val/status/infra_invalid"] == 1.0 and out["val/status/completed"] == 2.0
