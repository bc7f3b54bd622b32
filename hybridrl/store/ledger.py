"""The run ledger: every finalised trajectory of an RL run, written once, with its lineage.

    <run.dir>/ledger/
        index.sqlite             control plane (SQLite, WAL): steps, trajectories, releases, events
        data/step_000012.parquet data plane: one row per trajectory of step 12 (read-only once written)
        text/step_000012.jsonl   decoded text of those episodes (prompt, token pieces, answer), kept
                                 apart from metrics; absent with store.text=false
        abandoned/               shards of steps a resumed run did again (moved aside, never reused)

A trajectory's id is `Trajectory.trajectory_id` (run / task / group / attempt; the group names the
step), its trace id `Trajectory.trace_id`. A data shard holds, per trajectory: the prompt and
response token ids, the response mask (1 = sampled by the policy), the policy version of every
token, the behaviour logprobs (what the engine returned), and, where the controller holds them
(admitted trajectories), the trainer's recomputed logprobs, the reference's and the per-token
advantages (with `TrainSide.update_policy` they stay on the ranks: the columns are null and
the index keeps the advantage the update reported for the row), the reward, its components and
the evaluator of each, status, timings, tool calls and the trace events (`hybridrl.data.trace`).

The index says, per trajectory, which update consumed it (`consumed_step`, its row in that
update's batch) or why none did (`filter_reason`), how its advantage was computed, and per step
the policy version before and after the update, the stage times and the checkpoint the step wrote.
Releases (the manifest of each weight publication: version, training step, checkpoint hash) are
recorded when they happen, so that "which release resulted from the update of step s" is the
release of that step's `version_after`. Evaluations (`evaluations`: one row per step and suite, from
the in-loop evaluation or `hybridrl eval --run`) say which checkpoint (and policy version, model
hash) scored what on which suite (name, version, hash); they hold scores only, never an episode.

Shards are written to a temporary name and renamed (a crash never leaves half a shard under a
real name), then made read-only. A run resumed from step k does steps k+1.. again: the first
record of the process (a step, or a validation's switch) moves the earlier attempt's shards of
that step and later ones to abandoned/ and drops their index rows, so a trajectory id is in the
live ledger exactly once (the `events` table says what was abandoned). Retention
(`store.keep_steps`, `store.max_mb`) deletes old shards, never the index rows.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Sequence

from hybridrl.telemetry import spans

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, rollout_version INTEGER, version_after INTEGER, updated INTEGER,
    episodes INTEGER, admitted INTEGER, shard TEXT, text_shard TEXT, shard_bytes INTEGER, text_bytes INTEGER,
    pruned INTEGER DEFAULT 0, checkpoint TEXT, filters TEXT, stages TEXT, wall_s REAL, write_s REAL,
    recorded_at REAL);
CREATE TABLE IF NOT EXISTS trajectories (
    id TEXT PRIMARY KEY, trace_id TEXT, step INTEGER, task_id TEXT, group_id TEXT, attempt INTEGER,
    status TEXT, truncation TEXT, end_reason TEXT, reward REAL, rewards TEXT, evaluators TEXT,
    prompt_tokens INTEGER, response_tokens INTEGER, policy_tokens INTEGER, min_version INTEGER,
    max_version INTEGER, lag INTEGER, turns INTEGER, tool_calls INTEGER, tool_errors INTEGER,
    action_errors INTEGER, filter_reason TEXT, consumed_step INTEGER, batch_row INTEGER, advantage TEXT,
    shard_row INTEGER);
CREATE INDEX IF NOT EXISTS trajectories_step ON trajectories (step);
CREATE TABLE IF NOT EXISTS releases (
    version INTEGER PRIMARY KEY, training_step INTEGER, published_at_step INTEGER, checkpoint_hash TEXT,
    manifest TEXT);
CREATE TABLE IF NOT EXISTS events (at REAL, kind TEXT, step INTEGER, detail TEXT);
CREATE TABLE IF NOT EXISTS evaluations (
    step INTEGER, suite TEXT, source TEXT, suite_version INTEGER, suite_hash TEXT, instances_hash TEXT,
    policy_version INTEGER, checkpoint TEXT, model_hash TEXT, label TEXT, metrics TEXT, result_path TEXT,
    recorded_at REAL, PRIMARY KEY (step, suite, source));
"""


