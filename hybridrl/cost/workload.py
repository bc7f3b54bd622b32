"""The measured workload the planner works from: one episode distribution and the stage models.

    groups      the measured groups (samples of one prompt), each a list of episode shapes: per
                turn the prompt tokens the engine had to compute, the tokens it generated and the
                seconds the tool / environment took after it; the verifier's seconds, the reward,
                the status. Resampled whole, so a group keeps its reward spread (GRPO's filter).
    engine      one rank's engine step: base_s + per_seq_s x batch + per_prefill_token_s x the
                prompt tokens computed in the step, capped at max_batch sequences
    trainer     one update: base_s + per_token_s x admitted tokens / training ranks
    overheads   per step: sync (colocated mode switches), publish (disaggregated publication), prep,
                store, controller; validation seconds and cadence
    rollout_factor, launch_s  calibrated on a replay of the measured configuration: a factor on the
                engine model's step time and the event-loop seconds each launched episode costs before its
                first request (the agent loop's own work, scheduling, the host: what the engine counters
                leave out); the pair whose replay fits the measured per-step rollouts best

Every figure carries `how`: the formula and the records it came from.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence


@dataclass
class Turn:
    prompt_tokens: int        # tokens the engine computes before the turn's first new token
    generated: int            # policy tokens of the turn
    wait_s: float             # tool + environment seconds after the turn (0 for the last)


@dataclass
class EpisodeShape:
    turns: list[Turn]
    reward_s: float
    reward: float
    truncated: bool
    status: str
    task_id: str

    @property
    def policy_tokens(self) -> int:
        return sum(t.generated for t in self.turns)


@dataclass
class EngineModel:
    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    max_batch: int
    how: str = ""
    r2: float | None = None   # of the fitted model over the step rows it came from (None: not fitted to rows)
    rows: int = 0

    def step_s(self, batch: int, prefill_tokens: int = 0) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_prefill_token_s * prefill_tokens

    def tokens_per_s(self, batch: int) -> float:
        b = min(batch, self.max_batch)
        return b / self.step_s(b) if b else 0.0


@dataclass
class TrainerModel:
    base_s: float
    per_token_s: float        # seconds per admitted token on ONE training rank
    how: str = ""
    rel_error: float | None = None   # RMS residual / mean T_train over the rows it came from (None: not fitted)
    rows: int = 0

    def seconds(self, tokens: float, ranks: int) -> float:
        return self.base_s + self.per_token_s * tokens / max(ranks, 1)

    def tokens_per_s(self, ranks: int) -> float:
        return ranks / self.per_token_s if self.per_token_s > 0 else math.inf


@dataclass
class Overheads:
    sync_s: float = 0.0
    publish_s: float = 0.0
    prep_s: float = 0.0
    store_s: float = 0.0
    controller_s: float = 0.0
    validation_s: float = 0.0
    validate_every: int = 0
    checkpoint_s: float = 0.0
    checkpoint_every: int = 0
    how: dict[str, str] = field(default_factory=dict)

    def periodic(self, step: int) -> float:
        """Validation and checkpoint seconds due after `step`."""
        out = self.validation_s if self.validate_every and step % self.validate_every == 0 else 0.0
        return out + (self.checkpoint_s if self.checkpoint_every and step % self.checkpoint_every == 0 else 0.0)

    def per_step(self, placement: str) -> float:
        switch = self.sync_s if placement == "colocated" else self.publish_s
        val = self.validation_s / self.validate_every if self.validate_every else 0.0
        ckpt = self.checkpoint_s / self.checkpoint_every if self.checkpoint_every else 0.0
        return switch + self.prep_s + self.store_s + self.controller_s + val + ckpt


@dataclass
class MeasuredConfig:
    """The configuration the workload was measured under (what the planner compares against)."""

    placement: str = "colocated"
    world_size: int = 1
    rollout_ranks: int = 0
    rollout_mode: str = "sync"
    oversample: float = 1.0
    max_policy_lag: int = -1
    prompts_per_step: int = 1
    group_size: int = 1
    max_concurrent: int = 64
    drop_truncated: bool = True
    drop_all_equal_groups: bool = True


@dataclass
class Workload:
    groups: list[list[EpisodeShape]]
    engine: EngineModel
    trainer: TrainerModel
    overheads: Overheads
    measured: MeasuredConfig
    measured_step_s: float = 0.0
    measured_admitted_tokens_per_s: float = 0.0
    measured_rollout_s: float = 0.0
    rollout_factor: float = 1.0
    launch_s: float = 0.0     # the rank's event-loop seconds per launched episode (calibrated with the factor)
    name: str = "workload"
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        eps = [e for g in self.groups for e in g]
        lengths = [e.policy_tokens for e in eps]
        return {"name": self.name, "groups": len(self.groups), "episodes": len(eps),
                "policy_tokens": _dist(lengths), "turns": _dist([len(e.turns) for e in eps]),
                "wait_s_per_episode": _dist([sum(t.wait_s for t in e.turns) for e in eps]),
                "reward_mean": statistics.fmean(e.reward for e in eps) if eps else None,
                "engine": asdict(self.engine), "trainer": asdict(self.trainer), "overheads": asdict(self.overheads),
                "measured_config": asdict(self.measured), "measured_step_s": self.measured_step_s,
                "measured_admitted_tokens_per_s": self.measured_admitted_tokens_per_s,
                "rollout_factor": self.rollout_factor, "launch_s": self.launch_s, "notes": self.notes}


def _dist(xs: Sequence[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"n": len(s), "mean": statistics.fmean(s), "p50": s[len(s) // 2], "p90": s[int(len(s) * 0.9)],
            "max": s[-1]}


def shape_of(turn_events: Sequence[dict], prompt_tokens: int, timings: dict, reward: float, status: str,
             task_id: str, truncated: bool) -> EpisodeShape:
    """An episode's shape from its trace's turn events (`hybridrl.cost.records`)."""
    turns = []
    for i, e in enumerate(sorted(turn_events, key=lambda e: e.get("turn", 0))):
        computed = int(e.get("new_prompt_tokens", 0)) or (prompt_tokens if i == 0 else 0)
        turns.append(Turn(prompt_tokens=computed, generated=int(e.get("generated", 0)),
                          wait_s=float(e.get("tool_s", 0.0)) + float(e.get("env_s", 0.0))))
    if turns:
        turns[-1].wait_s = 0.0       # what follows the last turn is the reward, counted apart
    return EpisodeShape(turns=turns, reward_s=float(timings.get("reward_s", 0.0)), reward=reward,
                        truncated=truncated, status=status, task_id=task_id)


def shape_from_counts(*, prompt_tokens: int, policy_tokens: int, response_tokens: int, turns: int, timings: dict,
                      reward: float, status: str, task_id: str, truncated: bool) -> EpisodeShape:
    """An episode's shape from its ledger counts alone, for an episode whose trace has no turn events (a
    `task.agent` episode, run through the gateway): its policy tokens split evenly over its turns; the
    first turn computes the prompt, each later one its share of the response's other tokens (tool
    results, the template's); the seconds outside generation, the verifier and the queue (the agent's own
    work and its tools) are the waits between turns."""
    n = max(int(turns), 1) if policy_tokens > 0 else 0
    if n == 0:
        return EpisodeShape(turns=[], reward_s=float(timings.get("reward_s", 0.0)), reward=reward,
                            truncated=truncated, status=status, task_id=task_id)
    per, extra = divmod(int(policy_tokens), n)
    between = max(0, int(response_tokens) - int(policy_tokens)) / max(n - 1, 1)
    outside = sum(float(timings.get(k, 0.0)) for k in ("generate_s", "reward_s", "queue_s"))
    wait = max(0.0, float(timings.get("total_s", 0.0)) - outside) / max(n - 1, 1)
    shape = [Turn(prompt_tokens=int(prompt_tokens) if i == 0 else round(between),
                  generated=per + (1 if i < extra else 0), wait_s=wait if i < n - 1 else 0.0) for i in range(n)]
    return EpisodeShape(turns=shape, reward_s=float(timings.get("reward_s", 0.0)), reward=reward,
                        truncated=truncated, status=status, task_id=task_id)


# ---------------------------------------------------------------------------- fits


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares for the small fits here (2-3 unknowns): the best of the
    unconstrained least-squares solutions over every subset of free unknowns that is non-negative."""
    import itertools

    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    n = a.shape[1]
    best, best_res = [0.0] * n, float(np.sum(b ** 2))
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            z = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if np.any(z < 0):
                continue
            x = np.zeros(n)
            x[list(free)] = z
            res = float(np.sum((a @ x - b) ** 2))
            if res < best_res - 1e-15:
                best, best_res = list(x), res
    return best


