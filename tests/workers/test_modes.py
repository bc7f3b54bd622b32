from __future__ import annotations

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
