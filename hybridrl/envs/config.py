"""Configs of the task (`task`) and the leased environment service (`env`). Import-light."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob


@dataclass(kw_only=True)
class TaskConfig:
    """Which task the agent trains on, its splits, reward shaping and the task's own options."""

    name: str = knob("calculator",
                     "a task in hybridrl/envs/tasks/ (calculator, guess_number, gsm8k) or your own as 'module:Class' "
                     "(importable from the working directory or PYTHONPATH)")
    seed: int = knob(0, "seed of the generated train / validation splits")
    train_size: int = knob(4096, "instances in the train split")
    validation_size: int = knob(64, "instances in the validation split (disjoint from train); every RL validation runs all of them")
    format_weight: float = knob(0.0, "weight of the format reward added to the correctness reward")
    sft_tool_use_fraction: float = knob(1.0, "SFT demonstrations that use the tool (the rest guess)")
    sft_guess_correct_fraction: float = knob(0.0, "guessing demonstrations whose guess is right")
    options: dict[str, Any] = knob(
        help="the task's own options (for calculator: min_digits, max_digits, min_ops, max_ops, ops, "
             "parentheses, action_format, system_prompt); checked against the task's Options dataclass",
        factory=dict)

    def __post_init__(self) -> None:
        check_positive("train_size", self.train_size)
        check_positive("validation_size", self.validation_size)
        check_positive("format_weight", self.format_weight, allow_zero=True)
        check_range("sft_tool_use_fraction", self.sft_tool_use_fraction, 0.0, 1.0)
        check_range("sft_guess_correct_fraction", self.sft_guess_correct_fraction, 0.0, 1.0)
        from hybridrl.envs.tasks import registry

        if ":" in self.name or self.name not in registry.task_names():
            registry.task_class(self.name)          # imports a 'module:Class' task: errors name the key
        if self.options:      # checking options imports a shipped task's module (only when there are some)
            self.options = registry.check_options(self.name, self.options)   # typed: "3" -> 3 for an int


@dataclass(kw_only=True)
class EnvServiceConfig:
    """The leased environment service: durable episode state, leases, retries."""

    db_path: str = knob("${run.dir}/envs.sqlite", "SQLite file (WAL) holding episodes and transitions")
    lease_ttl_s: float = knob(300.0, "a lease not renewed for this long expires and its episode is reclaimed")
    synchronous: str = knob("full", "SQLite durability: full (survives power loss) | normal (process crash)")
    busy_timeout_s: float = knob(10.0, "how long a service process waits for the database's write lock before "
                                       "refusing a step (retryable: the client sends the same key again)")
    step_timeout_s: float = knob(30.0, "client side: a step slower than this is an ambiguous timeout")
    max_retries: int = knob(3, "client side: retries of an ambiguous step (after querying its status)")
    audit_log: str = knob("${run.dir}/audit.jsonl", "the run's hash-chained audit log, where the service's refusals "
                                                   "and lease revocations go too; empty: none")

    def __post_init__(self) -> None:
        check_positive("lease_ttl_s", self.lease_ttl_s)
        check_choice("synchronous", self.synchronous, ("full", "normal"))
        check_positive("busy_timeout_s", self.busy_timeout_s)
        check_positive("step_timeout_s", self.step_timeout_s)
        check_positive("max_retries", self.max_retries, allow_zero=True)
