"""The environment service under faults: a locked database before and after a step executes, an
environment whose result is not JSON, two service processes on one database, a service killed
mid-step, and a reset that reuses an episode key. Every test counts the environment's executions
(its side-effect log), so a step applied twice fails it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from hybridrl.envs.client import LeasedEnvSession
from hybridrl.envs.config import EnvServiceConfig
from hybridrl.envs.service import (
    DatabaseBusy,
    EnvService,
    EnvStepError,
    EpisodeKeyConflict,
    LeaseError,
    ResultNotWritten,
    StepInDoubt,
)
from tests.envs import helpers
from tests.envs.helpers import counter_instance, executions, hold_write_lock, make_counter_env, release_lock
from tests.launch import ROOT, env_with_repo


@pytest.fixture
def paths(tmp_path):
    return tmp_path / "envs.sqlite", str(tmp_path / "effects.log")


def service(db, **kwargs) -> EnvService:
    return EnvService(db, make_env=make_counter_env, **kwargs)


def test_locked_database_before_the_step_executes_nothing(paths):
    db, log = paths
    svc = service(db, busy_timeout_s=0.1)
    lease = svc.reset("counter", counter_instance(log), seed=0)
    locker = hold_write_lock(db)                      # another process holds the write lock
    try:
        with pytest.raises(DatabaseBusy):
            svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
        assert executions(log) == []
    finally:
        release_lock(locker)
    reply = svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
    assert reply.transition.observation == "total 3" and executions(log) == [{"n": 3}]


def test_locked_database_after_the_step_executed_is_answered_from_memory_not_run_again(paths):
    db, log = paths
    svc = service(db, busy_timeout_s=0.1)
    lease = svc.reset("counter", counter_instance(log, lock_on=4, db=str(db)), seed=0)
    eid, tok = lease.episode_id, lease.token
    svc.step(eid, tok, {"n": 3}, seq_no=1, idempotency_key="a")
    with pytest.raises(ResultNotWritten):       # the env executed, then another process locked the database
        svc.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="b")
    assert executions(log) == [{"n": 3}, {"n": 4}]
    assert svc.episode(eid)["last_seq"] == 1              # nothing recorded yet
    with pytest.raises(ResultNotWritten):                 # still locked: still not executed again
        svc.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="b")
    release_lock(helpers.LOCKERS.pop())
    reply = svc.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="b")
    assert reply.transition.observation == "total 7"       # the first execution's result, recorded now
    assert executions(log) == [{"n": 3}, {"n": 4}]
    record = svc.episode(eid)
    assert record["last_seq"] == 2 and record["state"] == {"total": 7}
    # a fresh process sees the same: the record, not a re-execution
    again = service(db).step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="b")
    assert again.replayed and again.transition.observation == "total 7"
    assert service(db).step(eid, tok, {"n": 1}, seq_no=3, idempotency_key="c").transition.observation == "total 8"
    assert executions(log) == [{"n": 3}, {"n": 4}, {"n": 1}]


def test_client_retries_a_locked_database_under_the_same_key(paths):
    db, log = paths
    svc = service(db, busy_timeout_s=0.05)
    cfg = EnvServiceConfig(db_path=str(db), max_retries=50)

    async def go():
        session = LeasedEnvSession(svc, "counter", counter_instance(log, lock_on=4, db=str(db)), 0, "run/ep/0", cfg)
        await session.reset()
        await session.step({"n": 3})
        step = asyncio.create_task(session.step({"n": 4}))
        while session.retries < 2:                 # refused at least twice while the lock is held
            await asyncio.sleep(0.02)
        release_lock(helpers.LOCKERS.pop())
        return session, await step

    session, transition = asyncio.run(go())
    assert transition.observation == "total 7" and session.seq == 2
    assert executions(log) == [{"n": 3}, {"n": 4}]


def test_client_retries_a_reset_refused_for_a_locked_database(paths):
    db, log = paths
    svc = service(db, busy_timeout_s=0.05)
    cfg = EnvServiceConfig(db_path=str(db), max_retries=50)
    locker = hold_write_lock(db)                      # another process holds the write lock

    async def go():
        session = LeasedEnvSession(svc, "counter", counter_instance(log), 0, "run/ep/0", cfg)
        reset = asyncio.create_task(session.reset())
        while session.retries < 2 and not reset.done():    # refused at least twice while the lock is held
            await asyncio.sleep(0.02)
        release_lock(locker)
        await reset
        return session, await session.step({"n": 3})

    session, transition = asyncio.run(go())
    assert transition.observation == "total 3" and session.seq == 1
    with sqlite3.connect(db) as conn:                 # one episode, however many tries
        assert conn.execute("SELECT count(*) FROM episodes").fetchone()[0] == 1
    assert executions(log) == [{"n": 3}]


def test_a_service_opens_a_made_database_while_another_process_holds_its_write_lock(paths):
    db, log = paths
    lease = service(db).reset("counter", counter_instance(log), seed=0)
    locker = hold_write_lock(db)                      # e.g. the other rank's episodes
    try:
        other = service(db, busy_timeout_s=0.05)      # a validation's service: no write needed to open it
        assert other.episode(lease.episode_id)["last_seq"] == 0
    finally:
        release_lock(locker)


def test_a_result_that_is_not_json_is_a_recorded_failure_never_executed_again(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log, bad_info_on=4), seed=0)
    eid, tok = lease.episode_id, lease.token
    svc.step(eid, tok, {"n": 3}, seq_no=1, idempotency_key="a")
    with pytest.raises(EnvStepError, match="not JSON-serialisable"):
        svc.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="b")
    with pytest.raises(EnvStepError, match="recorded; not executed again"):
        svc.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="b")
    with pytest.raises(EnvStepError, match="not JSON-serialisable"):
        service(db).action_status(eid, tok, "b")
    with pytest.raises(EnvStepError, match="failed"):
        svc.step(eid, tok, {"n": 1}, seq_no=2, idempotency_key="c")
    assert executions(log) == [{"n": 3}, {"n": 4}]
    record = svc.episode(eid)
    assert record["status"] == "failed" and record["state"] == {"total": 3} and record["last_seq"] == 1


def _service_process(db):
    proc = subprocess.Popen([sys.executable, "-m", "tests.envs.helpers", str(db)], cwd=ROOT, env=env_with_repo(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert "ready" in json.loads(proc.stdout.readline())
    return proc


def _send(proc, lease, n, seq, key):
    proc.stdin.write(json.dumps({"episode_id": lease.episode_id, "token": lease.token, "action": {"n": n},
                                 "seq": seq, "key": key}) + "\n")
    proc.stdin.flush()


def _reply(proc):
    return json.loads(proc.stdout.readline())


def test_two_service_processes_on_one_database_lose_no_update(paths):
    db, log = paths
    lease = service(db).reset("counter", counter_instance(log, delay=0.2), seed=0)
    a, b = _service_process(db), _service_process(db)
    try:
        _send(a, lease, 3, 1, "k1")
        assert _reply(a)["observation"] == "total 3"
        _send(b, lease, 4, 2, "k2")                # b rebuilds from the database: 3 + 4
        assert _reply(b)["observation"] == "total 7"
        _send(a, lease, 2, 3, "k3")                # a's cached env is at seq 1: it must not be used
        assert _reply(a)["observation"] == "total 9"
        # both processes race for seq 4 under different keys: exactly one executes
        _send(a, lease, 1, 4, "k4a")
        _send(b, lease, 1, 4, "k4b")
        replies = [_reply(a), _reply(b)]
        won = [r for r in replies if "observation" in r]
        lost = [r for r in replies if "error" in r]
        assert len(won) == 1 and won[0]["observation"] == "total 10", replies
        assert len(lost) == 1 and lost[0]["error"] in ("OutOfOrder", "StepInProgress", "EpisodeDone"), replies
    finally:
        for proc in (a, b):
            proc.stdin.close()
            proc.wait(timeout=60)
    assert executions(log) == [{"n": 3}, {"n": 4}, {"n": 2}, {"n": 1}]
    record = service(db).episode(lease.episode_id)
    assert record["state"] == {"total": 10} and record["last_seq"] == 4


DIES_MID_STEP = textwrap.dedent("""
    import json, sys
    from hybridrl.envs.service import EnvService
    from tests.envs.helpers import counter_instance, make_counter_env
    db, log, pure = sys.argv[1], sys.argv[2], sys.argv[3] == "pure"
    svc = EnvService(db, make_env=make_counter_env)
    lease = svc.reset("counter", counter_instance(log, die_on=4, pure=pure), seed=0, episode_key="ep")
    print(json.dumps({"episode_id": lease.episode_id, "token": lease.token}), flush=True)
    svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="ep#1")
    svc.step(lease.episode_id, lease.token, {"n": 4}, seq_no=2, idempotency_key="ep#2")   # dies inside
