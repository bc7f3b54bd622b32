"""A suite's metrics, computed from its per-episode records (one dict per episode; see `runner.record_of`).

    accuracy     mean of the `correct` reward component (the task's reward when it has none), over
                 every episode of the sampling: what training's validation reports
    pass@k       the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
                 on Code", eq. 1): per instance with n samples of which c succeed,
                 1 - C(n - c, k) / C(n, k), averaged over instances; k <= n
    reward       mean total reward
    tool_calls   mean tool calls per episode, and `tool_call_rate`: episodes with at least one
    length       mean response tokens per episode (policy and observation tokens after the prompt)

An episode succeeds when its `correct` value is > 0 (the tasks' verifiers score 0 or 1). Episodes
that say nothing about the policy, INFRA_INVALID (an engine, tool or reward failure) and ABORTED
(cancelled), are left out of accuracy, pass@k, reward, tool calls and length, as training leaves
them out of its groups: they are counted as `status/<status>` (logged), and `scored` is the number
of episodes the metrics are over. pass@k is over the instances with at least k scored samples
(`pass@k_instances` says how many, when some have fewer).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, c of them
    correct, is correct: 1 - C(n-c, k) / C(n, k) (exact integers, then one division)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n} samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


UNSCORED = ("infra_invalid", "aborted")


def scored(records: Iterable[dict]) -> list[dict]:
    """The episodes that score the policy (not INFRA_INVALID or ABORTED)."""
    return [r for r in records if r.get("status") not in UNSCORED]


def successes(records: Iterable[dict]) -> dict[str, tuple[int, int]]:
    """instance id -> (samples n, successes c)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        nc = out[r["task_id"]]
        nc[0] += 1
        nc[1] += r["correct"] > 0
    return {k: (n, c) for k, (n, c) in out.items()}


def sampling_metrics(records: Sequence[dict], *, pass_k: Sequence[int], metrics: Sequence[str],
                     samples: int) -> dict[str, float]:
    """The metrics of one sampling over `records` (its episodes)."""
    if not records:
        return {}
    out: dict[str, float] = {"episodes": float(len(records)),
                             "instances": float(len({r["task_id"] for r in records}))}
    for status in sorted({r["status"] for r in records}):
        out[f"status/{status}"] = float(sum(r["status"] == status for r in records))
    judged = scored(records)
    out["scored"] = float(len(judged))
    if not judged:
        return out
    if "accuracy" in metrics:
        out["accuracy"] = statistics.fmean(r["correct"] for r in judged)
    if "pass@k" in metrics:
        out.update(_pass_at(judged, pass_k, samples))
    if "reward" in metrics:
        out["reward"] = statistics.fmean(r["reward"] for r in judged)
    if "tool_calls" in metrics:
        out["tool_calls"] = statistics.fmean(r["tool_calls"] for r in judged)
        out["tool_call_rate"] = statistics.fmean(float(r["tool_calls"] > 0) for r in judged)
    if "length" in metrics:
        out["length"] = statistics.fmean(r["response_tokens"] for r in judged)
    return out


def _pass_at(judged: Sequence[dict], pass_k: Sequence[int], samples: int) -> dict[str, float]:
    """pass@k over the instances with at least k scored samples (and how many, when not all have)."""
    out: dict[str, float] = {}
    per_instance = list(successes(judged).values())
    for k in pass_k:
        if not 1 < samples or k > samples:
            continue
        eligible = [(n, c) for n, c in per_instance if n >= k]
        if eligible:
            out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for n, c in eligible)
        if len(eligible) < len(per_instance):
            out[f"pass@{k}_instances"] = float(len(eligible))
    return out


def suite_metrics(suite: Any, records: Sequence[dict]) -> dict[str, Any]:
    """{sampling name: metrics} over the whole suite, and {task: {sampling: metrics}} per task."""
    spec = suite.spec
    by_sampling: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_sampling[r["sampling"]].append(r)
    overall, per_task = {}, defaultdict(dict)
    for s in spec.sampling:
        rows = by_sampling.get(s.name, [])
        overall[s.name] = sampling_metrics(rows, pass_k=spec.pass_k, metrics=spec.metrics, samples=s.samples)
        tasks = sorted({r["task"] for r in rows})
        if len(tasks) > 1:
            for task in tasks:
                per_task[task][s.name] = sampling_metrics([r for r in rows if r["task"] == task], pass_k=spec.pass_k,
                                                          metrics=spec.metrics, samples=s.samples)
    return {"sampling": overall, "per_task": dict(per_task)}


def flat(result_metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    """`{prefix}/{sampling}/{metric}` scalars (what metrics.jsonl and TensorBoard take)."""
    out = {}
    for sampling, values in result_metrics["sampling"].items():
        for key, value in values.items():        # status/<status> counts included
            out[f"{prefix}/{sampling}/{key}"] = float(value)
    for task, samplings in result_metrics.get("per_task", {}).items():
        for sampling, values in samplings.items():
            for key in ("accuracy", "reward"):
                if key in values:
                    out[f"{prefix}/{task}/{sampling}/{key}"] = float(values[key])
    return out
