"""The `sft` section: supervised warm start on a task's demonstrations."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_positive, knob


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning on the task's SFT demonstrations (loss on policy tokens only); which share of
    them use the tool is `task.sft_tool_use_fraction`."""

    data: str = knob("", "train on the chats of this file instead of the task's demonstrations: JSONL / Parquet rows "
                         "of `messages` (or veRL's `prompt`), or a saved `datasets` dataset; the loss covers the "
                         "assistant turns only; rows without one are skipped; with task.name=data on the same file, "
                         "its held-out validation rows are left out")
    num_demonstrations: int = knob(2048, "demonstrations generated from the task's train split (unused with data)")
    steps: int = knob(300, "optimizer steps")
    batch_size: int = knob(64, "sequences per step (global, over data-parallel ranks)")
    output_dir: str = knob("", "where the trained HF model goes; empty = <run.dir>/hf")
    log_every: int = knob(10, "metrics.jsonl row every k steps")
    validate_every: int = knob(0, "greedy and sampled (agent.temperature) accuracy on the task's validation split "
                                  "(task.validation_size instances) every k steps; 0: once, after the last step; "
                                  "-1: never")

    def __post_init__(self) -> None:
        for name in ("num_demonstrations", "steps", "batch_size", "log_every"):
            check_positive(name, getattr(self, name))
        if self.data:
            from pathlib import Path

            if not Path(self.data).exists():
                raise ConfigValueError("data", f"no such file or directory: {self.data!r} (relative paths are from "
                                               f"the working directory, {Path.cwd()})")
        if self.validate_every < -1:
            raise ConfigValueError("validate_every", f"must be -1 (never), 0 (after the last step) or k > 0, got "
                                                     f"{self.validate_every}")
