"""The leased environment service: durable, exactly-once-meaning episode stepping.

- `reset(task, instance, seed, episode_key)` stores an immutable snapshot of the instance and
  issues an episode id, a capability token (only its hash is stored) and a lease (TTL). A
  retried reset with the same `episode_key` returns the same episode with a fresh token (the
  old token stops working), so an ambiguous reset never creates a second episode.
- `step(episode_id, token, action, seq_no, idempotency_key)`: a known idempotency key returns
  the recorded result without executing again (a different action under the same key is a
  conflict); otherwise `seq_no` must be exactly the next one (duplicates and out-of-order
  deliveries are rejected). The transition and the environment's state after it are committed
  to SQLite (WAL) before the reply is returned; a step renews the lease.
- `action_status(episode_id, token, idempotency_key)`: the recorded result of an action, or
  None if it never executed: what a client asks after an ambiguous timeout, before retrying.
- Leases: `renew`, `close`; an expired lease makes its episode unusable and `reclaim_expired`
  (also run on every reset) marks it reclaimed and scrubs its environment object.
- Restart: environments live in memory only as a cache; after a restart an episode's
  environment is rebuilt from the snapshot (reset with the same seed, then `load_state_dict`
  of the last committed state), so nothing is ever re-executed.
- Every decision (reset, step, replay, rejection, renewal, expiry, close) is appended to the
  `events` audit table.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hybridrl.data.episode import TaskInstance, Transition
from hybridrl.envs.protocol import Environment

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY,
    episode_key TEXT UNIQUE,
    task TEXT NOT NULL,
    instance TEXT NOT NULL,
    seed INTEGER NOT NULL,
    token_hash TEXT NOT NULL,
    lease_expires REAL NOT NULL,
    status TEXT NOT NULL,
    last_seq INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL,
    observation TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_by_lease ON episodes (status, lease_expires);
CREATE TABLE IF NOT EXISTS transitions (
    episode_id TEXT NOT NULL,
    seq_no INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    action TEXT NOT NULL,
    result TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (episode_id, seq_no),
    UNIQUE (episode_id, idempotency_key)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    episode_id TEXT,
    kind TEXT NOT NULL,
    detail TEXT
);
"""

ACTIVE, DONE, CLOSED, RECLAIMED = "active", "done", "closed", "reclaimed"


class EnvServiceError(Exception):
    """A request the service refuses; `str()` says why."""


class LeaseError(EnvServiceError):
    """Unknown episode, wrong token, or a lease that expired / was reclaimed / closed."""


class OutOfOrder(EnvServiceError):
    """`seq_no` is not the next one (a duplicate under a new key, a gap, or a replay)."""


class IdempotencyConflict(EnvServiceError):
    """A known idempotency key arrived with a different action or sequence number."""


class EpisodeDone(EnvServiceError):
    """The environment already ended this episode."""


class EnvStepError(EnvServiceError):
    """The environment raised while stepping (an infrastructure fault; nothing was persisted)."""


@dataclass(frozen=True)
class Lease:
    episode_id: str
    token: str
    expires_at: float
    observation: str | None = None
    last_seq: int = 0


@dataclass(frozen=True)
class StepReply:
    seq_no: int
    transition: Transition
    replayed: bool                   # True: the recorded result of an earlier execution


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def default_make_env(task: str, instance: TaskInstance) -> Environment:
    from hybridrl.envs.tasks.registry import get_task

    env = get_task(task).make_env(instance)
    if env is None:
        raise EnvServiceError(f"task {task!r} has no environment")
    return env