_SHARD_COLUMNS = (
    "id", "trace_id", "step", "prompt_ids", "response_ids", "response_mask", "policy_versions", "behavior_logprobs",
    "old_logprobs", "ref_logprobs", "advantages", "reward", "rewards", "reward_evaluators", "status", "truncation",
    "sampler_contract", "timings", "tool_calls", "trace", "metadata", "consumed_step", "batch_row")


def _insert(db: sqlite3.Connection, table: str, rows: Sequence[dict]) -> None:
    """INSERT rows (column -> value) by column name."""
    if rows:
        names = list(rows[0])
        db.executemany(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(':' + n for n in names)})", rows)


def _shard_row(t: Any, step: int, row: int | None, tensors: dict, trace: list, meta: dict) -> dict:
    """A trajectory's row of the step's Parquet shard: its tokens, and its batch row's per-token values."""
    p, n = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
    out = dict(id=t.trajectory_id, trace_id=t.trace_id, step=step, prompt_ids=list(t.prompt_ids),
               response_ids=list(t.response_ids), response_mask=list(t.response_mask),
               policy_versions=list(t.policy_versions), behavior_logprobs=list(t.behavior_logprobs))
    for name, tensor in tensors.items():                   # [rows, T]: the response's span
        out[name] = tensor[row, p:n].tolist() if tensor is not None and row is not None else None
    return {**out, "reward": float(t.reward), "rewards": _json(t.rewards),
            "reward_evaluators": _json(t.reward_evaluators), "status": t.status.value,
            "truncation": t.truncation.value if t.truncation else None,
            "sampler_contract": int(t.sampler_contract), "timings": _json(t.timings),
            "tool_calls": _json([vars(c) for c in t.tool_calls]), "trace": _json(trace), "metadata": _json(meta),
            "consumed_step": step if row is not None else None, "batch_row": row}


def _index_row(t: Any, step: int, row: int | None, trace: list, meta: dict, *, rollout_version: int, filtered: str,
               explain: dict, shard_row: int) -> dict:
    """A trajectory's row of the `trajectories` index."""
    versions = sorted(t.versions)
    tid = t.trajectory_id
    return dict(
        id=tid, trace_id=t.trace_id, step=step, task_id=t.task_id, group_id=t.group_id, attempt=t.attempt,
        status=t.status.value, truncation=t.truncation.value if t.truncation else None,
        end_reason=meta.get("end_reason"), reward=float(t.reward), rewards=_json(t.rewards),
        evaluators=_json(t.reward_evaluators), prompt_tokens=len(t.prompt_ids), response_tokens=len(t.response_ids),
        policy_tokens=t.num_policy_tokens, min_version=versions[0] if versions else None,
        max_version=versions[-1] if versions else None, lag=rollout_version - versions[0] if versions else 0,
        turns=t.turns, tool_calls=len(t.tool_calls), tool_errors=sum(1 for c in t.tool_calls if not c.ok),
        action_errors=sum(1 for e in trace if e["span"] == "action" and e.get("decision") != "authorized"),
        filter_reason=None if row is not None else filtered, consumed_step=step if row is not None else None,
        batch_row=row, advantage=_json(explain.get(tid)) if tid in explain else None, shard_row=shard_row)


def ledger_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ledger"


def connect(run_dir: str | Path, *, create: bool = False) -> sqlite3.Connection:
    root = ledger_dir(run_dir)
    path = root / "index.sqlite"
    if not create and not path.exists():
        raise FileNotFoundError(f"{run_dir} has no run ledger ({path} is missing): it was not an RL run, or it "
                                "ran with store.enabled=false")
    root.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, timeout=30)
    db.row_factory = sqlite3.Row
    if create:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")   # WAL: a crash of the process loses nothing committed
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    return db


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


class NullLedger:
    """store.enabled=false: records nothing."""

    enabled = False

    def record_step(self, step: int, **kwargs: Any) -> float:
        return 0.0

    def record_switch(self, step: int, switch: dict | None, purpose: str = "rollout") -> None:
        return None

    def record_evaluation(self, step: int, result: dict, *, result_path: str) -> None:
        return None

    def release_hash(self, version: int) -> str | None:
        return None

    def record_incident(self, step: int, detail: dict) -> None:
        return None

    def rewind(self, step: int) -> None:
        return None


