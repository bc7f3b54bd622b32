"""The environment service's third red-team: a stored outcome served before authorisation and
recorded into a closed episode, a result nested past the recursion limit (a step run twice), a
process's own intent it lost track of, and a second service in one process. Each test counts the
environment's executions (its side-effect log)."""

from __future__ import annotations

import gc

import pytest

from hybridrl.telemetry.audit import verify
from hybridrl.envs.service import EnvService, EnvStepError, LeaseError, ResultNotWritten, StepInDoubt
from tests.envs import helpers
from tests.envs.helpers import Interrupted, counter_instance, executions, make_counter_env, release_lock


@pytest.fixture
def paths(tmp_path):
    return tmp_path / "envs.sqlite", str(tmp_path / "effects.log")


def service(db, **kwargs) -> EnvService:
    return EnvService(db, make_env=make_counter_env, **kwargs)


def unwritten_step(svc, log, db):
    """An episode whose step 2 executed but could not be recorded (another process held the lock)."""
    lease = svc.reset("counter", counter_instance(log, lock_on=4, db=str(db)), seed=0, episode_key="ep")
    svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
    with pytest.raises(ResultNotWritten):
        svc.step(lease.episode_id, lease.token, {"n": 4}, seq_no=2, idempotency_key="b")
    release_lock(helpers.LOCKERS.pop())
    return lease


def test_a_forged_token_gets_nothing_from_a_stored_outcome(paths):
    db, log = paths
    svc = service(db, busy_timeout_s=0.1)
    lease = unwritten_step(svc, log, db)
    with pytest.raises(LeaseError, match="invalid capability token"):
        svc.step(lease.episode_id, "forged", {"n": 4}, seq_no=2, idempotency_key="b")
    assert svc.episode(lease.episode_id)["last_seq"] == 1          # not recorded on the forger's behalf
    assert ("bad_token", None) in svc.events(lease.episode_id)
    reply = svc.step(lease.episode_id, lease.token, {"n": 4}, seq_no=2, idempotency_key="b")
    assert reply.transition.observation == "total 7" and executions(log) == [{"n": 3}, {"n": 4}]


def test_a_stored_outcome_does_not_revive_a_closed_episode(paths):
    db, log = paths
    svc = service(db, busy_timeout_s=0.1)
    lease = unwritten_step(svc, log, db)
    svc.close(lease.episode_id, lease.token)
    with pytest.raises(LeaseError, match="closed"):
        svc.step(lease.episode_id, lease.token, {"n": 4}, seq_no=2, idempotency_key="b")
    record = svc.episode(lease.episode_id)
    assert record["status"] == "closed" and record["last_seq"] == 1
    # reopened by a retried reset (its state is in the database): the outcome is recorded now, once
    again = svc.reset("counter", counter_instance(log, lock_on=4, db=str(db)), seed=0, episode_key="ep")
    assert again.episode_id == lease.episode_id
    reply = svc.step(again.episode_id, again.token, {"n": 4}, seq_no=2, idempotency_key="b")
    assert reply.transition.observation == "total 7" and executions(log) == [{"n": 3}, {"n": 4}]


def test_a_step_recorded_after_its_episode_was_reclaimed_does_not_revive_it(paths):
    """Another service process reclaims the episode (its lease expired) while this one executes the
    step: the step's result is recorded (it ran), the episode stays reclaimed."""
    db, log = paths
    now = [1000.0]
    other = service(db, clock=lambda: now[0])

    def make_env(task, instance):
        env = make_counter_env(task, instance)
        step = env.step

        def slow_step(action):
            now[0] += 3600.0                       # the lease runs out during the step
            other.reclaim_expired()
            return step(action)

        env.step = slow_step
        return env

    svc = EnvService(db, make_env=make_env, clock=lambda: now[0], lease_ttl_s=60.0)
    lease = svc.reset("counter", counter_instance(log), seed=0)
    with pytest.raises(LeaseError, match="reclaimed"):
        svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
    record = svc.episode(lease.episode_id)
    assert record["status"] == "reclaimed" and record["lease_expires"] < now[0]
    assert record["last_seq"] == 1 and record["state"] == {"total": 3}     # what ran is recorded
    assert executions(log) == [{"n": 3}]


def test_a_result_nested_past_the_recursion_limit_is_a_recorded_failure_never_stepped_again(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log, deep_on=10), seed=0)
    svc.step(lease.episode_id, lease.token, {"n": 1}, seq_no=1, idempotency_key="a")
    for _ in range(2):                             # the step, then its retry under the same key
        with pytest.raises(EnvStepError, match="RecursionError"):
            svc.step(lease.episode_id, lease.token, {"n": 10}, seq_no=2, idempotency_key="b")
    record = svc.episode(lease.episode_id)
    assert record["status"] == "failed" and record["last_seq"] == 1 and record["state"] == {"total": 1}
    assert not record["cached"]                    # the object that ran the failed step is gone
    assert executions(log) == [{"n": 1}, {"n": 10}]