class EnvService:
    """Thread-safe (one lock); call from asyncio through `asyncio.to_thread` (see `client.py`)."""

    def __init__(self, db_path: str | Path, *, lease_ttl_s: float = 300.0, synchronous: str = "full",
                 make_env: Callable[[str, TaskInstance], Environment] = default_make_env,
                 clock: Callable[[], float] = time.time,
                 on_persisted: Callable[[str, int], None] | None = None):
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.lease_ttl_s = lease_ttl_s
        self.make_env = make_env
        self.clock = clock
        self.on_persisted = on_persisted          # fault-injection point: after commit, before reply
        self._lock = threading.Lock()
        self._envs: dict[str, Environment] = {}
        self.db = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self.db.executescript(SCHEMA)

    @classmethod
    def from_config(cls, cfg, **kwargs) -> "EnvService":
        return cls(cfg.db_path, lease_ttl_s=cfg.lease_ttl_s, synchronous=cfg.synchronous, **kwargs)

    # ------------------------------------------------------------------ API

    def reset(self, task: str, instance: TaskInstance, seed: int, *, episode_key: str | None = None) -> Lease:
        now = self.clock()
        self.reclaim_expired()
        token = secrets.token_urlsafe(24)
        with self._lock:
            if episode_key is not None:
                row = self._row("SELECT * FROM episodes WHERE episode_key = ?", episode_key)
                if row is not None:
                    if row["status"] != ACTIVE:
                        raise LeaseError(f"episode {row['episode_id']} ({episode_key}) is {row['status']}")
                    expires = now + self.lease_ttl_s
                    self._tx([("UPDATE episodes SET token_hash = ?, lease_expires = ?, updated = ? "
                               "WHERE episode_id = ?", (_hash(token), expires, now, row["episode_id"]))],
                             row["episode_id"], "reset_retry", "token rotated")
                    return Lease(row["episode_id"], token, expires, row["observation"], row["last_seq"])
            episode_id = secrets.token_hex(8)
            env = self.make_env(task, instance)
            observation = env.reset(instance, seed)
            expires = now + self.lease_ttl_s
            self._tx([("INSERT INTO episodes (episode_id, episode_key, task, instance, seed, token_hash, "
                       "lease_expires, status, last_seq, state, observation, created, updated) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
                       (episode_id, episode_key, task, _canonical(instance.to_dict()), seed, _hash(token),
                        expires,
                        ACTIVE, _canonical(env.state_dict()), observation, now, now))],
                     episode_id, "reset", task)
            self._envs[episode_id] = env
            return Lease(episode_id, token, expires, observation)

    def step(self, episode_id: str, token: str, action: dict[str, Any], *, seq_no: int,
             idempotency_key: str) -> StepReply:
        now = self.clock()
        with self._lock:
            row = self._authorize(episode_id, token, now)
            recorded = self._recorded(episode_id, idempotency_key, action, seq_no)
            if recorded is not None:
                self._event(episode_id, "replay", f"seq {seq_no} key {idempotency_key}")
                return recorded
            if row["status"] == DONE:
                raise EpisodeDone(f"episode {episode_id} is done; seq {seq_no} refused")
            if seq_no != row["last_seq"] + 1:
                self._event(episode_id, "out_of_order", f"got seq {seq_no}, expected {row['last_seq'] + 1}")
                raise OutOfOrder(f"episode {episode_id}: seq_no {seq_no} is out of order; expected "
                                 f"{row['last_seq'] + 1}")
            env = self._env(row)
            try:
                transition = env.step(action)
                state = env.state_dict()
            except Exception as err:  # noqa: BLE001 - never persist a half step; rebuild next time
                self._envs.pop(episode_id, None)
                self._event(episode_id, "step_error", f"seq {seq_no}: {type(err).__name__}: {err}")
                raise EnvStepError(f"episode {episode_id} step {seq_no}: {type(err).__name__}: {err}") from err
            status = DONE if transition.done else ACTIVE
            self._tx([("INSERT INTO transitions (episode_id, seq_no, idempotency_key, action, result, created) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (episode_id, seq_no, idempotency_key, _canonical(action),
                        _canonical(transition.to_dict()),
                        now)),
                      ("UPDATE episodes SET last_seq = ?, state = ?, status = ?, lease_expires = ?, updated = ? "
                       "WHERE episode_id = ?",
                       (seq_no, _canonical(state), status, now + self.lease_ttl_s, now, episode_id))],
                     episode_id, "step", f"seq {seq_no}")
        if self.on_persisted is not None:
            self.on_persisted(episode_id, seq_no)
        return StepReply(seq_no, transition, replayed=False)

    def action_status(self, episode_id: str, token: str, idempotency_key: str) -> StepReply | None:
        with self._lock:
            self._authorize(episode_id, token, self.clock())
            row = self._row("SELECT seq_no, result FROM transitions WHERE episode_id = ? AND idempotency_key = ?",
                            episode_id, idempotency_key)
            if row is None:
                return None
            return StepReply(row["seq_no"], Transition.from_dict(json.loads(row["result"])), replayed=True)

    def renew(self, episode_id: str, token: str) -> float:
        now = self.clock()
        with self._lock:
            self._authorize(episode_id, token, now)
            expires = now + self.lease_ttl_s
            self._tx([("UPDATE episodes SET lease_expires = ?, updated = ? WHERE episode_id = ?",
                       (expires, now, episode_id))], episode_id, "renew", None)
            return expires

    def close(self, episode_id: str, token: str) -> None:
        now = self.clock()
        with self._lock:
            self._authorize(episode_id, token, now)
            self._tx([("UPDATE episodes SET status = ?, updated = ? WHERE episode_id = ?",
                       (CLOSED, now, episode_id))],
                     episode_id, "close", None)
            self._scrub(episode_id)

    def reclaim_expired(self) -> list[str]:
        """Mark every active episode whose lease expired as reclaimed; scrub its environment."""
        now = self.clock()
        with self._lock:
            rows = self.db.execute("SELECT episode_id FROM episodes WHERE status IN (?, ?) AND lease_expires < ?",
                                   (ACTIVE, DONE, now)).fetchall()
            ids = [r[0] for r in rows]
            for episode_id in ids:
                self._tx([("UPDATE episodes SET status = ?, updated = ? WHERE episode_id = ?",
                           (RECLAIMED, now, episode_id))], episode_id, "reclaimed", "lease expired")
                self._scrub(episode_id)
            return ids

    def episode(self, episode_id: str) -> dict[str, Any]:
        """The stored record of an episode (no token), for inspection and tests."""
        with self._lock:
            row = self._row("SELECT * FROM episodes WHERE episode_id = ?", episode_id)
            if row is None:
                raise LeaseError(f"unknown episode {episode_id}")
            out = dict(row)
            out.pop("token_hash")
            out["state"] = json.loads(out["state"])
            out["cached"] = episode_id in self._envs
            return out

    def events(self, episode_id: str | None = None) -> list[tuple[str, str | None]]:
        with self._lock:
            if episode_id is None:
                rows = self.db.execute("SELECT kind, detail FROM events ORDER BY id").fetchall()
            else:
                rows = self.db.execute("SELECT kind, detail FROM events WHERE episode_id = ? ORDER BY id",
                                       (episode_id,)).fetchall()
            return [(r[0], r[1]) for r in rows]

    # ------------------------------------------------------------------ internals

    def _row(self, sql: str, *args: Any) -> sqlite3.Row | None:
        cur = self.db.execute(sql, args)
        cur.row_factory = sqlite3.Row
        return cur.fetchone()

    def _tx(self, statements: list[tuple[str, tuple]], episode_id: str | None, kind: str,
            detail: str | None) -> None:
        """Run statements + an audit event in one committed transaction."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for sql, args in statements:
                self.db.execute(sql, args)
            self.db.execute("INSERT INTO events (time, episode_id, kind, detail) VALUES (?, ?, ?, ?)",
                            (self.clock(), episode_id, kind, detail))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def _event(self, episode_id: str, kind: str, detail: str | None) -> None:
        self._tx([], episode_id, kind, detail)

    def _authorize(self, episode_id: str, token: str, now: float) -> sqlite3.Row:
        row = self._row("SELECT * FROM episodes WHERE episode_id = ?", episode_id)
        if row is None:
            raise LeaseError(f"unknown episode {episode_id}")
        if not hmac.compare_digest(row["token_hash"], _hash(token)):
            self._event(episode_id, "bad_token", None)
            raise LeaseError(f"episode {episode_id}: invalid capability token")
        if row["status"] in (CLOSED, RECLAIMED):
            raise LeaseError(f"episode {episode_id} is {row['status']}")
        if row["lease_expires"] < now:
            self._tx([("UPDATE episodes SET status = ?, updated = ? WHERE episode_id = ?",
                       (RECLAIMED, now, episode_id))], episode_id, "reclaimed", "lease expired (on access)")
            self._scrub(episode_id)
            raise LeaseError(f"episode {episode_id}: lease expired at {row['lease_expires']:.3f}")
        return row

    def _recorded(self, episode_id: str, key: str, action: dict[str, Any], seq_no: int) -> StepReply | None:
        row = self._row("SELECT seq_no, action, result FROM transitions WHERE episode_id = ? AND idempotency_key = ?",
                        episode_id, key)
        if row is None:
            return None
        if row["action"] != _canonical(action) or row["seq_no"] != seq_no:
            self._event(episode_id, "idempotency_conflict", f"key {key}")
            raise IdempotencyConflict(f"episode {episode_id}: key {key!r} was recorded for seq {row['seq_no']} with "
                                      f"a different action")
        return StepReply(row["seq_no"], Transition.from_dict(json.loads(row["result"])), replayed=True)

    def _env(self, row: sqlite3.Row) -> Environment:
        env = self._envs.get(row["episode_id"])
        if env is None:                           # after a restart or a failed step: restore, never replay
            instance = TaskInstance.from_dict(json.loads(row["instance"]))
            env = self.make_env(row["task"], instance)
            env.reset(instance, row["seed"])
            env.load_state_dict(json.loads(row["state"]))
            self._envs[row["episode_id"]] = env
        return env

    def _scrub(self, episode_id: str) -> None:
        env = self._envs.pop(episode_id, None)
        if env is not None:
            env.close()
