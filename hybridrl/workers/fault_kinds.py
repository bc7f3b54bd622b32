"""The one table of fault kinds `trainer.inject` may name (import-light: config loading reads it).
The controller fires the job kinds itself; the worker-side kinds are armed by `workers/faults.py`."""

from __future__ import annotations

from dataclasses import dataclass

JOB, ROLLOUT_SIDE, TRAIN_SIDE = "job", "rollout", "train"


@dataclass(frozen=True)
class FaultKind:
    name: str
    fired_by: str              # JOB (the controller, at any moment) | ROLLOUT_SIDE | TRAIN_SIDE (armed on a worker)
    moment: str | None         # the step moment a worker-side kind is armed at (None: any moment)
    effect: str


KINDS = {k.name: k for k in (
    FaultKind("kill_job", JOB, None, "SIGKILL the torchrun agent, every rank and their children"),
    FaultKind("kill_rank", JOB, None, "SIGKILL one worker rank (kill_rankN: rank N; default the last)"),
    FaultKind("engine", ROLLOUT_SIDE, "rollout", "the rollout engine's next forward step fails"),
    FaultKind("tool", ROLLOUT_SIDE, "rollout", "the next tool call's backend fails"),
    FaultKind("reward", ROLLOUT_SIDE, "rollout", "the task's verifier raises on the next episode"),
    FaultKind("env_kill", ROLLOUT_SIDE, "rollout", "the environment service dies between a commit and its reply"),
    FaultKind("disk_full", TRAIN_SIDE, "checkpoint", "the next checkpoint write fails with ENOSPC"),
    FaultKind("nan", TRAIN_SIDE, "train", "the next update's loss is NaN on one rank (its gradients, the reduced "
                                          "ones, and so every weight, become NaN)"),
    FaultKind("mismatch", TRAIN_SIDE, "train", "the next update's behaviour logprobs on one rank are 1 nat below what "
                                               "the engine returned (a rollout/trainer mismatch spike)"),
)}
