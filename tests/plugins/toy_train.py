"""The toy training engine's class (imported when the engine is built, as a shipped engine's is): Megatron's,
reporting its own section's `toy_mark` with each optimizer step."""

from __future__ import annotations

from hybridrl.backends.megatron.engine import MegatronEngine


class ToyTrainEngine(MegatronEngine):
    def train_step(self, batch, loss_fn, **kwargs):
        metrics = super().train_step(batch, loss_fn, **kwargs)
        metrics["toy_mark"] = float(self.cfg.toy_mark)
        return metrics