def r_squared(rows: list[list[float]], ys: list[float], x: list[float]) -> float:
    pred = [sum(a * b for a, b in zip(r, x)) for r in rows]
    mean = statistics.fmean(ys)
    tot = sum((y - mean) ** 2 for y in ys)
    res = sum((y - p) ** 2 for y, p in zip(ys, pred))
    return 1.0 - res / tot if tot > 0 else 1.0


def fit_engine(rows: Sequence[dict], *, ranks: int, max_batch: int) -> EngineModel:
    """Engine step model from per-step engine counters summed over `ranks` (metrics rows: engine/steps,
    engine/step_time_s, engine/decode_tokens, engine/prefill_tokens). Each engine step costs
    base + per_seq x its batch + per_prefill x its prompt tokens, so a step row's busy time is
    base x steps + per_seq x decode tokens + per_prefill x prefill tokens (non-negative least squares
    over the rows). Where the rows cannot tell base from per_seq apart (every step at about the same
    batch), the fit keeps base alone: the model then holds at the measured batch only."""
    data = [(float(r.get("engine/steps") or 0), float(r.get("engine/decode_tokens") or 0),
             float(r.get("engine/prefill_tokens") or 0), float(r.get("engine/step_time_s") or 0)) for r in rows]
    data = [d for d in data if d[0] > 0 and d[3] > 0]
    if not data:
        raise ValueError("no engine counters in the metrics (engine/steps, engine/step_time_s): the run predates "
                         "them, or its engine does not report them; use `hybridrl plan --measure`")
    batches = [d[1] / d[0] for d in data]
    spread = (max(batches) - min(batches)) / max(statistics.fmean(batches), 1e-9)
    xs, ys = [[d[0], d[1], d[2]] for d in data], [d[3] for d in data]
    base, per_seq, per_pre = nnls(xs, ys)
    how = (f"NNLS over {len(data)} step rows of busy = base x steps + per_seq x decode tokens + per_prefill x "
           f"prefill tokens (engine counters summed over {ranks} rank(s)); mean batch {statistics.fmean(batches):.1f}"
           f" (spread {100 * spread:.0f}%)")
    if spread < 0.15 or base <= 0:
        total_steps = sum(d[0] for d in data)
        pre = per_pre if per_pre > 0 else 0.0
        base = (sum(d[3] for d in data) - pre * sum(d[2] for d in data)) / total_steps
        per_seq = 0.0
        how += "; batch spread too small to separate base and per_seq: base = mean step time, per_seq = 0"
    r2 = r_squared(xs, ys, [base, per_seq, per_pre])         # of the model kept, over the rows it came from
    return EngineModel(base_s=base, per_seq_s=per_seq, per_prefill_token_s=per_pre, max_batch=max_batch,
                       how=f"(R^2 {r2:.2f}) " + how, r2=r2, rows=len(data))


