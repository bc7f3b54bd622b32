"""Cost accounting of one run: every device-second of its wall time assigned to a stage or to idle.

The books are built on the controller's clock (`clock.jsonl`: launch, start, each step, each
checkpoint, finish, end) and the step rows of `metrics.jsonl`, and split further with what each
stage measured. One device = one rank. Colocated, every rank does every stage in turn (SPMD), so a
stage's wall seconds x ranks are its device-seconds; work only the controller (rank 0) does (prep:
filtering and packing; store: the ledger; logging) keeps rank 0 busy and the other ranks idle.

    startup      [launch, rank process start]: preflight and torchrun; [rank start, loop ready]:
                 imports, model load, worker group, checkpoint restore
    sync         the mode switches' phases: switch/{sleep,reload,offload,publish,wake}_s; the rest
                 "sync/other" (the parity probe after a publication, the calls themselves)
    rollout      engine/step_time_s (the engines' busy time, summed over ranks) split into
                 prefill and decode by the requests' own prefill/decode seconds (ledger trace);
                 reward (the verifiers' seconds, time/T_reward); the rest of the rollout the
                 engine did not step: "idle/rollout_wait" (waiting on tools, the environment, the
                 other ranks' stragglers, the agent loop's own work)
    prep, store  rank 0; the other ranks "idle/controller"
    train        time/T_ref, T_old, T_adv, T_critic, T_update (the workers' own timers); the rest
                 of time/T_train "train/dispatch" (the batch and the lineage crossing to the ranks)
    eval         val/seconds of each validation, all ranks
    checkpoint   [checkpoint, checkpoint_end], all ranks
    export       [finish, end]: the HF export, closing the workers, the summary
    shutdown     [end, exit, released]: the worker group's shutdown, the ranks' teardown, torchrun's exit
    controller   what remains of a step's span once the above are taken (metrics, counters,
                 logging): rank 0, the other ranks "idle/controller"
    lost         a killed attempt's steps that a resumed attempt did again, and its last step

Disaggregated, the controller's clock times the training ranks; a step's rollout there is the
training ranks waiting for their groups ("idle/waiting_for_rollout"). The rollout ranks' whole
loop time splits into engine busy time, their measured idle time (stream/rollout_idle_s) and the
rest ("rollout/agent": agent loops, tools, receiving weights).

Generation that never trained: each training trajectory's share of its step's rollout
device-seconds is its share of the step's policy tokens (a partial rollout's continued episode
counts in the step that returned it); the shares of the trajectories the
ledger says no update consumed add up by reason (its filter_reason: all_equal_group, truncated,
policy_lag, infra_invalid, aborted). Tokens the engines decoded that reached no trajectory in the
ledger (groups requeued as stale, dropped from a full queue, still in flight at the end) are
counted apart, from engine/decode_tokens.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.cost.records import RunRecords, read_run

_TRAIN_PARTS = (("ref_logprobs", "time/T_ref"), ("old_logprobs", "time/T_old"), ("advantages", "time/T_adv"),
                ("critic", "time/T_critic"), ("update", "time/T_update"))
# the mode switches' phases (workers/hybrid.py; publish_prepare/deliver_s are parts of publish_s)
_SYNC_PARTS = (("sleep", "switch/sleep_s"), ("reload", "switch/reload_s"), ("offload", "switch/offload_s"),
               ("publish", "switch/publish_s"), ("wake", "switch/wake_s"))


@dataclass
class Books:
    """Device-seconds by role and stage, and what they bought."""

    run_dir: str
    world_size: int
    roles: dict[str, int]                                  # role -> ranks
    wall_s: float                                          # launch of the first attempt .. end of the last
    device_s: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    attempts: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tokens: dict[str, float] = field(default_factory=dict)
    episodes: dict[str, Any] = field(default_factory=dict)
    never_trained: dict[str, dict[str, float]] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    device: str = "cpu"

    def add(self, role: str, stage: str, seconds: float) -> None:
        if seconds:
            self.device_s[role][stage] += seconds

    @property
    def total_device_s(self) -> float:
        return sum(v for stages in self.device_s.values() for v in stages.values())

    def stage_totals(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for stages in self.device_s.values():
            for stage, v in stages.items():
                out[stage] += v
        return dict(out)

    def group_totals(self) -> dict[str, float]:
        """Device-seconds by stage family (the part before '/'): rollout, train, sync, idle, ..."""
        out: dict[str, float] = defaultdict(float)
        for stage, v in self.stage_totals().items():
            out[stage.split("/")[0]] += v
        return dict(out)

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "world_size": self.world_size, "roles": self.roles, "device": self.device,
                "wall_s": self.wall_s, "device_s_total": self.total_device_s,
                "device_s_expected": self.wall_s * self.world_size,
                "device_s": {r: dict(s) for r, s in self.device_s.items()}, "by_stage": self.stage_totals(),
                "by_family": self.group_totals(), "attempts": self.attempts, "steps": self.steps,
                "tokens": self.tokens, "episodes": self.episodes, "never_trained": self.never_trained,
                "environment": self.environment, "stored_bytes": self.stored_bytes, "notes": self.notes}


def _f(row: dict | None, key: str) -> float:
    value = (row or {}).get(key)
    return float(value) if value is not None else 0.0


def _spans(marks: list[dict]) -> list[dict]:
    """The attempts of a run: each with its marks in order."""
    attempts: dict[int, list[dict]] = defaultdict(list)
    for m in marks:
        attempts[int(m.get("attempt", 1))].append(m)
    return [{"attempt": a, "marks": sorted(ms, key=lambda m: m["at"])} for a, ms in sorted(attempts.items())]


class _Ledger:
    """Assigns the wall time of one attempt to (role, stage) with the attempt's metrics rows."""

    def __init__(self, books: Books, rec: RunRecords):
        self.books, self.rec = books, rec
        self.disaggregated = rec.placement["mode"] == "disaggregated"
        w = rec.world_size
        self.n_rollout = rec.placement["rollout_ranks"] if self.disaggregated else 0
        self.n_train = w - self.n_rollout
        self.train_role = "train" if self.disaggregated else "hybrid"
        self.prefill_share = self._prefill_share()

    def _prefill_share(self) -> float:
        pre = sum(e.prefill_s for e in self.rec.episodes)
        dec = sum(e.decode_s for e in self.rec.episodes)
        return pre / (pre + dec) if pre + dec > 0 else 0.0

    # -- spans of the training ranks (every rank when colocated) --------------------------------

    def all_ranks(self, stage: str, seconds: float) -> None:
        self.books.add(self.train_role, stage, seconds * self.n_train)
        if self.n_rollout:
            self.rollout_span(stage, seconds)

    def rollout_span(self, stage: str, seconds: float) -> None:
        """Disaggregated: a span the rollout ranks spend in `stage` too (start-up, validation, ...)."""
        self.books.add("rollout", stage, seconds * self.n_rollout)

    def controller(self, stage: str, seconds: float) -> None:
        """Work of rank 0 alone: the other training ranks wait for it."""
        self.books.add(self.train_role, stage, seconds)
        self.books.add(self.train_role, "idle/controller", seconds * (self.n_train - 1))

    def step(self, row: dict, span_s: float) -> float:
        """A step's row over its span [step mark, next mark]; returns the seconds assigned on rank 0."""
        stages = {s: _f(row, f"time/T_{s}") for s in ("sync", "rollout", "prep", "train")}
        step_s = _f(row, "time/step_s")
        n = self.n_train
        # sync: the switches' phases
        parts = defaultdict(float)
        for name, key in _SYNC_PARTS:
            parts[name] += _f(row, key)
        used = min(sum(parts.values()), stages["sync"])
        scale = used / sum(parts.values()) if sum(parts.values()) else 0.0
        for name, v in parts.items():
            self.books.add(self.train_role, f"sync/{name}", v * scale * n)
        self.books.add(self.train_role, "sync/other", (stages["sync"] - used) * n)
        # rollout
        if self.disaggregated:
            self.books.add("train", "idle/waiting_for_rollout", stages["rollout"] * n)
        else:
            rollout_ds = stages["rollout"] * n
            engine = min(_f(row, "engine/step_time_s"), rollout_ds)
            reward = min(_f(row, "time/T_reward") * n, rollout_ds - engine)
            self.books.add("hybrid", "rollout/prefill", engine * self.prefill_share)
            self.books.add("hybrid", "rollout/decode", engine * (1 - self.prefill_share))
            self.books.add("hybrid", "rollout/reward", reward)
            self.books.add("hybrid", "idle/rollout_wait", rollout_ds - engine - reward)
        # prep: the controller filters and packs
        self.controller("prep", stages["prep"])
        # train: the workers' own timers
        parts_t = {name: _f(row, key) for name, key in _TRAIN_PARTS}
        used = min(sum(parts_t.values()), stages["train"])
        scale = used / sum(parts_t.values()) if sum(parts_t.values()) else 0.0
        for name, v in parts_t.items():
            self.books.add(self.train_role, f"train/{name}", v * scale * n)
        self.books.add(self.train_role, "train/dispatch", (stages["train"] - used) * n)
        # the rest of step_s: metrics and counters on the controller
        inside = sum(stages.values())
        self.controller("controller", max(0.0, step_s - inside))
        assigned = max(step_s, inside)
        val = _f(row, "val/seconds")
        self.all_ranks("eval", val)
        store = _f(row, "time/T_store")
        self.controller("store", store)
        assigned += val + store
        rest = span_s - assigned
        if rest < 0:
            self.books.notes.append(f"step {row['step']}: its timers add up to {assigned:.2f}s, its span on the clock "
                                    f"is {span_s:.2f}s (clock marks and timers disagree by {-rest:.2f}s)")
            rest = 0.0
        self.controller("controller", rest)
        return span_s

    def lost(self, seconds: float, why: str) -> None:
        self.all_ranks(f"lost/{why}", seconds)


