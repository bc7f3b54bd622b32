"""`RankWorker`: what an RL rank serves: the parts its placement gave it (a training side, a rollout
side, the link between them, fault injection), and the calls that concern the whole rank.

    memory_report()    what this rank holds now (each part's memory, the process's resident size, the
                       phases so far, the mode when it switches)
    peak_rss_bytes()   the process's resident high-water mark since it started
    close()            every part closes (engines, tools, threads)
"""

from __future__ import annotations

from typing import Any, Iterable

from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.distributed.mesh import Mesh
from hybridrl.workers.base import Part, Worker, register
from hybridrl.workers.modes import Phases


class RankWorker(Worker):
    def __init__(self, ctx: Any, parts: Iterable[Part], meshes: dict[str, Mesh], phases: Phases):
        super().__init__(ctx, parts, meshes)
        self.phases = phases

    @register(dispatch=ONE_TO_ALL)
    def memory_report(self) -> dict:
        """Optimizer state and gradient bytes by accounting, KV cache, staging buffers, RSS, phases."""
        import psutil

        out: dict[str, Any] = {}
        for part in self.parts[1:]:
            out.update(part.memory())
        out.update(rss_bytes=psutil.Process().memory_info().rss, phases=self.phases.summary())
        return out

    @register(dispatch=ONE_TO_ALL)
    def peak_rss_bytes(self) -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # KiB on Linux

    @register(dispatch=ONE_TO_ALL)
    def close(self) -> None:
        for part in reversed(self.parts[1:]):
            part.close()
