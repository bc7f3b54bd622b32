"""The `trainer` section: the RL loop's schedule (steps, batch shape, validation, checkpoints)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, knob


@dataclass(kw_only=True)
class TrainerConfig:
    """What one RL step holds and what happens around it."""

    total_steps: int = knob(20, "RL steps (one rollout + one update each)")
    prompts_per_step: int = knob(16, "task instances per step (a multiple of the rollout data-parallel size)")
    group_size: int = knob(8, "samples per instance (the group of GRPO / RLOO)")
    validate_every: int = knob(5, "validate on the task's held-out split (task.validation_size instances) every k steps, and always before the first and after the last; 0 = only then")
    validation_temperature: float = knob(0.0, "sampling temperature of validation episodes (0 = greedy)")
    eval_suite: str = knob("", "an evaluation suite (a name in configs/eval/ or a suite's YAML) run on the current policy "
                               "beside validation: scores in metrics.jsonl (eval/<suite>/...), <run.dir>/eval/<suite>/ and "
                               "the ledger; empty: none")
    eval_every: int = knob(0, "run trainer.eval_suite every k steps, and always before the first and after the last; "
                              "0 = only then")
    checkpoint_every: int = knob(10, "save a checkpoint every k steps; 0 = never")
    keep_checkpoints: int = knob(2, "complete checkpoints kept")
    resume: str = knob("auto", "auto: continue the run in run.dir from its newest checkpoint (another task / model "
                               "/ shapes, a finished run or one without a checkpoint is refused) | never: start clean, "
                               "the earlier run moved to <run.dir>.old-N | PATH: that checkpoint")
    export_hf: bool = knob(True, "write the final policy as an HF directory to <run.dir>/hf")
    log_samples: int = knob(2, "trajectories per step written to <run.dir>/samples.jsonl (decoded)")
    max_restarts: int = knob(0, "torchrun restarts every rank this many times after a rank fails; a restarted "
                                "run resumes from its newest complete checkpoint (or starts over without one)")
    inject: list[str] = knob(help="fault injection, KIND@STEP[:MOMENT]: kill_job, kill_rank[N] (moments switch, "
                                  "rollout, train, log, checkpoint); engine, tool, reward, env_kill (during the "
                                  "rollout), disk_full (at the checkpoint), nan, mismatch (in the update): see "
                                  "hybridrl/controller/faults.py",
                             factory=list)
    rollout_mode: str = knob("sync", "sync: every step waits for all its episodes | partial: a step ends its rollout "
                                     "when `quorum` groups are complete (or at `rollout_deadline_s`); episodes still "
                                     "running are interrupted and continue at the next step on the new policy")
    oversample: float = knob(1.0, "partial: groups kept in flight = ceil(prompts_per_step * oversample); > 1 lets a "
                                  "step end before its slowest groups")
    quorum: int = knob(0, "partial: complete groups that end a step's rollout; 0 = prompts_per_step")
    rollout_deadline_s: float = knob(0.0, "partial: end a step's rollout after this many seconds even without a "
                                          "quorum; 0 = no deadline")
    collect_poll_s: float = knob(0.05, "partial: how often the rollout ranks count complete groups (seconds)")
    max_groups_per_step: int = knob(0, "partial: train at most this many complete groups per step; the others wait "
                                       "in a bounded queue for the next step (oldest first); 0 = train every "
                                       "returned group, no queue")
    queue_max_groups: int = knob(64, "partial with max_groups_per_step: the queue's bound in groups")
    queue_max_tokens: int = knob(0, "... in tokens (prompt + response of every queued trajectory; drop_oldest "
                                    "only); 0 = no bound")
    queue_policy: str = knob("block", "when the queue is full: block (launch no more groups than it has room for) | "
                                      "drop_oldest (drop the oldest queued groups, counted in queue/dropped_*)")
    dynamic_sampling: bool = knob(False, "keep sampling new groups until the step has prompts_per_step groups whose "
                                         "rewards are not all equal (DAPO's dynamic sampling; partial: the quorum "
                                         "counts such groups only)")
    max_sampling_rounds: int = knob(4, "dynamic_sampling: at most this many rollout rounds per step (a hard task "
                                       "may have no informative group for a while)")
    stop_after_dead_steps: int = knob(0, "end the run after this many steps in a row without a learning signal (no "
                                         "admitted group whose rewards differ); the run says why after 3 such steps "
                                         "either way; 0 = never stop for it")
    stop_after_failed_steps: int = knob(3, "the run fails (exit 1, saying why) after this many steps in a row whose "
                                           "every episode was an agent error or an infrastructure fault; 0 = never")
    peak_flops: float = knob(0.0, "peak FLOP/s of one training device, the denominator of perf/mfu; 0 = the device's "
                                  "dense bf16 value from a table (H100, H200, A100, L40S, ...), else (a CPU, an "
                                  "unlisted device) a float32 matmul rate measured at the start")
    callbacks: list[str] = knob(help="observers of the run's events (start, step, validation, checkpoint, "
                                     "interrupt, end) on the controller: module:Class of yours, or wandb / mlflow "
                                     "(skipped with a note when the package is missing); see "
                                     "hybridrl/controller/callbacks.py", factory=list)
    metrics_port: int = knob(0, "serve live metrics (Prometheus text: the step, its scalars, the phase, incidents) "
                                "on this port from rank 0 while the run lives; 0 = off. Needs prometheus_client "
                                "(pip install 'hybridrl[metrics]')")
    metrics_host: str = knob("127.0.0.1", "the address trainer.metrics_port listens on (0.0.0.0: every interface)")

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
        check_choice("rollout_mode", self.rollout_mode, ("sync", "partial"))
        if self.oversample < 1:
            raise ConfigValueError("oversample", f"must be >= 1 (groups in flight per prompts_per_step), got "
                                                 f"{self.oversample}")
        check_positive("quorum", self.quorum, allow_zero=True)
        check_positive("rollout_deadline_s", self.rollout_deadline_s, allow_zero=True)
        check_positive("collect_poll_s", self.collect_poll_s)
        check_positive("max_sampling_rounds", self.max_sampling_rounds)
        check_positive("stop_after_dead_steps", self.stop_after_dead_steps, allow_zero=True)
        check_positive("stop_after_failed_steps", self.stop_after_failed_steps, allow_zero=True)
        check_positive("peak_flops", self.peak_flops, allow_zero=True)
        from hybridrl.controller.callbacks import CALLBACKS

        for spec in self.callbacks:
            CALLBACKS.check("callbacks", spec)
        check_positive("max_groups_per_step", self.max_groups_per_step, allow_zero=True)
        check_positive("queue_max_groups", self.queue_max_groups)
        check_positive("queue_max_tokens", self.queue_max_tokens, allow_zero=True)
        check_choice("queue_policy", self.queue_policy, ("block", "drop_oldest"))
        if self.queue_policy == "block" and self.queue_max_tokens:
            raise ConfigValueError("queue_max_tokens", "with queue_policy=block the queue is bounded by launching no "
                                                       "more groups than it has room for (queue_max_groups); a token "
                                                       "bound needs queue_policy=drop_oldest")
        if self.rollout_mode == "partial" and self.quorum_groups > self.groups_in_flight:
            raise ConfigValueError("quorum", f"{self.quorum_groups} complete groups can never be reached with "
                                             f"{self.groups_in_flight} in flight: raise oversample or lower quorum")
        check_positive("eval_every", self.eval_every, allow_zero=True)
        if self.eval_suite:
            from hybridrl.evaluate.suite import SuiteError, suite_path

            try:
                suite_path(self.eval_suite)
            except SuiteError as err:
                raise ConfigValueError("eval_suite", str(err)) from None
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigValueError("metrics_port", f"must be a TCP port (1-65535) or 0 for none, got {self.metrics_port}")
        if self.metrics_port:
            import importlib.util

            if importlib.util.find_spec("prometheus_client") is None:
                raise ConfigValueError("metrics_port", "needs the prometheus_client package: pip install "
                                                       "'hybridrl[metrics]', or set trainer.metrics_port=0")
        if self.validation_temperature < 0:
            raise ConfigValueError("validation_temperature", f"must be >= 0, got {self.validation_temperature}")

    @property
    def quorum_groups(self) -> int:
        return self.quorum or self.prompts_per_step

    @property
    def groups_in_flight(self) -> int:
        return math.ceil(self.prompts_per_step * self.oversample - 1e-9)
