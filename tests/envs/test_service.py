"""The leased environment service: idempotency, ordering, leases, durability across a crash."""

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
    EnvService,
    EnvStepError,
    EpisodeDone,
    IdempotencyConflict,
    LeaseError,
    OutOfOrder,
)
from tests.envs.helpers import counter_instance, executions, make_counter_env
from tests.launch import ROOT, env_with_repo


@pytest.fixture
def paths(tmp_path):
    return tmp_path / "envs.sqlite", str(tmp_path / "effects.log")


def service(db, **kwargs) -> EnvService:
    return EnvService(db, make_env=make_counter_env, **kwargs)


def test_duplicate_key_executes_once(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log), seed=0)
    first = svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
    again = svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
    assert not first.replayed and again.replayed
    assert again.transition == first.transition and first.transition.observation == "total 3"
    assert executions(log) == [{"n": 3}]
    with pytest.raises(IdempotencyConflict):
        svc.step(lease.episode_id, lease.token, {"n": 4}, seq_no=1, idempotency_key="a")
    assert ("replay", "seq 1 key a") in svc.events(lease.episode_id)


def test_out_of_order_and_duplicate_deliveries_are_rejected(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log), seed=0)
    eid, tok = lease.episode_id, lease.token
    with pytest.raises(OutOfOrder, match="expected 1"):
        svc.step(eid, tok, {"n": 1}, seq_no=2, idempotency_key="b")
    svc.step(eid, tok, {"n": 1}, seq_no=1, idempotency_key="a")
    with pytest.raises(OutOfOrder, match="expected 2"):
        svc.step(eid, tok, {"n": 1}, seq_no=1, idempotency_key="a-resent-under-a-new-key")
    with pytest.raises(OutOfOrder):
        svc.step(eid, tok, {"n": 1}, seq_no=3, idempotency_key="c")
    assert executions(log) == [{"n": 1}]
    assert svc.episode(eid)["last_seq"] == 1


def test_capability_token_and_reset_retry(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log), seed=0, episode_key="run/t/0")
    with pytest.raises(LeaseError, match="invalid capability token"):
        svc.step(lease.episode_id, "forged", {"n": 1}, seq_no=1, idempotency_key="a")
    svc.step(lease.episode_id, lease.token, {"n": 2}, seq_no=1, idempotency_key="a")
    retry = svc.reset("counter", counter_instance(log), seed=0, episode_key="run/t/0")
    assert retry.episode_id == lease.episode_id and retry.last_seq == 1 and retry.token != lease.token
    with pytest.raises(LeaseError):                         # the old token stopped working
        svc.step(lease.episode_id, lease.token, {"n": 2}, seq_no=2, idempotency_key="b")
    assert svc.step(retry.episode_id, retry.token, {"n": 2}, seq_no=2,
                    idempotency_key="b").transition.observation \
        == "total 4"


def test_expired_lease_is_reclaimed_and_renew_extends_it(paths):
    db, log = paths
    now = [1000.0]
    svc = service(db, lease_ttl_s=10.0, clock=lambda: now[0])
    kept = svc.reset("counter", counter_instance(log), seed=0)
    lost = svc.reset("counter", counter_instance(log), seed=1)
    svc.step(lost.episode_id, lost.token, {"n": 1}, seq_no=1, idempotency_key="a")
    assert svc.episode(lost.episode_id)["cached"]
    now[0] += 8
    svc.renew(kept.episode_id, kept.token)
    now[0] += 8                                              # lost: 8 s past its step's renewal... 16 > 10
    assert svc.reclaim_expired() == [lost.episode_id]
    record = svc.episode(lost.episode_id)
    assert record["status"] == "reclaimed" and not record["cached"]      # its environment was scrubbed
    with pytest.raises(LeaseError, match="reclaimed"):
        svc.step(lost.episode_id, lost.token, {"n": 1}, seq_no=2, idempotency_key="b")
    svc.step(kept.episode_id, kept.token, {"n": 1}, seq_no=1, idempotency_key="a")    # renewed: still fine
    now[0] += 11
    with pytest.raises(LeaseError, match="lease expired"):               # expiry noticed on access too
        svc.step(kept.episode_id, kept.token, {"n": 1}, seq_no=2, idempotency_key="b")
    assert svc.episode(kept.episode_id)["status"] == "reclaimed"


