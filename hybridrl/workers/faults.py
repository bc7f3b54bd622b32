"""The worker side of fault injection (`controller/faults.py`): a fault armed on one rank fires once,
at its first chance, where a real one would happen.

    engine     the rollout engine's next forward step fails (every request in flight fails with it)
    tool       the next tool call's backend fails (an infrastructure error of that call)
    reward     the task's verifier raises on the next episode it scores
    env_kill   the environment service SIGKILLs its process after its next commit, before replying
    disk_full  this rank's next checkpoint write fails with ENOSPC

The rollout-side faults go to the last rank that holds an engine, `disk_full` to the last rank that
trains (the disaggregated placement's rollout ranks write no checkpoint).
"""

from __future__ import annotations

import errno
import os
import signal

from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.workers.base import register


class FaultMixin:
    """Mixed into `HybridWorker`; expects self.ctx, self.meshes(), self.engine, self.tools, self.task,
    self.runner and self._run."""

    _disk_full: str | None = None

    @register(dispatch=ONE_TO_ALL)
    def arm_fault(self, *, kind: str, spec: str) -> None:
        if self.ctx.rank != self._fault_target(kind):
            return
        message = f"fault injection: {spec}"
        if kind == "engine":
            core = getattr(self.engine, "core", None)
            if core is None:
                raise ValueError(f"{spec}: engine faults are injected into the native engine "
                                 "(rollout.engine=native)")
            self._run(self.engine.run_in_engine(lambda c: c.inject_failure(message)))
        elif kind == "tool":
            self.tools.fail_next(message)
        elif kind == "reward":
            task = self.task

            def failing(instance, outcome):
                del task.score                     # once: the class's verifier serves the next episodes
                raise RuntimeError(message)

            task.score = failing
        elif kind == "env_kill":
            service = getattr(self.runner.envs, "service", None)
            if service is None:
                raise ValueError(f"{spec}: task {self.cfg.task.name!r} has no environment (make_env), so "
                                 "there is no environment service to kill")
            service.on_persisted = lambda episode_id, seq_no: os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "disk_full":
            self._disk_full = message
        else:
            raise ValueError(f"{spec}: no worker-side fault of kind {kind!r}")

    def _fault_target(self, kind: str) -> int:
        if kind == "disk_full":
            return max(self.meshes()["train"].ranks)
        rollout = self.meshes()["rollout"]
        return max(r for r in rollout.ranks if rollout.coords(r)["tp"] == 0)

    def _check_disk(self) -> None:
        """Where a checkpoint write begins: an armed `disk_full` fails it as a full disk would."""
        if self._disk_full is not None:
            message, self._disk_full = self._disk_full, None
            raise OSError(errno.ENOSPC, f"No space left on device ({message})")