def fit_trainer(rows: Sequence[dict], *, ranks: int, key: str = "time/T_train",
                tokens_key: str = "tokens/admitted") -> TrainerModel:
    """T_train = base + per_token x tokens / ranks (data parallel: a training rank's time follows its
    share of the tokens). Three models are fitted to the step rows, a constant (base only), a
    proportional one (per_token only) and both (non-negative least squares), and the one with the
    lowest BIC kept, unless the steps' tokens vary by less than 50% (they cannot tell a fixed cost
    from a per-rank one) or the constant and the proportional one fit alike: then the proportional
    one, which is conservative for fewer ranks."""
    import math as _m

    data = [(float(r.get(tokens_key) or 0), float(r.get(key) or 0)) for r in rows]
    data = [d for d in data if d[0] > 0 and d[1] > 0]
    if not data:
        return TrainerModel(base_s=0.0, per_token_s=0.0, how=f"no step with admitted tokens and {key}")
    n = len(data)
    xs, ys = [d[0] / ranks for d in data], [d[1] for d in data]

    def bic(pred: list[float], k: int) -> float:
        rss = max(sum((y - p) ** 2 for y, p in zip(ys, pred)), 1e-12)
        return n * _m.log(rss / n) + k * _m.log(n)

    const = statistics.fmean(ys)
    slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    b2, s2 = nnls([[1.0, x] for x in xs], ys)
    fits = {"constant": (const, 0.0, bic([const] * n, 1)),
            "proportional": (0.0, slope, bic([slope * x for x in xs], 1)),
            "both": (b2, s2, bic([b2 + s2 * x for x in xs], 2))}
    name = min(fits, key=lambda k: fits[k][2])
    spread = (max(xs) - min(xs)) / statistics.fmean(xs)
    why = "lowest BIC"
    if name != "proportional" and spread < 0.5:
        name, why = "proportional", (f"the steps' tokens spread {100 * spread:.0f}% (< 50%): too little to tell a "
                                     "fixed cost from one that follows the tokens per rank, so all of it follows them "
                                     "(conservative for fewer ranks); BIC")
    elif name == "constant" and fits["proportional"][2] - fits["constant"][2] < 2:
        name, why = "proportional", "constant and proportional fit alike (BIC within 2): proportional kept; BIC"
    base, per_token, _ = fits[name]
    rms = math.sqrt(sum((y - base - per_token * x) ** 2 for x, y in zip(xs, ys)) / n)
    rel = rms / statistics.fmean(ys)
    how = (f"{name} fit of {key} = base + per_token x {tokens_key} / {ranks} rank(s) over {n} step rows ({why} "
           + ", ".join(f"{k} {v[2]:.1f}" for k, v in fits.items()) + f"); residual {100 * rel:.0f}% of the mean")
    return TrainerModel(base_s=base, per_token_s=per_token, how=how, rel_error=rel, rows=n)


def median(rows: Sequence[dict], key: str) -> float:
    xs = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else 0.0