def test_transition_is_committed_before_the_reply(paths):
    db, log = paths
    seen = []

    def check(episode_id, seq_no):           # runs after commit, before step() returns
        other = sqlite3.connect(str(db))
        seen.append(other.execute("SELECT seq_no, result FROM transitions WHERE episode_id = ?",
                                  (episode_id,)).fetchall())
        other.close()

    svc = service(db, on_persisted=check)
    lease = svc.reset("counter", counter_instance(log), seed=0)
    svc.step(lease.episode_id, lease.token, {"n": 5}, seq_no=1, idempotency_key="a")
    assert seen[0][0][0] == 1 and json.loads(seen[0][0][1])["observation"] == "total 5"
    assert sqlite3.connect(str(db)).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


CRASHING_SERVICE = textwrap.dedent("""
    import json, os, sys
    from hybridrl.envs.service import EnvService
    from tests.envs.helpers import counter_instance, make_counter_env
    db, log = sys.argv[1], sys.argv[2]
    def die(episode_id, seq_no):
        if seq_no == 2:
            os._exit(17)          # persisted, never acknowledged
    svc = EnvService(db, make_env=make_counter_env, on_persisted=die)
    lease = svc.reset("counter", counter_instance(log), seed=0, episode_key="ep")
    print(json.dumps({"episode_id": lease.episode_id, "token": lease.token}), flush=True)
    svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="ep#1")
    svc.step(lease.episode_id, lease.token, {"n": 4}, seq_no=2, idempotency_key="ep#2")
    print("acknowledged", flush=True)
""")


def test_killed_after_persisting_before_acknowledging_replays_on_restart(paths):
    db, log = paths
    proc = subprocess.run([sys.executable, "-c", CRASHING_SERVICE, str(db), log], cwd=ROOT,
                          env=env_with_repo(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    lease = json.loads(proc.stdout.splitlines()[0])
    assert "acknowledged" not in proc.stdout
    assert executions(log) == [{"n": 3}, {"n": 4}]

    restarted = service(db)                          # a new process's view: nothing in memory
    eid, tok = lease["episode_id"], lease["token"]
    status = restarted.action_status(eid, tok, "ep#2")      # the client's question after the timeout
    assert status is not None and status.transition.observation == "total 7"
    assert restarted.action_status(eid, tok, "ep#3") is None
    retry = restarted.step(eid, tok, {"n": 4}, seq_no=2, idempotency_key="ep#2")
    assert retry.replayed and retry.transition.observation == "total 7"
    assert executions(log) == [{"n": 3}, {"n": 4}]           # not executed again
    final = restarted.step(eid, tok, {"n": 5}, seq_no=3, idempotency_key="ep#3")
    # state restored, not replayed
    assert final.transition.observation == "total 12" and final.transition.done
    assert executions(log) == [{"n": 3}, {"n": 4}, {"n": 5}]
    with pytest.raises(EpisodeDone):
        restarted.step(eid, tok, {"n": 1}, seq_no=4, idempotency_key="ep#4")


def test_a_crashing_environment_fails_its_step_and_keeps_the_committed_state(paths):
    """The step may have run part of its effect before raising: it is that step's recorded failure
    (the episode fails), never stepped again; the committed state stays what it was."""
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log, fail_on=99), seed=0)
    svc.step(lease.episode_id, lease.token, {"n": 2}, seq_no=1, idempotency_key="a")
    with pytest.raises(EnvStepError, match="environment crashed"):
        svc.step(lease.episode_id, lease.token, {"n": 99}, seq_no=2, idempotency_key="b")
    record = svc.episode(lease.episode_id)
    assert record["last_seq"] == 1 and record["state"] == {"total": 2} and record["status"] == "failed"
    with pytest.raises(EnvStepError, match="failed"):
        svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=2, idempotency_key="c")


def test_client_queries_status_after_an_ambiguous_timeout(paths):
    db, log = paths
    svc = service(db)
    cfg = EnvServiceConfig(db_path=str(db), step_timeout_s=0.1, max_retries=2)

    async def go():
        session = LeasedEnvSession(svc, "counter", counter_instance(log, delay=0.4), 0, "run/ep/0", cfg)
        await session.reset()
        transition = await session.step({"n": 6})
        return session, transition

    session, transition = asyncio.run(go())
    assert transition.observation == "total 6" and session.retries == 1 and session.seq == 1
    assert executions(log) == [{"n": 6}]                      # answered from the record, not re-sent

