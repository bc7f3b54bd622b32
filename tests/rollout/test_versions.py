from __future__ import annotations

import pytest

from hybridrl.rollout.versions import Publication


def test_version_switches_only_when_every_tensor_arrived():
    p = Publication(["a", "b", "c"], version=0)
    assert not p.arrive(["a"], 1) and p.version == 0
    assert not p.arrive(["b"], 1) and p.version == 0
    assert p.completes(["c"], 1) and not p.completes(["a"], 1)
    assert p.arrive(["c", "a"], 1) and p.version == 1
    assert not p.arrive(["a", "b"], 2)
    assert not p.arrive(["a"], 3) and p.version == 1       # a newer version supersedes an incomplete one
    with pytest.raises(ValueError, match=r"version 2 is older than an update in progress \(version 3\)"):
        p.arrive(["c"], 2)
    assert p.arrive(["b", "c"], 3) and p.version == 3 and p.pending is None
    with pytest.raises(ValueError, match=r"older than the current policy \(version 3\)"):
        p.check(2)
    p.forget()                                               # the engine dropped its weights
    assert p.version == -1 and not p.arrive(["a", "b"], 3) and p.pending == 3
    assert p.arrive(["c"], 3) and p.version == 3
