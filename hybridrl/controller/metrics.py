"""What the RL loop measures each step (stage times, effective yield, filter reasons, policy lag, mismatch), as flat scalar dicts."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Sequence

from hybridrl.algo.filters import FilterResult, informative_groups
from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import Trajectory

# the switch's named phases as the links report them, each timed on rank 0 (their sum is the timed part of T_sync)
SWITCH_PHASES = ("switch/offload_s", "switch/publish_s", "switch/wake_s", "switch/probe_s", "switch/sleep_s",
                 "switch/reload_s", "switch/arrival_rollout_s", "switch/arrival_train_s")


def episode_rows(instances: Sequence[Any], group_size: int, step: int | str) -> Batch:
    """One row per episode: the instance, its attempt index and its group (samples of one prompt)."""
    rows = [(inst, a) for inst in instances for a in range(group_size)]
    return Batch(meta={"instance": [inst.to_dict() for inst, _ in rows], "attempt": [a for _, a in rows],
                       "group_id": [f"{inst.task_id}@{step}" for inst, _ in rows]})


def _score(t: Trajectory) -> float:
    """How well an episode solved its task: the `correct` reward term, else the whole reward."""
    return t.rewards.get("correct", t.reward)


def _accuracy(ts: Sequence[Trajectory]) -> float:
    scores = [_score(t) for t in ts]
    return sum(scores) / len(scores) if scores else 0.0


def signal_metrics(trajectories: list[Trajectory], kept: FilterResult) -> dict[str, float]:
    """What says whether a step can teach the policy anything (`controller/diagnosis.py`): groups, the
    admitted groups whose members scored differently, successes, the admitted rewards' spread."""
    admitted = [t.reward for t in kept.kept]
    return {"groups": float(len({t.group_id for t in trajectories})),
            "groups/informative": float(len(informative_groups(kept.kept))),
            "episodes/succeeded": float(sum(_score(t) > 0 for t in trajectories)),
            "reward/admitted_std": statistics.pstdev(admitted) if admitted else 0.0}


def step_metrics(trajectories: list[Trajectory], kept: FilterResult, batch: Batch | None, update: dict,
                 switch: dict, stages: dict[str, float], *, wall_s: float, world_size: int,
                 version: int, rollout_version: int) -> dict[str, float]:
    rewards = [t.reward for t in trajectories]
    policy_tokens = sum(t.num_policy_tokens for t in trajectories)
    admitted = int(batch["loss_mask"].sum()) if batch is not None else 0
    m: dict[str, float] = {
        "reward/mean": statistics.fmean(rewards), "reward/std": statistics.pstdev(rewards),
        "reward/accuracy": _accuracy(trajectories),
        "episodes": len(trajectories), "episodes/admitted": len(kept.kept),
        "episodes/agent_errors": float(sum("agent_error" in t.metadata for t in trajectories)),
        "tokens/generated": policy_tokens, "tokens/admitted": admitted,
        "episode/turns": statistics.fmean(t.turns for t in trajectories),
        "episode/tool_calls": statistics.fmean(len(t.tool_calls) for t in trajectories),
        "episode/with_tool_call": statistics.fmean(bool(t.tool_calls) for t in trajectories),
        "episode/response_tokens": statistics.fmean(len(t.response_ids) for t in trajectories),
        "time/step_s": wall_s, "policy/version": version,
        **signal_metrics(trajectories, kept),
    }
    for name in ("rollout", "reward", "prep", "train", "sync"):
        m[f"time/T_{name}"] = stages.get(name, 0.0)
    m["time/T_reward"] = sum(t.timings.get("reward_s", 0.0) for t in trajectories) / max(world_size, 1)
    for status, n in Counter(t.status.value for t in trajectories).items():
        m[f"status/{status}"] = n
    for reason, n in kept.counts.items():
        m[f"filter/{reason}"] = n
    versions = [v for t in trajectories for v in t.versions]
    # how far behind the policy the rollout asked for the sampled tokens are (a refused publication)
    m["policy/lag_max"] = float(rollout_version - min(versions)) if versions else 0.0
    m["gen/tokens_per_s"] = policy_tokens / stages["rollout"] if stages.get("rollout") else 0.0
    m["yield/tokens_per_s"] = admitted / wall_s if wall_s else 0.0       # effective yield Y (tokens / s)
    m["yield/tokens_per_device_s"] = admitted / (wall_s * world_size) if wall_s else 0.0
    for key, value in switch.items():
        if key.startswith(("switch/", "parity/", "publish/")):
            m[key] = float(value)
    # the part of T_sync no phase of the switch accounts for (dispatch, the controller's own waits)
    timed = sum(float(switch.get(key, 0.0)) for key in SWITCH_PHASES)
    m["switch/untimed_s"] = max(stages.get("sync", 0.0) - timed, 0.0) if timed else 0.0
    for key, value in update.items():     # the update's own scalars; mismatch/, passes/, time/ keep their names
        m[key if "/" in key else f"train/{key}"] = float(value)
    if "kl" in update:
        m["kl"] = float(update["kl"])
    if "loss" in update:
        m["loss"] = float(update["loss"])
    return m


