"""GroupQueue: bounds hold with a producer 10x faster than the consumer; every drop is counted."""

from __future__ import annotations

import threading
import time

import pytest

from hybridrl.data.queue import GroupQueue, QueueFull, group_tokens
from hybridrl.data.trajectory import Trajectory


def _group(i: int, size: int = 2, tokens: int = 10) -> list[Trajectory]:
    out = []
    for a in range(size):
        t = Trajectory(run_id="r", task_id=f"p{i}", group_id=f"p{i}@0", attempt=a, prompt_ids=[1] * 4)
        t.append([5] * (tokens - 4), policy=True, logprobs=[-1.0] * (tokens - 4), version=0)
        out.append(t)
    return out


def _run(queue: GroupQueue, produce: int, put_timeout: float | None, start_when) -> tuple[list[int], list[int]]:
    """A producer thread 10x faster than the consumer thread; the consumer starts once `start_when(queue)`
    (the queue has been full at least once), so that the policy is exercised whatever the load."""
    consumed, peaks = [], []
    done = threading.Event()

    def producer():
        for i in range(produce):
            queue.put(_group(i), timeout=put_timeout)
            time.sleep(0.0005)
        done.set()

    def consumer():
        while not start_when(queue) and not done.is_set():
            time.sleep(0.001)
        while not (done.is_set() and len(queue) == 0):
            peaks.append(len(queue))
            consumed.extend(int(g[0].task_id[1:]) for g in queue.get(1))
            time.sleep(0.005)                      # 10x slower than the producer

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return consumed, peaks


def test_block_holds_the_bound_and_loses_nothing():
    q = GroupQueue(max_groups=3, policy="block")
    consumed, peaks = _run(q, produce=40, put_timeout=60, start_when=lambda q: q.counts["blocked"] > 0)
    assert consumed == list(range(40))                       # all of them, in order
    assert q.peak["groups"] <= 3 and max(peaks) <= 3
    assert q.counts["dropped_groups"] == 0 and q.counts["blocked"] > 0


def test_drop_oldest_holds_token_and_byte_bounds_and_counts_every_drop():
    per_group = group_tokens(_group(0))
    q = GroupQueue(max_groups=100, max_tokens=3 * per_group, max_bytes=10 ** 6, policy="drop_oldest")
    consumed, _ = _run(q, produce=40, put_timeout=None, start_when=lambda q: q.counts["dropped_groups"] > 0)
    assert q.peak["tokens"] <= 3 * per_group and q.peak["groups"] <= 3
    assert consumed == sorted(consumed)                       # FIFO among the survivors
    c = q.counts
    assert c["dropped_groups"] > 0 and c["dropped_trajectories"] == 2 * c["dropped_groups"]
    assert c["dropped_tokens"] == per_group * c["dropped_groups"]
    assert len(consumed) + c["dropped_groups"] + len(q) == 40      # every group accounted for


def test_a_full_block_queue_times_out_and_an_oversized_group_is_refused():
    q = GroupQueue(max_groups=1, policy="block")
    q.put(_group(0))
    with pytest.raises(QueueFull):
        q.put(_group(1), timeout=0.01)
    with pytest.raises(ValueError, match="exceeds"):
        GroupQueue(max_groups=4, max_tokens=5, policy="drop_oldest").put(_group(2))
    with pytest.raises(ValueError, match="policy"):
        GroupQueue(max_groups=4, policy="resample")