def test_an_exception_from_a_step_is_its_recorded_failure(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log, fail_on=99), seed=0)
    svc.step(lease.episode_id, lease.token, {"n": 2}, seq_no=1, idempotency_key="a")
    with pytest.raises(EnvStepError, match="environment crashed"):
        svc.step(lease.episode_id, lease.token, {"n": 99}, seq_no=2, idempotency_key="b")
    with pytest.raises(EnvStepError, match="recorded"):
        svc.step(lease.episode_id, lease.token, {"n": 99}, seq_no=2, idempotency_key="b")
    with pytest.raises(EnvStepError, match="failed"):          # the episode is over
        svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=2, idempotency_key="c")
    assert not svc.episode(lease.episode_id)["cached"]


def test_an_intent_this_process_lost_track_of_is_in_doubt(paths):
    """The step ran, then an exception no environment error handler sees (a BaseException, as KeyboardInterrupt) left
    the intent behind: the retry must not step the (already advanced) environment again."""
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log, interrupt_on=5), seed=0)
    with pytest.raises(Interrupted):
        svc.step(lease.episode_id, lease.token, {"n": 5}, seq_no=1, idempotency_key="a")
    with pytest.raises(StepInDoubt):
        svc.step(lease.episode_id, lease.token, {"n": 5}, seq_no=1, idempotency_key="a")
    assert executions(log) == [{"n": 5}] and svc.episode(lease.episode_id)["status"] == "failed"


def test_a_pure_environment_retried_after_a_lost_intent_restarts_from_the_committed_state(paths):
    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log, interrupt_on=5, pure=True), seed=0)
    svc.step(lease.episode_id, lease.token, {"n": 2}, seq_no=1, idempotency_key="a")
    with pytest.raises(Interrupted):
        svc.step(lease.episode_id, lease.token, {"n": 5}, seq_no=2, idempotency_key="b")
    svc.make_env = lambda task, inst: make_counter_env(task, counter_instance(log, pure=True))
    reply = svc.step(lease.episode_id, lease.token, {"n": 5}, seq_no=2, idempotency_key="b")
    assert reply.transition.observation == "total 7"           # 2 + 5, not 2 + 5 + 5 on the cached object


def test_a_second_service_in_one_process_is_not_stuck(paths):
    db, log = paths
    first = service(db)
    lease = first.reset("counter", counter_instance(log, interrupt_on=5), seed=0)
    with pytest.raises(Interrupted):
        first.step(lease.episode_id, lease.token, {"n": 5}, seq_no=1, idempotency_key="a")
    second = service(db)                           # same pid: the first's intent is not in progress
    with pytest.raises(StepInDoubt):
        second.step(lease.episode_id, lease.token, {"n": 5}, seq_no=1, idempotency_key="a")
    assert executions(log) == [{"n": 5}]


def test_a_second_service_in_one_process_records_what_the_first_executed(paths):
    db, log = paths
    first = service(db, busy_timeout_s=0.1)
    lease = unwritten_step(first, log, db)
    second = service(db)
    reply = second.step(lease.episode_id, lease.token, {"n": 4}, seq_no=2, idempotency_key="b")
    assert reply.transition.observation == "total 7" and executions(log) == [{"n": 3}, {"n": 4}]
    del first
    gc.collect()
    assert second.step(lease.episode_id, lease.token, {"n": 1}, seq_no=3,
                       idempotency_key="c").transition.observation == "total 8"


def test_refusals_and_revocations_go_to_the_audit_log(paths, tmp_path):
    db, log = paths
    now = [1000.0]
    svc = service(db, clock=lambda: now[0], lease_ttl_s=60.0, audit_log=str(tmp_path / "audit.jsonl"))
    lease = svc.reset("counter", counter_instance(log), seed=0)
    with pytest.raises(LeaseError):
        svc.step(lease.episode_id, "forged", {"n": 1}, seq_no=1, idempotency_key="a")
    now[0] += 3600
    svc.reclaim_expired()
    kinds = [r["kind"] for r in helpers_records(tmp_path / "audit.jsonl")]
    assert kinds == ["env_bad_token", "env_reclaimed"]
    assert verify(tmp_path / "audit.jsonl")[0]


def helpers_records(path):
    from hybridrl.telemetry.audit import records

    return list(records(path))


@pytest.mark.parametrize("bad", [2.0, 1.0, "1", True, None, 0])
def test_a_seq_no_that_is_not_a_positive_int_is_refused(paths, bad):
    """1.0 == 1 and True == 1 in Python and in SQLite: accepted, such a step named a position by a
    value of another type (the fourth red-team round stepped with seq_no=2.0). Refused with the
    reason, nothing executed or recorded; the same step with an int then runs."""
    from hybridrl.envs.service import InvalidRequest

    db, log = paths
    svc = service(db)
    lease = svc.reset("counter", counter_instance(log), seed=0, episode_key="ep")
    with pytest.raises(InvalidRequest, match="seq_no must be a positive integer"):
        svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=bad, idempotency_key="a")
    assert executions(log) == [] and svc.episode(lease.episode_id)["last_seq"] == 0
    reply = svc.step(lease.episode_id, lease.token, {"n": 3}, seq_no=1, idempotency_key="a")
    assert reply.seq_no == 1 and executions(log) == [{"n": 3}]