class Ledger:
    enabled = True

    def __init__(self, run_dir: str | Path, cfg: Any, *, tokenizer: Any = None, algo: Any = None):
        self.run_dir = Path(run_dir)
        self.root = ledger_dir(run_dir)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.algo = algo
        for sub in ("data", "text", "abandoned"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.db = connect(run_dir, create=True)
        self._rewound = False
        self._piece: dict[int, str] = {}

    # ------------------------------------------------------------------ writing

    def record_switch(self, step: int, switch: dict | None, purpose: str = "rollout") -> None:
        """A mode switch's result: the release it published, if any, and what for: the `rollout` of step
        `step`, or the `validation` after it (the manifest's `published_for`)."""
        self._first_record(step)
        release = (switch or {}).get("release")
        if not release:
            return
        self.db.execute("INSERT OR REPLACE INTO releases VALUES (?, ?, ?, ?, ?)",
                        (int(release["policy_version"]), int(release.get("training_step", -1)), step,
                         release.get("checkpoint_hash"), _json({**release, "published_for": purpose})))

    @spans.traced("store")                       # on the run's timeline (telemetry/spans.py)
    def record_step(self, step: int, *, trajectories: Sequence[Any], kept: Any, batch: Any, switch: dict | None,
                    rollout_version: int, version_after: int, metrics: dict | None = None,
                    checkpoint: str | None = None) -> float:
        """Everything one RL step produced: its trajectories (once), which were consumed, the lineage.
        Returns the seconds it took (the store's share of the step)."""
        metrics = metrics or {}
        started = time.perf_counter()
        self._first_record(step)
        self.record_switch(step, switch)
        rows_of = {tid: i for i, tid in enumerate(batch["trajectory_id"])} if batch is not None else {}
        tensors = {name: batch[name] if batch is not None and name in batch else None
                   for name in ("old_logprobs", "ref_logprobs", "advantages")}
        explain = self._advantage_explanations(batch, kept.kept) if batch is not None else {}
        reasons = {id(t): reason for reason, ts in (kept.rejected if kept is not None else {}).items() for t in ts}
        shard_rows, index_rows, texts, prompts = [], [], [], {}
        for shard_row, t in enumerate(trajectories):
            row = rows_of.get(t.trajectory_id)
            meta = dict(t.metadata)
            trace, answer = meta.pop("trace", []), meta.pop("answer", None)
            shard_rows.append(_shard_row(t, step, row, tensors, trace, meta))
            index_rows.append(_index_row(t, step, row, trace, meta, rollout_version=rollout_version,
                                         filtered=reasons.get(id(t), "not admitted"), explain=explain,
                                         shard_row=shard_row))
            if self.cfg.text and self.tokenizer is not None:
                texts.append(self._text_record(t, answer, prompts))
        shard = self._write_parquet(step, {k: [r[k] for r in shard_rows] for k in _SHARD_COLUMNS})
        text_shard = self._write_text(step, texts) if texts else None
        self.db.execute("BEGIN")
        _insert(self.db, "trajectories", index_rows)
        _insert(self.db, "steps", [dict(
            step=step, rollout_version=rollout_version, version_after=version_after, updated=int(batch is not None),
            episodes=len(trajectories), admitted=len(rows_of), shard=shard.name,
            text_shard=text_shard.name if text_shard else None, shard_bytes=shard.stat().st_size,
            text_bytes=text_shard.stat().st_size if text_shard else 0, pruned=0, checkpoint=checkpoint,
            filters=_json(kept.counts if kept is not None else {}),
            stages=_json({k[len("time/T_"):]: v for k, v in metrics.items() if k.startswith("time/T_")}),
            wall_s=metrics.get("time/step_s", 0.0), write_s=0.0, recorded_at=time.time())])
        self.db.execute("COMMIT")
        self._retain(step)
        seconds = time.perf_counter() - started
        self.db.execute("UPDATE steps SET write_s = ? WHERE step = ?", (seconds, step))
        return seconds

    def record_incident(self, step: int, detail: dict) -> None:
        """An incident of step `step` (`controller/incidents.py`): its rule, action, evidence and what was done,
        an event of kind `incident` (kept when the step is done again)."""
        self.db.execute("INSERT INTO events VALUES (?, 'incident', ?, ?)", (time.time(), step, _json(detail)))

    def rewind(self, step: int) -> None:
        """The run went back in this process (a rollback): steps >= `step` are done again."""
        self._rewound = True
        self._rewind(step)

    def release_hash(self, version: int) -> str | None:
        """The checkpoint hash of the release recorded for policy `version` (None when none is)."""
        row = self.db.execute("SELECT checkpoint_hash FROM releases WHERE version = ?", (version,)).fetchone()
        return row[0] if row else None

    def record_evaluation(self, step: int, result: dict, *, result_path: str) -> None:
        """The in-loop evaluation of step `step` (its scores, never its episodes)."""
        self._first_record(step)
        _insert_evaluation(self.db, result, result_path=result_path)

    def _advantage_explanations(self, batch: Any, admitted: Sequence[Any]) -> dict[str, dict]:
        """How each admitted trajectory's advantage was computed: the estimator's registry entry (its
        formula), its group's rewards and stats. The value is the batch's per-token advantage at the first
        policy token when the controller holds it, else what the update reported for the row
        (`metadata["advantage"]`: its mean over the row's policy tokens, the same scalar on every token
        for outcome estimators)."""
        import statistics

        from hybridrl.algo.registry import estimator

        reported = {t.trajectory_id: t.metadata.get("advantage") for t in admitted}
        algo = self.algo
        entry_of = estimator(algo.advantage) if algo is not None else None
        name = algo.advantage if algo is not None else "?"
        formula = entry_of.formula(algo) if entry_of is not None else "?"
        rewards = batch["reward"].tolist()
        groups: dict[str, list[int]] = {}
        for i, g in enumerate(batch["group_id"]):
            groups.setdefault(g, []).append(i)
        mask, adv = batch["loss_mask"], batch["advantages"] if "advantages" in batch else None
        out = {}
        for g, rows in groups.items():
            values = [rewards[i] for i in rows]
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            for k, i in enumerate(rows):
                first = mask[i].nonzero()
                if adv is not None:
                    value = float(adv[i, int(first[0])]) if len(first) else 0.0
                else:
                    value = reported.get(batch["trajectory_id"][i])
                entry = {"estimator": name, "group": g, "group_size": len(rows), "group_rewards": values,
                         "reward": rewards[i], "group_mean": mean, "group_std": std, "value": value,
                         "formula": formula}
                if entry_of is not None and entry_of.explain_row is not None:
                    entry.update(entry_of.explain_row(algo, values, k))
                if algo is not None and algo.uses_reference and algo.kl_in == "reward":
                    entry["kl_in_reward"] = algo.kl_coef
                    entry["kl_estimator"] = algo.kl_option
                out[batch["trajectory_id"][i]] = entry
        return out

    def _text_record(self, t: Any, answer: Any, prompts: dict) -> dict:
        key = tuple(t.prompt_ids)
        if key not in prompts:                  # a group's samples share their prompt
            prompts[key] = self.tokenizer.decode(t.prompt_ids)
        return {"id": t.trajectory_id, "prompt": prompts[key], "pieces": self._pieces(t.response_ids),
                "answer": answer}

    def _pieces(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own (for display), through a cache of the token ids seen so far."""
        missing = [i for i in set(ids) if i not in self._piece]
        if missing:
            fast = getattr(self.tokenizer, "backend_tokenizer", None)     # the tokenizers library, no wrapper
            rows = [[i] for i in missing]
            texts = (fast.decode_batch(rows, skip_special_tokens=False) if fast is not None
                     else self.tokenizer.batch_decode(rows))
            self._piece.update(zip(missing, texts))
        return [self._piece[i] for i in ids]

    def _write_parquet(self, step: int, columns: dict[str, list]) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        types = {"step": pa.int64(), "prompt_ids": pa.list_(pa.int32()), "response_ids": pa.list_(pa.int32()),
                 "response_mask": pa.list_(pa.int8()), "policy_versions": pa.list_(pa.int32()),
                 "behavior_logprobs": pa.list_(pa.float32()), "old_logprobs": pa.list_(pa.float32()),
                 "ref_logprobs": pa.list_(pa.float32()), "advantages": pa.list_(pa.float32()),
                 "reward": pa.float64(), "sampler_contract": pa.int32(), "consumed_step": pa.int64(),
                 "batch_row": pa.int64()}
        table = pa.table({k: pa.array(v, type=types.get(k, pa.string())) for k, v in columns.items()})
        path = self.root / "data" / f"step_{step:06d}.parquet"
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp, compression=None if self.cfg.compression == "none" else self.cfg.compression)
        return _seal(tmp, path)

    def _write_text(self, step: int, texts: list[dict]) -> Path:
        path = self.root / "text" / f"step_{step:06d}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in texts))
        return _seal(tmp, path)

    # ------------------------------------------------------------------ resume and retention

    def _first_record(self, step: int) -> None:
        """This process's first record (a step, or a validation's switch) is where it took over."""
        if not self._rewound:
            self._rewound = True
            self._rewind(step)

    def _rewind(self, step: int) -> None:
        """Steps >= `step` recorded by an earlier attempt (a resumed run does them again): moved aside."""
        later = self.db.execute("SELECT step, shard, text_shard, episodes FROM steps WHERE step >= ?",
                                (step,)).fetchall()
        orphans = [p for sub in ("data", "text") for p in (self.root / sub).glob("step_*")
                   if int(p.name[5:11]) >= step]
        if not later and not orphans:
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for path in orphans:
            os.replace(path, self.root / "abandoned" / f"{path.parent.name}.{path.name}.{stamp}")
        self.db.execute("BEGIN")
        self.db.execute("DELETE FROM trajectories WHERE step >= ?", (step,))
        self.db.execute("DELETE FROM steps WHERE step >= ?", (step,))
        self.db.execute("DELETE FROM releases WHERE published_at_step >= ?", (step,))
        self.db.execute("DELETE FROM evaluations WHERE step >= ? AND source = 'train'", (step,))
        self.db.execute("INSERT INTO events VALUES (?, 'rewind', ?, ?)", (
            time.time(), step, _json({"steps": [r["step"] for r in later],
                                      "trajectories": sum(r["episodes"] or 0 for r in later),
                                      "moved": [p.name for p in orphans]})))
        self.db.execute("COMMIT")
        log.info("ledger: steps %s of an earlier attempt moved to %s (this run does them again)",
                 [r["step"] for r in later], self.root / "abandoned")

    def _retain(self, newest: int) -> None:
        live = self.db.execute("SELECT step, shard, text_shard, shard_bytes, text_bytes FROM steps "
                               "WHERE pruned = 0 ORDER BY step").fetchall()
        drop = []
        if self.cfg.keep_steps:
            drop += [r for r in live if r["step"] <= newest - self.cfg.keep_steps]
        if self.cfg.max_mb:
            total = sum(r["shard_bytes"] + r["text_bytes"] for r in live if r not in drop)
            for r in live:
                if total <= self.cfg.max_mb * 2 ** 20 or r["step"] == newest:
                    break
                if r not in drop:
                    drop.append(r)
                    total -= r["shard_bytes"] + r["text_bytes"]
        for r in drop:
            for sub, name in (("data", r["shard"]), ("text", r["text_shard"])):
                if name:
                    (self.root / sub / name).unlink(missing_ok=True)
            self.db.execute("UPDATE steps SET pruned = 1 WHERE step = ?", (r["step"],))
            self.db.execute("INSERT INTO events VALUES (?, 'retention', ?, ?)",
                            (time.time(), r["step"], _json({"freed_bytes": r["shard_bytes"] + r["text_bytes"]})))


def _seal(tmp: Path, path: Path) -> Path:
    if path.exists():
        raise FileExistsError(f"{path} exists: a ledger shard is written once (a resumed run moves the earlier "
                              "attempt's shards aside first)")
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)
    return path


def _insert_evaluation(db: sqlite3.Connection, result: dict, *, result_path: str) -> None:
    model, suite = result["model"], result["suite"]
    db.execute("INSERT OR REPLACE INTO evaluations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (
        model["step"], suite["name"], result.get("source", "cli"), suite["version"], suite["hash"],
        result["instances_hash"], model.get("policy_version"), model.get("checkpoint"), model.get("hash"),
        result.get("label"), _json(result["metrics"]), result_path, time.time()))


def record_evaluation(run_dir: str | Path, result: dict, *, result_path: str) -> None:
    """A result of `hybridrl eval --run` (a model of this run, by step) into the run's ledger."""
    db = connect(run_dir, create=True)
    try:
        _insert_evaluation(db, result, result_path=result_path)
    finally:
        db.close()


def open_ledger(cfg: Any, tokenizer: Any = None) -> Ledger | NullLedger:
    """The ledger of the RL run `cfg` describes (a no-op one with store.enabled=false)."""
    if not cfg.store.enabled:
        return NullLedger()
    return Ledger(cfg.run.dir, cfg.store, tokenizer=tokenizer, algo=cfg.algo)
