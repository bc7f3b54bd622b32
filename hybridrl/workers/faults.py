"""Fault injection as wrappers: an armed fault wraps one method of the part where a real fault would
happen, fails once there, and puts the method back. The code it wraps knows nothing of it.

`fault_kinds.KINDS` is the one table of fault kinds (the controller parses `trainer.inject` against
it, and this module arms the worker-side ones):

    kind        fires                                   where
    kill_job    at any moment of a step                 the controller SIGKILLs the whole job
    kill_rank   at any moment of a step                 the controller SIGKILLs one worker rank
    engine      the step's rollout                      the native engine's next forward step raises
                                                        (every request in that step fails with it)
    tool        the step's rollout                      the next tool call's backend raises (an
                                                        infrastructure error of that call)
    reward      the step's rollout                      the task's verifier raises on the next episode
    env_kill    the step's rollout                      the environment service SIGKILLs its process
                                                        after its next commit, before replying
    disk_full   the step's checkpoint                   this rank's next checkpoint write fails (ENOSPC)
    nan         the step's update                       this rank's next optimizer step computes a NaN loss
                                                        (the gradients, reduced over the ranks, and then the
                                                        weights become NaN, as a real blow-up leaves them)
    mismatch    the step's update                       the behaviour logprobs of this rank's rows arrive
                                                        MISMATCH_NATS lower than the engine returned them

Rollout-side kinds are armed on the last rank that holds an engine, `disk_full`, `nan` and
`mismatch` on the last rank that trains (rollout ranks of a disaggregated placement write no checkpoint).
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any, Callable

from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.workers.base import Part, register
from hybridrl.workers.fault_kinds import JOB, KINDS, TRAIN_SIDE

def fail_once(obj: Any, attr: str, error: Callable[[], BaseException]) -> None:
    """Wrap `obj.attr` (a method or a callable attribute) so that its next call raises `error()`; the
    original comes back before the raise, so only that one call fails."""
    had_own = attr in vars(obj)
    original = vars(obj).get(attr)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if had_own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)
        raise error()

    async def failing_async(*args: Any, **kwargs: Any) -> Any:
        return failing(*args, **kwargs)

    import inspect

    current = getattr(obj, attr)
    setattr(obj, attr, failing_async if inspect.iscoroutinefunction(current) else failing)


MISMATCH_NATS = 1.0


def replace_once(obj: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap `obj.attr` so that its next call runs `make(original)` instead; the original comes back first,
    so only that one call is changed."""
    had_own = attr in vars(obj)
    original, current = vars(obj).get(attr), getattr(obj, attr)

    def once(*args: Any, **kwargs: Any) -> Any:
        if had_own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)
        return make(current)(*args, **kwargs)

    setattr(obj, attr, once)


def nan_loss(train_step: Callable[..., Any]) -> Callable[..., Any]:
    """A training engine's `train_step` whose loss function returns NaN token losses."""
    def step(batch: Any, loss_fn: Callable[..., Any], **kwargs: Any) -> Any:
        def poisoned(values: Any, entropy: Any, micro_batch: Any) -> Any:
            loss, metrics = loss_fn(values, entropy, micro_batch)
            return loss * float("nan"), metrics

        return train_step(batch, poisoned, **kwargs)

    return step


def shifted_behaviour(update_policy: Callable[..., Any]) -> Callable[..., Any]:
    """`TrainSide.update_policy` receiving behaviour logprobs MISMATCH_NATS lower on every policy token."""
    def update(batch: Any, **kwargs: Any) -> Any:
        batch.tensors["behavior_logprobs"] = batch["behavior_logprobs"] - MISMATCH_NATS * (batch["loss_mask"] > 0)
        return update_policy(batch, **kwargs)

    return update


def fail_next_tool_call(tools: Any, message: str) -> None:
    """The next call of any of the toolbox's tools raises inside the tool system (an infrastructure error
    of that call, as a killed sandbox gives); the other tools are put back with it. Each stand-in keeps
    its tool's spec, so the authorizer and the prompt see the same tools as before."""
    originals = dict(tools.tools)

    class Failing:
        def __init__(self, tool: Any):
            self.spec = tool.spec

        async def __call__(self, arguments: dict) -> Any:
            tools.tools.update(originals)
            raise RuntimeError(message)

    for name, tool in originals.items():
        tools.tools[name] = Failing(tool)


class Faults(Part):
    """Arms the worker-side faults on the rank where they fire (`arm_fault`, called by the controller)."""

    def __init__(self, ctx: Any, *, train: Any = None, rollout: Any = None, meshes: dict):
        self.ctx, self.train, self.rollout, self.meshes = ctx, train, rollout, meshes

    def target(self, kind: str) -> int:
        if KINDS[kind].fired_by == TRAIN_SIDE:
            return max(self.meshes["train"].ranks)
        rollout = self.meshes["rollout"]
        return max(r for r in rollout.ranks if rollout.coords(r)["tp"] == 0)

    @register(dispatch=ONE_TO_ALL)
    def arm_fault(self, *, kind: str, spec: str) -> None:
        if kind not in KINDS or KINDS[kind].fired_by == JOB:
            raise ValueError(f"{spec}: no worker-side fault of kind {kind!r}")
        if self.ctx.rank != self.target(kind):
            return
        message = f"fault injection: {spec}"
        _INSTALL[kind](self, spec, message)

    def _engine(self, spec: str, message: str) -> None:
        from hybridrl.backends.native import NativeEngine

        engine = self.rollout.engine
        if not isinstance(engine, NativeEngine):
            raise ValueError(f"{spec}: engine faults are injected into the native engine (rollout.engine=native)")
        # on the engine's own thread: its next step's forward raises, as a crashed engine's does
        self.rollout.run(engine.run_in_engine(
            lambda core: fail_once(core.runner, "execute", lambda: RuntimeError(message))))

    def _tool(self, spec: str, message: str) -> None:
        self.rollout.run_sync(lambda: fail_next_tool_call(self.rollout.tools, message))

    def _reward(self, spec: str, message: str) -> None:
        self.rollout.run_sync(lambda: fail_once(self.rollout.task, "score", lambda: RuntimeError(message)))

    def _env_kill(self, spec: str, message: str) -> None:
        from hybridrl.envs.client import LeasedEnvProvider

        envs = self.rollout.runner.envs
        if not isinstance(envs, LeasedEnvProvider):
            raise ValueError(f"{spec}: the task has no environment (make_env), so there is no environment "
                             "service to kill")
        envs.service.on_persisted = lambda episode_id, seq_no: os.kill(os.getpid(), signal.SIGKILL)

    def _disk_full(self, spec: str, message: str) -> None:
        fail_once(self.train.actor, "save_checkpoint",
                  lambda: OSError(errno.ENOSPC, f"No space left on device ({message})"))

    def _nan(self, spec: str, message: str) -> None:
        replace_once(self.train.actor, "train_step", nan_loss)

    def _mismatch(self, spec: str, message: str) -> None:
        replace_once(self.train, "update_policy", shifted_behaviour)


_INSTALL: dict[str, Callable[[Faults, str, str], None]] = {
    "engine": Faults._engine, "tool": Faults._tool, "reward": Faults._reward, "env_kill": Faults._env_kill,
    "disk_full": Faults._disk_full, "nan": Faults._nan, "mismatch": Faults._mismatch,
}
assert set(_INSTALL) == {k.name for k in KINDS.values() if k.fired_by != JOB}, "every worker-side kind is armed here"
