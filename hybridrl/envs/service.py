"""The leased environment service: durable, exactly-once-meaning episode stepping.

- `reset(task, instance, seed, episode_key)` stores an immutable snapshot of the instance and
  issues an episode id, a capability token (only its hash is stored) and a lease (TTL). A
  retried reset with the same `episode_key` (same task, instance and seed) returns the same
  episode with a fresh token (the old token stops working), so an ambiguous reset never creates a
  second episode; a closed or reclaimed episode reopens (its state is in the database), so a
  client that runs the episode again after a crash replays its recorded steps by key. A reset that reuses an episode key with a different task, instance or seed is
  refused (`EpisodeKeyConflict`) and changes nothing: the first client's token keeps working.
- `step(episode_id, token, action, seq_no, idempotency_key)`: a known idempotency key returns
  the recorded result without executing again (a different action under the same key is a
  conflict); otherwise `seq_no` must be exactly the next one (duplicates and out-of-order
  deliveries are rejected). A step is three phases:
    1. claim: in one `BEGIN IMMEDIATE` transaction (the database's write lock, so two service
       processes on one file serialise here) the episode is read fresh, checked, and an intent
       row (`pending`, owned by this process) is committed for (episode, seq_no, key);
    2. execute: the environment steps, rebuilt from the committed state unless this process's
       cached object is at exactly the database's last sequence number; its result and state
       are serialised (a result that is not JSON fails the step here);
    3. record: the result (or the recorded failure) and the environment's new state are
       committed before the reply.
  If phase 3 cannot write (a locked database), the outcome stays in memory and the retry of the
  same key writes and returns it: never a second execution. The retry is authorised like any step
  (a forged or rotated token gets nothing), and a record never revives an episode: into an
  episode that was closed, reclaimed or failed meanwhile, what ran is recorded (the transition,
  the state) while its status and lease stay as they are.
  Every exception from the environment's step (its step, its state, its result's serialisation:
  a result that is not JSON, or nested past the recursion limit) is recorded as that step's
  failure, and its cached object is scrubbed: the episode fails, retries get the recorded error,
  nothing steps the half-advanced object again. (An environment that cannot even be built or
  restored has run nothing: the intent is withdrawn.) An intent whose owner died (a service
  killed mid-step), or that this process itself lost track of (an exception that is not an
  `Exception` escaped the step), or whose owner is another service object of this process that
  is not executing it, is *in doubt*: the step may or may not have run. For an environment that
  declares `pure = True` (its step touches nothing outside its own state) it is executed again
  from the committed state, on a rebuilt object; otherwise the step is refused with `StepInDoubt`
  and the episode fails: a side effect is never applied twice. (An outcome another service of
  this process executed but could not record is recorded by this one.)
- `action_status(episode_id, token, idempotency_key)`: the recorded result of an action, or
  None if it never executed: what a client asks after an ambiguous timeout, before retrying.
- Leases: `renew`, `close`; an expired lease makes its episode unusable and `reclaim_expired`
  (also run on every reset) marks it reclaimed and scrubs its environment object.
- Restart: environments live in memory only as a cache; after a restart an episode's
  environment is rebuilt from the snapshot (reset with the same seed, then `load_state_dict`
  of the last committed state), so nothing is ever re-executed.
- Every decision (reset, step, replay, rejection, renewal, expiry, close) is appended to the
  `events` audit table; refusals and lease revocations also to the run's audit log
  (`env.audit_log`, hash-chained: `hybridrl/telemetry/audit.py`).

SQLite in WAL mode needs every process on one host (it is not safe on a network filesystem),
which is what makes the owner check (pid and process start time) sound.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from hybridrl.data.episode import TaskInstance, Transition
from hybridrl.envs.protocol import Environment
from hybridrl.envs.service_db import ensure_schema, open_database
from hybridrl.envs.service_owners import SERVICES, local_owner, local_return, owner_alive, start_time
from hybridrl.envs.service_types import (  # noqa: F401  (the service's API, importable from here)
    DatabaseBusy,
    EnvServiceError,
    EnvStepError,
    EpisodeDone,
    EpisodeKeyConflict,
    IdempotencyConflict,
    InvalidRequest,
    Lease,
    LeaseError,
    OutOfOrder,
    ResultNotWritten,
    RetryableStepError,
    StepInDoubt,
    StepInProgress,
    StepReply,
)

log = logging.getLogger(__name__)

ACTIVE, DONE, CLOSED, RECLAIMED, FAILED = "active", "done", "closed", "reclaimed", "failed"
PENDING, COMMITTED = "pending", "committed"
# events also written to the run's audit log: refusals and lease revocations
AUDITED = {"bad_token", "refused", "reset_conflict", "idempotency_conflict", "out_of_order", "in_doubt",
           "reclaimed", "step_failed"}
_MAX_ERROR_CHARS = 2000

@dataclass(frozen=True)
class _Outcome:                      # an executed step, before (or if) its record is written
    seq_no: int
    action: str
    result: str | None               # canonical JSON of the transition, or None when it failed
    state: str | None
    done: bool
    error: str | None


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _check_step_arguments(seq_no: Any, idempotency_key: Any) -> None:
    """`seq_no` a positive int (not a bool, float or string: 2.0 == 2 would match the same row in
    SQLite and in comparisons, and a step must name exactly one position), the key a string."""
    if type(seq_no) is not int or seq_no < 1:
        raise InvalidRequest(f"seq_no must be a positive integer (1 for the first step), got "
                             f"{type(seq_no).__name__} {seq_no!r}: pass int(seq_no)")
    if not isinstance(idempotency_key, str) or not idempotency_key:
        raise InvalidRequest(f"idempotency_key must be a non-empty string, got {type(idempotency_key).__name__}")


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _describe(err: BaseException) -> str:
    try:
        text = f"{type(err).__name__}: {err}"
    except Exception:  # noqa: BLE001 - an exception whose str() raises still gets a record
        text = type(err).__name__
    return text[:_MAX_ERROR_CHARS]


def default_make_env(task: str, instance: TaskInstance) -> Environment:
    from hybridrl.envs.tasks.registry import get_task

    env = get_task(task).make_env(instance)
    if env is None:
        raise EnvServiceError(f"task {task!r} has no environment")
    return env


class EnvService:
    """Thread-safe (one lock); call from asyncio through `asyncio.to_thread` (see `client.py`).
    Several processes may open one database: the write lock and the intent rows keep them exact."""

    def __init__(self, db_path: str | Path, *, lease_ttl_s: float = 300.0, synchronous: str = "full",
                 busy_timeout_s: float = 10.0,
                 make_env: Callable[[str, TaskInstance], Environment] = default_make_env,
                 clock: Callable[[], float] = time.time,
                 on_persisted: Callable[[str, int], None] | None = None,
                 audit_log: str | None = None):
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.lease_ttl_s = lease_ttl_s
        self.make_env = make_env
        self.clock = clock
        self.on_persisted = on_persisted          # fault-injection point: after commit, before reply
        self.owner = (f"{socket.gethostname()}:{os.getpid()}:{start_time(os.getpid()) or '?'}:"
                      f"{secrets.token_hex(4)}")
        self._lock = threading.Lock()
        self._envs: dict[str, tuple[Environment, int]] = {}     # episode -> (object, seq it is at)
        self._unwritten: dict[tuple[str, str], _Outcome] = {}   # executed, record not yet written
        from hybridrl.telemetry.audit import open_log

        self.audit = open_log(audit_log)
        SERVICES[self.owner] = self
        self.db = open_database(self.db_path, synchronous=synchronous, busy_timeout_s=busy_timeout_s)
        ensure_schema(self.db, self.db_path, self._transaction)

    @classmethod
    def from_config(cls, cfg, **kwargs) -> "EnvService":
        return cls(cfg.db_path, lease_ttl_s=cfg.lease_ttl_s, synchronous=cfg.synchronous,
                   busy_timeout_s=cfg.busy_timeout_s, audit_log=cfg.audit_log, **kwargs)

    def shutdown(self) -> None:
        """Close the database; intents this object still owns are in doubt for every other service."""
        with self._lock:
            SERVICES.pop(self.owner, None)
            self.db.close()

    # ------------------------------------------------------------------ API

    def reset(self, task: str, instance: TaskInstance, seed: int, *, episode_key: str | None = None) -> Lease:
        self.reclaim_expired()
        token = secrets.token_urlsafe(24)
        snapshot = _canonical(instance.to_dict())
        with self._lock, self._transaction():
            now = self.clock()
            if episode_key is not None:
                row = self._row("SELECT * FROM episodes WHERE episode_key = ?", episode_key)
                if row is not None:
                    theirs = (row["task"], row["instance"], row["seed"])
                    if theirs != (task, snapshot, seed):
                        what = [name for name, a, b in zip(("task", "instance", "seed"), theirs, (task, snapshot, seed))
                                if a != b]
                        self._insert_event(row["episode_id"], "reset_conflict", ", ".join(what))
                        raise EpisodeKeyConflict(
                            f"episode key {episode_key!r} already names episode {row['episode_id']} with a "
                            f"different {' and '.join(what)} (task {row['task']!r}, seed {row['seed']}); an episode "
                            f"key must be unique per (task, instance, seed): derive it from all three")
                    if row["status"] == FAILED:
                        raise EnvStepError(f"episode {row['episode_id']} ({episode_key}) failed: {row['error']}")
                    # a closed or reclaimed episode reopens (its state is in the database): a client that
                    # runs the episode again after a crash gets its recorded steps back, never re-executed
                    status = row["status"]
                    if status in (CLOSED, RECLAIMED):
                        last = self._row("SELECT result FROM transitions WHERE episode_id = ? AND phase = ? "
                                         "ORDER BY seq_no DESC LIMIT 1", row["episode_id"], COMMITTED)
                        status = DONE if last is not None and json.loads(last["result"]).get("done") else ACTIVE
                    expires = now + self.lease_ttl_s
                    self.db.execute("UPDATE episodes SET token_hash = ?, lease_expires = ?, status = ?, updated = ? "
                                    "WHERE episode_id = ?", (_hash(token), expires, status, now, row["episode_id"]))
                    self._insert_event(row["episode_id"], "reset_retry",
                                       "token rotated" + (f"; reopened ({row['status']})" if status != row["status"]
                                                          else ""))
                    return Lease(row["episode_id"], token, expires, row["observation"], row["last_seq"])
            episode_id = secrets.token_hex(8)
            env = self.make_env(task, instance)
            observation = env.reset(instance, seed)
            expires = now + self.lease_ttl_s
            self.db.execute("INSERT INTO episodes (episode_id, episode_key, task, instance, seed, token_hash, "
                            "lease_expires, status, last_seq, state, observation, created, updated) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
                            (episode_id, episode_key, task, snapshot, seed, _hash(token), expires,
                             ACTIVE, _canonical(env.state_dict()), observation, now, now))
            self._insert_event(episode_id, "reset", task)
            self._envs[episode_id] = (env, 0)
            return Lease(episode_id, token, expires, observation)

    def step(self, episode_id: str, token: str, action: dict[str, Any], *, seq_no: int,
             idempotency_key: str) -> StepReply:
        _check_step_arguments(seq_no, idempotency_key)
        key = idempotency_key
        with self._lock:
            outcome = self._unwritten.get((episode_id, key))
            if outcome is None:
                claim = self._claim(episode_id, token, action, seq_no, key)
                if isinstance(claim, StepReply):
                    return claim
                if isinstance(claim, _Outcome):          # executed by another service of this process
                    outcome = claim
                else:
                    outcome = self._execute(claim, action, seq_no, key)
                self._record(episode_id, key, outcome)
            else:
                if outcome.action != _canonical(action) or outcome.seq_no != seq_no:
                    raise IdempotencyConflict(f"episode {episode_id}: key {key!r} was executed for seq "
                                              f"{outcome.seq_no} with a different action")
                self._record(episode_id, key, outcome, token=token)     # authorised like any step
        if outcome.error is not None:
            raise EnvStepError(f"episode {episode_id} step {seq_no}: {outcome.error}")
        if self.on_persisted is not None:
            self.on_persisted(episode_id, seq_no)
        return StepReply(seq_no, Transition.from_dict(json.loads(outcome.result)), replayed=False)

    def action_status(self, episode_id: str, token: str, idempotency_key: str) -> StepReply | None:
        """The recorded result of an action; None if it never executed (safe to send again). Raises
        `EnvStepError` for a recorded failure, `StepInDoubt` when its executor died mid-step, and
        `StepInProgress` while another live process executes it."""
        with self._lock:
            with self._transaction():
                self._authorize(episode_id, token, self.clock())
                row = self._row("SELECT * FROM transitions WHERE episode_id = ? AND idempotency_key = ?",
                                episode_id, idempotency_key)
            if row is None:
                return None
            if row["phase"] == COMMITTED:
                return StepReply(row["seq_no"], Transition.from_dict(json.loads(row["result"])), replayed=True)
            if row["phase"] == FAILED:
                raise EnvStepError(f"episode {episode_id} step {row['seq_no']}: {row['error']}")
            if (episode_id, idempotency_key) in self._unwritten:
                raise ResultNotWritten(f"episode {episode_id}: key {idempotency_key!r} executed here, its record "
                                       f"is not written yet; retry the step with the same key")
            local = local_owner(self, row["owner"], episode_id, idempotency_key, take=False)
            if local == "unwritten":
                raise ResultNotWritten(f"episode {episode_id}: key {idempotency_key!r} was executed by another "
                                       f"service of this process; retry the step with the same key")
            if local == "busy" or (local is None and owner_alive(row["owner"])):
                raise StepInProgress(f"episode {episode_id}: key {idempotency_key!r} is being executed by "
                                     f"service process {row['owner']}")
            raise StepInDoubt(f"episode {episode_id}: key {idempotency_key!r} was claimed by service process "
                              f"{row['owner']}, which died (or lost track of it) before recording it; it may have executed")

    def renew(self, episode_id: str, token: str) -> float:
        with self._lock, self._transaction():
            now = self.clock()
            self._authorize(episode_id, token, now)
            expires = now + self.lease_ttl_s
            self.db.execute("UPDATE episodes SET lease_expires = ?, updated = ? WHERE episode_id = ?",
                            (expires, now, episode_id))
            self._insert_event(episode_id, "renew", None)
            return expires

    def close(self, episode_id: str, token: str) -> None:
        with self._lock, self._transaction():
            now = self.clock()
            self._authorize(episode_id, token, now)
            self.db.execute("UPDATE episodes SET status = ?, updated = ? WHERE episode_id = ?",
                            (CLOSED, now, episode_id))
            self._insert_event(episode_id, "close", None)
            self._scrub(episode_id)

    def reclaim_expired(self) -> list[str]:
        """Mark every active episode whose lease expired as reclaimed; scrub its environment."""
        with self._lock, self._transaction():
            now = self.clock()
            rows = self.db.execute("SELECT episode_id FROM episodes WHERE status IN (?, ?) AND lease_expires < ?",
                                   (ACTIVE, DONE, now)).fetchall()
            ids = [r[0] for r in rows]
            for episode_id in ids:
                self.db.execute("UPDATE episodes SET status = ?, updated = ? WHERE episode_id = ?",
                                (RECLAIMED, now, episode_id))
                self._insert_event(episode_id, "reclaimed", "lease expired")
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

    # ------------------------------------------------------------------ the three phases of a step

    def _claim(self, episode_id: str, token: str, action: dict[str, Any], seq_no: int,
               key: str) -> StepReply | sqlite3.Row | _Outcome:
        """Phase 1, under the database's write lock: a recorded reply, the fresh episode row after
        committing this process's intent for (seq_no, key), or the outcome another service of this
        process executed for it (to be recorded)."""
        with self._transaction():
            now = self.clock()
            row = self._authorize(episode_id, token, now)
            recorded = self._recorded(episode_id, key, action, seq_no)
            if recorded is not None:
                self._insert_event(episode_id, "replay", f"seq {seq_no} key {key}")
                return recorded
            if row["status"] == DONE:
                raise EpisodeDone(f"episode {episode_id} is done; seq {seq_no} refused")
            if row["status"] == FAILED:
                raise EnvStepError(f"episode {episode_id} failed ({row['error']}); seq {seq_no} refused")
            if seq_no != row["last_seq"] + 1:
                self._insert_event(episode_id, "out_of_order", f"got seq {seq_no}, expected {row['last_seq'] + 1}")
                raise OutOfOrder(f"episode {episode_id}: seq_no {seq_no} is out of order; expected "
                                 f"{row['last_seq'] + 1}")
            intent = self._row("SELECT * FROM transitions WHERE episode_id = ? AND seq_no = ?", episode_id, seq_no)
            if intent is not None:                  # a pending claim on this seq (committed ones raised above)
                if intent["idempotency_key"] != key:
                    raise OutOfOrder(f"episode {episode_id}: seq_no {seq_no} is claimed by key "
                                     f"{intent['idempotency_key']!r}")
                local = local_owner(self, intent["owner"], episode_id, key, take=True)
                if isinstance(local, _Outcome):
                    if local.action != _canonical(action) or local.seq_no != seq_no:
                        local_return(intent["owner"], episode_id, key, local)
                        raise IdempotencyConflict(f"episode {episode_id}: key {key!r} was executed for seq "
                                                  f"{local.seq_no} with a different action")
                    self.db.execute("UPDATE transitions SET owner = ? WHERE episode_id = ? AND seq_no = ?",
                                    (self.owner, episode_id, seq_no))
                    self._unwritten[(episode_id, key)] = local
                    return local
                if local == "busy" or (local is None and owner_alive(intent["owner"])):
                    raise StepInProgress(f"episode {episode_id}: seq {seq_no} is being executed by service "
                                         f"process {intent['owner']}; ask action_status or retry the same key")
                # dead: its owner process died, or it is this process's own (or another service's of
                # this process) and nobody holds its outcome: the step may have run
                self._scrub(episode_id)                  # a cached object may have run it: never reuse it
                if not self._pure(row):
                    why = (f"step {seq_no} (key {key!r}) is in doubt: service process {intent['owner']} died "
                           f"(or lost track of it) between claiming and recording it, and the environment may have executed it")
                    self.db.execute("UPDATE transitions SET phase = ?, error = ? WHERE episode_id = ? AND seq_no = ?",
                                    (FAILED, why, episode_id, seq_no))
                    self.db.execute("UPDATE episodes SET status = ?, error = ?, updated = ? WHERE episode_id = ?",
                                    (FAILED, why, now, episode_id))
                    self._insert_event(episode_id, "in_doubt", why)
                    self._scrub(episode_id)
                    raise StepInDoubt(f"episode {episode_id}: {why}; it is not executed again (the episode "
                                      f"fails; declare the environment `pure = True` if its step has no "
                                      f"effect outside its state)")
                self.db.execute("UPDATE transitions SET owner = ? WHERE episode_id = ? AND seq_no = ?",
                                (self.owner, episode_id, seq_no))
                self._insert_event(episode_id, "reclaimed_intent", f"seq {seq_no} from {intent['owner']}")
            else:
                self.db.execute("INSERT INTO transitions (episode_id, seq_no, idempotency_key, action, phase, owner, "
                                "created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                (episode_id, seq_no, key, _canonical(action), PENDING, self.owner, now))
            return row

    def _execute(self, row: sqlite3.Row, action: dict[str, Any], seq_no: int, key: str) -> _Outcome:
        """Phase 2, outside any transaction: step the environment at the committed state."""
        episode_id = row["episode_id"]
        try:
            env = self._env(row)
        except Exception as err:  # noqa: BLE001 - nothing ran: withdraw the intent, rebuild next time
            self._scrub(episode_id)
            detail = f"seq {seq_no}: the environment could not be rebuilt: {_describe(err)}"
            with contextlib.suppress(sqlite3.Error, EnvServiceError), self._transaction():
                self.db.execute("DELETE FROM transitions WHERE episode_id = ? AND seq_no = ? AND phase = ?",
                                (episode_id, seq_no, PENDING))
                self._insert_event(episode_id, "step_error", detail)
            raise EnvStepError(f"episode {episode_id} step {seq_no}: {detail}") from err
        stage = "step()"
        try:
            transition = env.step(action)
            stage = "state_dict()"
            state = env.state_dict()
            stage = "result"
            result, state_json = _canonical(transition.to_dict()), _canonical(state)
            outcome = _Outcome(seq_no, _canonical(action), result, state_json, bool(transition.done), None)
        except Exception as err:  # noqa: BLE001 - it may have run: the step's recorded failure
            self._scrub(episode_id)
            why = (f"the environment's {stage} raised {_describe(err)}" if stage != "result" else
                   f"the environment returned a step result or state that is not JSON-serialisable ({_describe(err)}); "
                   f"fix its step()/state_dict()")
            outcome = _Outcome(seq_no, _canonical(action), None, None, False, why)
        else:
            self._envs[episode_id] = (env, seq_no)
        self._unwritten[(episode_id, key)] = outcome
        return outcome

    def _record(self, episode_id: str, key: str, outcome: _Outcome, *, token: str | None = None) -> None:
        """Phase 3: commit the outcome; if the database refuses, keep it for the retry of `key`. A
        retry (`token` given) is authorised first. Only an active episode gets a new status and
        lease; into one closed, reclaimed or failed meanwhile the step's facts are recorded and
        `LeaseError` tells the caller that its episode is gone."""
        gone = None
        try:
            with self._transaction():
                now = self.clock()
                if token is not None:
                    self._authorize(episode_id, token, now)
                status = self._row("SELECT status FROM episodes WHERE episode_id = ?", episode_id)["status"]
                active = status == ACTIVE
                if outcome.error is None:
                    self.db.execute("UPDATE transitions SET phase = ?, result = ? WHERE episode_id = ? AND seq_no = ?",
                                    (COMMITTED, outcome.result, episode_id, outcome.seq_no))
                    self.db.execute("UPDATE episodes SET last_seq = ?, state = ?, updated = ? WHERE episode_id = ?",
                                    (outcome.seq_no, outcome.state, now, episode_id))
                    if active:
                        self.db.execute("UPDATE episodes SET status = ?, lease_expires = ? WHERE episode_id = ?",
                                        (DONE if outcome.done else ACTIVE, now + self.lease_ttl_s, episode_id))
                    self._insert_event(episode_id, "step", f"seq {outcome.seq_no}" + ("" if active else
                                                                                      f" (episode {status})"))
                else:
                    self.db.execute("UPDATE transitions SET phase = ?, error = ? WHERE episode_id = ? AND seq_no = ?",
                                    (FAILED, outcome.error, episode_id, outcome.seq_no))
                    if active:
                        self.db.execute("UPDATE episodes SET status = ?, error = ?, updated = ? WHERE episode_id = ?",
                                        (FAILED, outcome.error, now, episode_id))
                    self._insert_event(episode_id, "step_failed", f"seq {outcome.seq_no}: {outcome.error}")
                if not active:
                    gone = status
        except DatabaseBusy as err:
            raise ResultNotWritten(f"episode {episode_id} step {outcome.seq_no} executed but its record could not "
                                   f"be written ({err}); retry the same key: it is answered from memory, not "
                                   f"executed again") from err
        self._unwritten.pop((episode_id, key), None)
        if gone is not None:
            self._scrub(episode_id)
            raise LeaseError(f"episode {episode_id} was {gone} while step {outcome.seq_no} ran: the step is recorded "
                             f"(a reopened episode replays it), the episode is not revived")

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """`BEGIN IMMEDIATE` (the database's write lock, waiting up to the busy timeout) ... COMMIT.
        A refusal (EnvServiceError) commits what was recorded before it (audit events, reclaims);
        any other error rolls back."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as err:
            raise DatabaseBusy(f"{self.db_path}: {err}") from err
        try:
            yield
        except EnvServiceError:
            self.db.execute("COMMIT")
            raise
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        try:
            self.db.execute("COMMIT")
        except sqlite3.OperationalError as err:
            self.db.execute("ROLLBACK")
            raise DatabaseBusy(f"{self.db_path}: {err}") from err

    def _row(self, sql: str, *args: Any) -> sqlite3.Row | None:
        cur = self.db.execute(sql, args)
        cur.row_factory = sqlite3.Row
        return cur.fetchone()

    def _insert_event(self, episode_id: str | None, kind: str, detail: str | None) -> None:
        self.db.execute("INSERT INTO events (time, episode_id, kind, detail) VALUES (?, ?, ?, ?)",
                        (self.clock(), episode_id, kind, detail))
        if self.audit is not None and kind in AUDITED:
            self.audit.record(f"env_{kind}", episode=episode_id, detail=detail, service=self.owner)

    def _authorize(self, episode_id: str, token: str, now: float) -> sqlite3.Row:
        """Inside a transaction: the episode's current row, if `token` may use it."""
        row = self._row("SELECT * FROM episodes WHERE episode_id = ?", episode_id)
        if row is None:
            raise LeaseError(f"unknown episode {episode_id}")
        if not hmac.compare_digest(row["token_hash"], _hash(token)):
            self._insert_event(episode_id, "bad_token", None)
            raise LeaseError(f"episode {episode_id}: invalid capability token")
        if row["status"] in (CLOSED, RECLAIMED):
            self._insert_event(episode_id, "refused", f"episode is {row['status']}")
            raise LeaseError(f"episode {episode_id} is {row['status']}")
        if row["lease_expires"] < now:
            self.db.execute("UPDATE episodes SET status = ?, updated = ? WHERE episode_id = ?",
                            (RECLAIMED, now, episode_id))
            self._insert_event(episode_id, "reclaimed", "lease expired (on access)")
            self._scrub(episode_id)
            raise LeaseError(f"episode {episode_id}: lease expired at {row['lease_expires']:.3f}")
        return row

    def _recorded(self, episode_id: str, key: str, action: dict[str, Any], seq_no: int) -> StepReply | None:
        row = self._row("SELECT * FROM transitions WHERE episode_id = ? AND idempotency_key = ?", episode_id, key)
        if row is None:
            return None
        if row["action"] != _canonical(action) or row["seq_no"] != seq_no:
            self._insert_event(episode_id, "idempotency_conflict", f"key {key}")
            raise IdempotencyConflict(f"episode {episode_id}: key {key!r} was recorded for seq {row['seq_no']} with "
                                      f"a different action")
        if row["phase"] == FAILED:
            self._insert_event(episode_id, "replay_failure", f"seq {seq_no} key {key}")
            raise EnvStepError(f"episode {episode_id} step {seq_no}: {row['error']} (recorded; not executed again)")
        if row["phase"] == PENDING:
            return None                              # the caller decides: in progress, in doubt or ours
        return StepReply(row["seq_no"], Transition.from_dict(json.loads(row["result"])), replayed=True)

    def _pure(self, row: sqlite3.Row) -> bool:
        cached = self._envs.get(row["episode_id"])
        if cached is not None:
            return bool(getattr(cached[0], "pure", False))
        env = self.make_env(row["task"], TaskInstance.from_dict(json.loads(row["instance"])))
        try:
            return bool(getattr(env, "pure", False))
        finally:
            env.close()

    def _env(self, row: sqlite3.Row) -> Environment:
        """The episode's environment at the database's last sequence number: the cached object only if
        it is exactly there (another process may have stepped the episode since), else rebuilt."""
        cached = self._envs.get(row["episode_id"])
        if cached is not None and cached[1] == row["last_seq"]:
            return cached[0]
        self._scrub(row["episode_id"])
        instance = TaskInstance.from_dict(json.loads(row["instance"]))
        env = self.make_env(row["task"], instance)
        env.reset(instance, row["seed"])
        env.load_state_dict(json.loads(row["state"]))
        self._envs[row["episode_id"]] = (env, row["last_seq"])
        return env

    def _scrub(self, episode_id: str) -> None:
        cached = self._envs.pop(episode_id, None)
        if cached is not None:
            cached[0].close()