def validation_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Over the scored episodes: INFRA_INVALID and ABORTED ones are not the policy's failures (counted as
    `val/status/<status>`, and `val/scored` is how many the means are over)."""
    judged = [t for t in trajectories if t.status.value not in ("infra_invalid", "aborted")]
    out = {"val/accuracy": _accuracy(judged),
           "val/reward": statistics.fmean(t.reward for t in judged) if judged else 0.0,
           "val/episodes": len(trajectories), "val/scored": float(len(judged)),
           "val/response_tokens": statistics.fmean(len(t.response_ids) for t in judged) if judged else 0.0,
           "val/tool_calls": statistics.fmean(len(t.tool_calls) for t in judged) if judged else 0.0}
    for status in sorted({t.status.value for t in trajectories}):
        out[f"val/status/{status}"] = float(sum(t.status.value == status for t in trajectories))
    return out


def engine_metrics(per_rank: list[dict], run) -> dict[str, float]:
    """Per-step deltas of the engines' cumulative counters, summed over ranks."""
    totals: Counter = Counter()
    for rank, stats in enumerate(per_rank):
        for key, value in stats["engine"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[f"engine/{key}"] += value
        for key, value in stats["agent"].items():
            totals[f"agent/{key}"] += value
        for name, series in (stats["engine"].get("latency") or {}).items():
            totals[f"latency/{name}@{rank}"] = series["count"]
    deltas = {k: v - run.counters.get(k, 0) for k, v in totals.items()}
    run.counters = dict(totals)
    keep = ("prefill_tokens", "prefix_hit_tokens", "decode_tokens", "preemptions", "episodes", "malformed_actions",
            "unauthorized_actions", "invalid_arguments", "tool_errors", "tool_calls",
            # the gateway of task.agent episodes (hybridrl/gateway/runner.py)
            "template_drift", "token_drift", "gateway_splits", "gateway_branches", "budget_refusals", "agent_errors",
            "sampling_overridden", "untrained_policy_tokens",
            "engine/steps", "step_time_s",      # the engines' busy time (cost accounting, the planner)
            # weights applied while requests ran (rollout.native.on_weight_update=continue)
            "updates_mid_request", "update_continued_requests", "update_recompute_tokens", "update_hold_s",
            "update_late_steps",
            # the replica pool (rollout.engine=replicas)
            "replicas_lost", "replicas_joined", "requests_resubmitted", "tokens_resumed")
    out = {k: float(v) for k, v in deltas.items() if any(k.endswith(s) for s in keep)}
    out.update(generation_latency(per_rank, deltas, totals))
    # the tool sandbox's isolation (root | userns | none): ranks running in each mode, every step
    for stats in per_rank:
        mode = (stats.get("sandbox") or {}).get("isolation")
        if mode:
            out[f"sandbox/isolation_{mode}"] = out.get(f"sandbox/isolation_{mode}", 0.0) + 1.0
    return out


def generation_latency(per_rank: list[dict], deltas: dict, totals: dict) -> dict[str, float]:
    """`gen/` percentiles of the samples the engines recorded since the last read (an engine that reports
    `stats()["latency"]`, e.g. the native one): time to first token and inter-token latency (p50, p90, s),
    the mean sequences per engine step and the mean running / max_num_seqs."""
    samples: dict[str, list[float]] = {}
    for rank, stats in enumerate(per_rank):
        for name, series in (stats["engine"].get("latency") or {}).items():
            key = f"latency/{name}@{rank}"
            new = deltas[key] if deltas[key] >= 0 else totals[key]     # < 0: a new engine counts from zero
            recent = series["recent"]
            samples.setdefault(name, []).extend(recent[max(len(recent) - new, 0):] if new else [])
    out: dict[str, float] = {}
    for name, label in (("ttft_s", "ttft"), ("itl_s", "itl")):
        if samples.get(name):
            out[f"gen/{label}_p50_s"] = percentile(samples[name], 50)
            out[f"gen/{label}_p90_s"] = percentile(samples[name], 90)
    for name in ("batch_size", "batch_utilisation"):
        if samples.get(name):
            out[f"gen/{name}"] = statistics.fmean(samples[name])
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default method)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
