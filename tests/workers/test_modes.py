from __future__ import annotations

import threading
import time

import pytest

from hybridrl.workers.modes import IllegalTransition, Mode, ModeMachine


def test_legal_cycle_and_illegal_moves():
    m = ModeMachine()
    with pytest.raises(IllegalTransition, match="train -> rollout"):
        m.to(Mode.ROLLOUT)
    m.to(Mode.RESHARD)
    m.to(Mode.TRAIN)            # a failed publication goes back to TRAIN
    m.to(Mode.RESHARD)
    m.to(Mode.ROLLOUT)
    with pytest.raises(IllegalTransition):
        m.to(Mode.RESHARD)
    with pytest.raises(IllegalTransition, match="needs mode train"):
        m.require(Mode.TRAIN)
    m.to(Mode.TRAIN)
    m.require(Mode.TRAIN)


def test_phases_are_timed_and_summarised():
    m = ModeMachine()
    for i in range(3):
        with m.phase("offload") as rec:
            time.sleep(0.01 * (i + 1))
            rec.bytes_moved = 100 * (i + 1)
    s = m.summary()["offload"]
    assert s["count"] == 3 and s["bytes"] == 200 and 0.015 < s["median_s"] < 0.2 and s["peak_mem_bytes"] > 0
    assert m.last()["offload"]["bytes"] == 300


def test_a_switch_waits_for_every_rank_until_its_deadline_and_names_who_is_missing():
    """Two ranks' machines on one store: rank 1 never comes, so rank 0's arrival at the switch ends at
    its first phase's deadline naming rank 1; a phase alone waits for nobody; an arrival key is deleted
    once no rank can still be reading it, and the time waited is the first phase's `arrival_s`."""
    import torch.distributed as dist

    from hybridrl.workers.modes import Arrivals, PhaseTimeout

    store = dist.HashStore()
    m = ModeMachine(rank=0, deadlines={"offload": 0.3}, arrivals=Arrivals(store, 0, [0, 1]))
    started = time.monotonic()
    with pytest.raises(PhaseTimeout, match=r"rank 0: phase 'offload' of a mode switch exceeded its 0.3s deadline "
                                           r"\(hybrid.offload_deadline_s\) waiting for rank\(s\) \[1\] to arrive"):
        m.arrive("offload")
    assert 0.3 <= time.monotonic() - started < 2.0
    with m.phase("offload"):                    # the phase itself waits for no rank: the switch's arrival did
        pass
    with m.phase("generate"):                   # no deadline: not a switch phase
        pass
    import threading

    other = Arrivals(store, 1, [0, 1])
    for switch in (1, 2, 3):                    # rank 1 comes now, late: rank 0 waits for it, then passes
        m.switches = switch
        late = threading.Timer(0.05, other.wait, args=(f"{switch}/offload", None))
        late.start()
        m.arrive("offload")
        with m.phase("offload"):
            pass
        late.join()
        assert m.last()["offload"]["arrival_s"] >= 0.04
    assert m.arrivals.settle()                  # the old barriers' keys are deleted on a background thread
    assert store.check(["arrive/3/offload/0", "arrive/2/offload/0"]) and not store.check(["arrive/1/offload/0"])
    assert not store.check(["arrive/1/offload/all"]) and store.check(["arrive/3/offload/all"])


def test_the_arrival_carries_every_ranks_vote_to_every_rank():
    """Each rank votes at the switch's arrival (e.g. "my engine does not serve this version", its reason
    to refuse the publication); every rank reads every rank's vote, whichever arrived last."""
    import threading

    import torch.distributed as dist

    from hybridrl.workers.modes import Arrivals

    store = dist.HashStore()
    machines = [ModeMachine(rank=r, deadlines={"offload": 5.0}, arrivals=Arrivals(store, r, [0, 1])) for r in (0, 1)]
    votes = [{"stale": False, "refusal": None}, {"stale": True, "refusal": "dtype float32, expected bfloat16"}]
    for first in (0, 1):                        # either rank the last to arrive
        for m in machines:
            m.switches += 1
        answers = {}
        early = threading.Thread(target=lambda: answers.__setitem__(first, machines[first].arrive(
            "offload", vote=votes[first])))
        early.start()
        time.sleep(0.05)
        answers[1 - first] = machines[1 - first].arrive("offload", vote=votes[1 - first])
        early.join()
        assert answers[0] == answers[1] == {0: votes[0], 1: votes[1]}
    assert machines[0].arrive("sleep") == {}                  # no vote; no deadline for it here: nobody awaited
    alone = ModeMachine(rank=0, deadlines={"offload": 5.0})
    assert alone.arrive("offload", vote={"stale": True}) == {0: {"stale": True}}


def test_work_that_cannot_be_interrupted_is_reported_past_its_deadline_plus_grace():
    reports = []
    m = ModeMachine(rank=3, deadlines={"reload": 0.1}, on_overrun=reports.append, overrun_grace_s=0.1)
    with m.phase("reload", waits_for="the optimizer state"):
        time.sleep(1.0)                         # stuck where nothing polls (a collective, a copy)
    assert reports == ["rank 3: phase 'reload' of a mode switch exceeded its 0.1s deadline "
                       "(hybrid.reload_deadline_s) waiting for the optimizer state (stuck where it cannot be interrupted)"]
    with m.phase("reload"):                     # in time: the backstop is cancelled
        pass
    time.sleep(0.3)
    assert len(reports) == 1


def test_one_backstop_thread_serves_every_phase():
    """Arming a phase's backstop starts no thread of its own; a shorter deadline armed while the
    thread waits towards a longer one still fires in time."""
    from hybridrl.workers.modes import Backstop

    def watchers():
        return {t for t in threading.enumerate() if t.name == "hybridrl-phase-backstop"}

    reports = []
    before = watchers()                         # other tests' machines keep theirs
    m = ModeMachine(rank=0, deadlines={"sleep": 5.0}, on_overrun=reports.append, overrun_grace_s=0.0)
    for _ in range(20):
        with m.phase("sleep"):
            pass
    assert len(watchers() - before) == 1 and reports == []
    b = Backstop(reports.append)
    b.arm(10.0, "late")
    b.arm(0.05, "soon")                         # the thread sleeps towards 10 s: it must be woken
    time.sleep(0.4)
    assert reports == ["soon"]
    b.arm(0.05, "cancelled")
    b.disarm()
    time.sleep(0.2)
    assert reports == ["soon"]
