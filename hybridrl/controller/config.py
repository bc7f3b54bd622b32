"""The `trainer` section: the RL loop's schedule (steps, batch shape, validation, checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_positive, knob


@dataclass(kw_only=True)
class TrainerConfig:
    """What one RL step holds and what happens around it."""

    total_steps: int = knob(20, "RL steps (one rollout + one update each)")
    prompts_per_step: int = knob(16, "task instances per step (a multiple of the rollout data-parallel size)")
    group_size: int = knob(8, "samples per instance (the group of GRPO / RLOO)")
    validate_every: int = knob(5, "validate on the task's held-out split (task.validation_size instances) every k steps, and always before the first and after the last; 0 = only then")
    validation_temperature: float = knob(0.0, "sampling temperature of validation episodes (0 = greedy)")
    checkpoint_every: int = knob(10, "save a checkpoint every k steps; 0 = never")
    keep_checkpoints: int = knob(2, "complete checkpoints kept")
    resume: str = knob("auto", "auto: continue the run in run.dir from its newest checkpoint (another task / model "
                               "/ shapes, a finished run or one without a checkpoint is refused) | never: start clean, "
                               "the earlier run moved to <run.dir>.old-N | PATH: that checkpoint")
    export_hf: bool = knob(True, "write the final policy as an HF directory to <run.dir>/hf")
    log_samples: int = knob(2, "trajectories per step written to <run.dir>/samples.jsonl (decoded)")
    max_restarts: int = knob(0, "torchrun restarts every rank this many times after a rank fails; a restarted "
                                "run resumes from its newest complete checkpoint (or starts over without one)")
    inject: list[str] = knob(help="fault injection, KIND@STEP[:MOMENT] (kill_job, kill_rank[N]; moments switch, "
                                  "rollout, train, log, checkpoint): see hybridrl/controller/faults.py",
                             factory=list)

    def __post_init__(self) -> None:
        for name in ("total_steps", "prompts_per_step", "group_size"):
            check_positive(name, getattr(self, name))
        for name in ("validate_every", "checkpoint_every", "log_samples"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_positive("keep_checkpoints", self.keep_checkpoints)
        check_positive("max_restarts", self.max_restarts, allow_zero=True)
        from hybridrl.controller.faults import check

        try:
            check(self.inject, checkpoint_every=self.checkpoint_every)
        except ValueError as err:
            raise ConfigValueError("inject", str(err)) from None
        if self.validation_temperature < 0:
            raise ConfigValueError("validation_temperature", f"must be >= 0, got {self.validation_temperature}")