def _attempt_books(books: Books, rec: RunRecords, attempt: dict, redone_after: int | None) -> None:
    """Assign one attempt's wall time. `redone_after`: the step the next attempt resumed from (the
    steps after it, and an unfinished last step, were done again and count as lost)."""
    acc = _Ledger(books, rec)
    marks = attempt["marks"]
    start = next((m for m in marks if m["mark"] == "start"), None)
    if start is None:
        books.notes.append(f"attempt {attempt['attempt']}: no start mark (ignored)")
        return
    launched = start.get("launched_at") or start["at"]
    rank_start = start.get("rank_started_at") or launched
    acc.all_ranks("startup/launch", max(0.0, rank_start - launched))
    acc.all_ranks("startup/ranks", max(0.0, start["at"] - max(rank_start, launched)))
    ended = marks[-1]["mark"] in ("end", "exit", "released")
    summary = {"attempt": attempt["attempt"], "from_step": start.get("step", 0), "launched_at": launched,
               "last_mark_at": marks[-1]["at"], "finished": ended, "wall_s": marks[-1]["at"] - launched}
    books.attempts.append(summary)
    if not ended:
        books.notes.append(f"attempt {attempt['attempt']} stopped after its last mark ({marks[-1]['mark']} "
                           f"{marks[-1].get('step')}): the time after it is not on the clock")
    for i, m in enumerate(marks):
        nxt = marks[i + 1] if i + 1 < len(marks) else None
        if nxt is None:
            break
        span = nxt["at"] - m["at"]
        kind, step = m["mark"], m.get("step")
        if kind == "start":                      # the initial validation (a fresh run) and its log
            row0 = rec.row(0) if step == 0 else None
            val = _f(row0, "val/seconds") if row0 else 0.0
            acc.all_ranks("eval", min(val, span))
            acc.controller("controller", max(0.0, span - val))
        elif kind == "step":
            lost = redone_after is not None and step > redone_after
            row = rec.row(step) if not lost else None
            complete = nxt["mark"] in ("step", "checkpoint", "finish")
            if row is None or not complete:
                acc.lost(span, "redone" if lost or row is None else "unfinished")
            else:
                acc.step(row, span)
        elif kind == "checkpoint":
            acc.all_ranks("checkpoint", span) if nxt["mark"] == "checkpoint_end" else acc.lost(span, "unfinished")
        elif kind == "checkpoint_end":
            acc.controller("controller", span)
        elif kind == "finish":
            acc.all_ranks("export", span)
        elif kind in ("end", "exit"):            # worker group shutdown, interpreter teardown, torchrun's exit
            acc.all_ranks("shutdown", span)


