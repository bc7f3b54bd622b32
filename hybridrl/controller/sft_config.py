"""The `sft` section: supervised warm start on a task's demonstrations."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_positive, knob


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning on the task's SFT demonstrations (loss on policy tokens only)."""

    num_demonstrations: int = knob(2048, "demonstrations generated from the task's train split")
    tool_use_fraction: float = knob(-1.0, "share of demonstrations that use the tool; -1 = the task's default")
    steps: int = knob(300, "optimizer steps")
    batch_size: int = knob(64, "sequences per step (global, over data-parallel ranks)")
    output_dir: str = knob("", "where the trained HF model goes; empty = <run.dir>/hf")
    log_every: int = knob(10, "metrics.jsonl row every k steps")

    def __post_init__(self) -> None:
        for name in ("num_demonstrations", "steps", "batch_size", "log_every"):
            check_positive(name, getattr(self, name))
        if self.tool_use_fraction != -1.0 and not 0.0 <= self.tool_use_fraction <= 1.0:
            raise ConfigValueError("tool_use_fraction", f"must be in [0, 1] or -1, got {self.tool_use_fraction}")
