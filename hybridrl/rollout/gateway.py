"""`RolloutGateway`: one `RolloutEngine` in front of several (data-parallel replicas).

Routing: a request goes to the replica its prefix hashes to (the first `affinity_tokens` ids),
so the turns of one agent episode and the n samples of one prompt meet the prefix cache that
already holds their KV; when that replica has `max_imbalance` more requests in flight than the
least loaded one, the request spills to the least loaded instead.
Backpressure: at most `max_inflight` requests are inside the engines; further callers wait
(in arrival order) for a slot, so a burst of agent episodes queues here, bounded, instead of
growing every engine's queue.
Weights and memory calls (update_weights, sleep, wake_up) go to every replica.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from typing import Any, Iterable, Sequence

from hybridrl.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams


class RolloutGateway:
    def __init__(self, engines: Sequence[RolloutEngine], *, max_inflight: int = 256, affinity_tokens: int = 64,
                 max_imbalance: int = 8):
        if not engines:
            raise ValueError("RolloutGateway needs at least one engine")
        if max_inflight < 1 or affinity_tokens < 1 or max_imbalance < 0:
            raise ValueError("max_inflight and affinity_tokens must be >= 1, max_imbalance >= 0")
        self.engines = list(engines)
        self.max_inflight = max_inflight
        self.affinity_tokens = affinity_tokens
        self.max_imbalance = max_imbalance
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._load = [0] * len(self.engines)
        self._where: dict[str, int] = {}
        self.counters = {"routed": [0] * len(self.engines), "spilled": 0, "waited_for_slot": 0}

    @property
    def policy_version(self) -> int:
        """The version every replica serves (the oldest one while an update is rolling out)."""
        return min(e.policy_version for e in self.engines)

    def route(self, token_ids: Sequence[int]) -> int:
        """The replica for a prompt: its prefix's home, unless that one is overloaded."""
        prefix = array("q", list(token_ids[: self.affinity_tokens])).tobytes()
        home = int.from_bytes(hashlib.blake2b(prefix, digest_size=8).digest(), "little") % len(self.engines)
        least = min(range(len(self.engines)), key=self._load.__getitem__)
        if self._load[home] - self._load[least] > self.max_imbalance:
            self.counters["spilled"] += 1
            return least
        return home

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:   # a semaphore belongs to one loop
            self._slots = asyncio.Semaphore(self.max_inflight - sum(self._load))
            self._slots_loop = loop
        return self._slots

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        slots = self._semaphore()
        if slots.locked():
            self.counters["waited_for_slot"] += 1
        async with slots:
            i = self.route(token_ids)
            self._load[i] += 1
            self._where[request_id] = i
            self.counters["routed"][i] += 1
            try:
                return await self.engines[i].generate(token_ids, sampling, request_id)
            finally:
                self._load[i] -= 1
                self._where.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        i = self._where.get(request_id)
        return False if i is None else await self.engines[i].abort(request_id)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        items = list(named_tensors)
        await asyncio.gather(*[e.update_weights(items, version) for e in self.engines])

    async def sleep(self) -> None:
        await asyncio.gather(*[e.sleep() for e in self.engines])

    async def wake_up(self) -> None:
        await asyncio.gather(*[e.wake_up() for e in self.engines])

    def stats(self) -> dict[str, Any]:
        return {"inflight": list(self._load), **{k: (list(v) if isinstance(v, list) else v)
                                                 for k, v in self.counters.items()},
                "engines": [e.stats() for e in self.engines]}