def _rollout_ranks(books: Books, rec: RunRecords) -> None:
    """Disaggregated: split the rollout ranks' loop time (everything not yet assigned to them)."""
    n = rec.placement["rollout_ranks"]
    expected = books.wall_s * n
    assigned = sum(books.device_s["rollout"].values())
    loop = max(0.0, expected - assigned)
    rows = rec.step_rows()
    idle = min(loop, sum(_f(r, "stream/rollout_idle_s") for r in rows))
    engine = min(loop - idle, sum(_f(r, "engine/step_time_s") for r in rows))
    pre = _Ledger(books, rec).prefill_share
    books.add("rollout", "idle/rollout_ranks", idle)
    books.add("rollout", "rollout/prefill", engine * pre)
    books.add("rollout", "rollout/decode", engine * (1 - pre))
    books.add("rollout", "rollout/agent", loop - idle - engine)
    books.notes.append("disaggregated: the rollout ranks' loop time = engine busy + measured idle "
                       "(stream/rollout_idle_s) + the rest (agent loops, tools, weight receipt)")


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _never_trained(books: Books, rec: RunRecords) -> None:
    """Rollout device-seconds and tokens of the trajectories no update consumed, by reason."""
    rollout_by_step: dict[int, float] = defaultdict(float)
    tokens_by_step: dict[int, int] = defaultdict(int)
    if "rollout" in books.roles:     # disaggregated: the rollout ranks' busy time, over every trajectory
        busy = sum(v for k, v in books.device_s["rollout"].items() if k.startswith("rollout/"))
        rollout_by_step[0] = busy
        for e in rec.episodes:
            tokens_by_step[0] += e.policy_tokens
        key = lambda e: 0  # noqa: E731
    else:                            # colocated: the step's rollout, all ranks
        for r in rec.step_rows():
            rollout_by_step[r["step"]] = _f(r, "time/T_rollout") * rec.world_size
        for e in rec.episodes:
            tokens_by_step[e.step] += e.policy_tokens
        key = lambda e: e.step  # noqa: E731
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"trajectories": 0, "policy_tokens": 0, "device_s": 0.0})
    for e in rec.episodes:
        reason = e.filter_reason or "trained"
        total = tokens_by_step[key(e)]
        share = e.policy_tokens / total if total else 0.0
        out[reason]["trajectories"] += 1
        out[reason]["policy_tokens"] += e.policy_tokens
        out[reason]["device_s"] += share * rollout_by_step.get(key(e), 0.0)
    decoded = sum(_f(r, "engine/decode_tokens") for r in rec.step_rows())
    in_ledger = sum(e.policy_tokens for e in rec.episodes)
    if decoded > in_ledger:
        out["never_returned"] = {"trajectories": 0, "policy_tokens": decoded - in_ledger, "device_s": 0.0,
                                 "requeued_episodes": sum(_f(r, "stale/requeued_episodes") for r in rec.step_rows()),
                                 "dropped_from_queue": sum(_f(r, "queue/dropped_trajectories") for r in rec.step_rows())}
    evals = books.stage_totals().get("eval", 0.0)
    out["validation"] = {"trajectories": sum(int(_f(r, "val/episodes")) for r in rec.rows),
                         "policy_tokens": sum(_f(r, "val/engine/decode_tokens") for r in rec.rows), "device_s": evals}
    books.never_trained = {k: dict(v) for k, v in out.items()}