""")


def _die_mid_step(db, log, pure: bool):
    proc = subprocess.run([sys.executable, "-c", DIES_MID_STEP, str(db), log, "pure" if pure else "effects"],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 19, proc.stderr
    assert executions(log) == [{"n": 3}, {"n": 4}]          # the effect of seq 2 happened, unrecorded
    lease = json.loads(proc.stdout.splitlines()[0])
    return lease["episode_id"], lease["token"]


def test_a_service_killed_mid_step_never_applies_the_step_twice(paths):
    db, log = paths
    eid, tok = _die_mid_step(db, log, pure=False)
    restarted = service(db)
    with pytest.raises(StepInDoubt, match="died"):
        restarted.action_status(eid, tok, "ep#2")
    with pytest.raises(StepInDoubt, match="not executed again"):
        restarted.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="ep#2")
    with pytest.raises(EnvStepError, match="in doubt"):               # recorded: every later try says so
        service(db).step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="ep#2")
    assert executions(log) == [{"n": 3}, {"n": 4}]
    record = restarted.episode(eid)
    assert record["status"] == "failed" and "in doubt" in record["error"] and record["state"] == {"total": 3}


def test_a_pure_environment_killed_mid_step_is_stepped_again_from_its_committed_state(paths):
    db, log = paths
    eid, tok = _die_mid_step(db, log, pure=True)
    restarted = service(db)
    reply = restarted.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="ep#2")
    assert reply.transition.observation == "total 7" and not reply.replayed     # 3 + 4 once, not 3 + 4 + 4
    assert restarted.episode(eid)["state"] == {"total": 7}
    assert any(kind == "reclaimed_intent" and detail.startswith("seq 2 from ")
               for kind, detail in restarted.events(eid))


def test_reset_with_a_reused_episode_key_and_a_different_episode_is_refused(paths):
    db, log = paths
    svc = service(db)
    first = svc.reset("counter", counter_instance(log), seed=0, episode_key="run/t/0")
    svc.step(first.episode_id, first.token, {"n": 2}, seq_no=1, idempotency_key="a")
    with pytest.raises(EpisodeKeyConflict, match="different seed"):
        svc.reset("counter", counter_instance(log), seed=1, episode_key="run/t/0")
    with pytest.raises(EpisodeKeyConflict, match="different instance"):
        svc.reset("counter", counter_instance(log, other=1), seed=0, episode_key="run/t/0")
    with pytest.raises(EpisodeKeyConflict, match="different task"):
        service(db).reset("guess_number", counter_instance(log), seed=0, episode_key="run/t/0")
    # the first client's token still works
    assert svc.step(first.episode_id, first.token, {"n": 2}, seq_no=2,
                    idempotency_key="b").transition.observation == "total 4"
    assert [k for k, _ in svc.events(first.episode_id)].count("reset_conflict") == 3
    with pytest.raises(LeaseError):
        svc.step(first.episode_id, "forged", {"n": 2}, seq_no=3, idempotency_key="c")


class _RefusesWal(sqlite3.Connection):
    """A connection whose first `refusals` attempts at the journal mode get SQLite's immediate "database is
    locked" (what a second connection gets while the last one to close a WAL database cleans it up, or
    while two connections would deadlock on the switch: no busy handler runs)."""

    refusals = 0

    def execute(self, sql, *args):
        if sql.startswith("PRAGMA journal_mode") and type(self).refusals > 0:
            type(self).refusals -= 1
            raise sqlite3.OperationalError("database is locked")
        return super().execute(sql, *args)


def test_a_refused_switch_to_wal_is_tried_again_within_the_busy_timeout(paths, tmp_path):
    from hybridrl.envs.service_db import enter_wal

    db = sqlite3.connect(tmp_path / "fresh.sqlite", factory=_RefusesWal, isolation_level=None)
    _RefusesWal.refusals = 3
    enter_wal(db, timeout_s=5.0)
    assert _RefusesWal.refusals == 0 and db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other = sqlite3.connect(tmp_path / "other.sqlite", factory=_RefusesWal, isolation_level=None)
    _RefusesWal.refusals = 10**6                       # never free: the refusal surfaces after the timeout
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        enter_wal(other, timeout_s=0.2)