def account(run_dir: str | Path, rec: RunRecords | None = None) -> Books:
    """The books of one run directory (all its attempts)."""
    rec = rec or read_run(run_dir)
    attempts = _spans(rec.marks)
    w = rec.world_size
    disagg = rec.placement["mode"] == "disaggregated"
    roles = ({"train": w - rec.placement["rollout_ranks"], "rollout": rec.placement["rollout_ranks"]}
             if disagg else {"hybrid": w})
    device = str(rec.config.get("distributed", {}).get("device", "cpu"))
    books = Books(run_dir=str(rec.run_dir), world_size=w, roles=roles, wall_s=0.0, device=device)
    if not attempts:
        books.notes.append("no clock.jsonl (a run from before the clock was recorded): only the step times are "
                           "known, start-up, validations and checkpoints are not")
        acc = _Ledger(books, rec)
        for r in rec.step_rows():
            acc.step(r, _f(r, "time/step_s") + _f(r, "val/seconds") + _f(r, "time/T_store"))
        books.wall_s = books.total_device_s / max(w, 1)
    else:
        for i, a in enumerate(attempts):
            nxt = attempts[i + 1] if i + 1 < len(attempts) else None
            redone_after = None
            if nxt is not None:
                start = next((m for m in nxt["marks"] if m["mark"] == "start"), None)
                redone_after = int(start.get("step", 0)) if start else None
            _attempt_books(books, rec, a, redone_after)
        books.wall_s = sum(a["wall_s"] for a in books.attempts)
        if disagg:
            _rollout_ranks(books, rec)
    rows = rec.step_rows()
    books.steps = len(rows)
    books.tokens = {"generated": sum(_f(r, "tokens/generated") for r in rows),
                    "admitted": sum(_f(r, "tokens/admitted") for r in rows),
                    "engine_decoded": sum(_f(r, "engine/decode_tokens") for r in rows),
                    "engine_prefilled": sum(_f(r, "engine/prefill_tokens") for r in rows)}
    eps = rec.episodes
    books.episodes = {"training": len(eps) if rec.has_ledger else int(sum(_f(r, "episodes") for r in rows)),
                      "admitted": sum(e.filter_reason is None for e in eps) if rec.has_ledger
                      else int(sum(_f(r, "episodes/admitted") for r in rows)),
                      "successes": sum(e.success for e in eps),
                      "admitted_successes": sum(e.success and e.filter_reason is None for e in eps),
                      "validation": int(sum(_f(r, "val/episodes") for r in rec.rows))}
    if rec.has_ledger:
        _never_trained(books, rec)
    tools: dict[str, int] = defaultdict(int)
    for e in eps:
        for name in e.tool_calls:
            tools[name] += 1
    books.environment = {
        "tool_s": sum(e.timings.get("tool_s", 0.0) for e in eps), "env_s": sum(e.timings.get("env_s", 0.0) for e in eps),
        "reward_s": sum(e.timings.get("reward_s", 0.0) for e in eps), "tool_calls": dict(tools),
        "validation_tool_calls": sum(_f(r, "val/agent/tool_calls") for r in rec.rows),
        "sandboxes": tools.get("python", 0),
        "note": "seconds the episodes spent in tools and environment steps (wall time of the calls, the CPU they "
                "hold); validation episodes are not in the ledger, only their tool-call count"}
    if rec.pruned_steps:
        books.notes.append(f"ledger retention deleted the data of steps {rec.pruned_steps[:5]}"
                           f"{'...' if len(rec.pruned_steps) > 5 else ''}: their tool seconds are not counted")
    root = rec.run_dir
    books.stored_bytes = {name: _dir_bytes(root / name) for name in
                          ("ledger", "checkpoints", "hf", "tensorboard", "metrics.jsonl", "samples.jsonl")}
    return books
