"""The `store` section: the run ledger (trajectory store, lineage, trace events)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import check_choice, check_positive, knob

COMPRESSIONS = ("zstd", "snappy", "none")


@dataclass(kw_only=True)
class StoreConfig:
    """Where every finalised trajectory of an RL run is kept, and for how long."""

    enabled: bool = knob(True, "write the run ledger to <run.dir>/ledger: every trajectory once (tokens, policy "
                               "versions, logprobs, masks, rewards, advantages, trace), the update that consumed "
                               "it and the release that resulted; read it with `hybridrl inspect RUN_DIR`")
    text: bool = knob(True, "also keep the decoded text of episodes (prompt, per-token pieces, answer) in "
                            "<run.dir>/ledger/text, apart from the metrics (it may be sensitive); false = token ids only")
    keep_steps: int = knob(0, "retention: keep the data of the newest k steps only (older shards are deleted, "
                              "their index rows and lineage stay); 0 = keep all")
    max_mb: float = knob(0.0, "size cap of the ledger's data and text shards in MiB: the oldest steps' shards are "
                              "deleted past it (never the newest); 0 = no cap")
    compression: str = knob("zstd", f"Parquet compression of the data shards: {' | '.join(COMPRESSIONS)}")

    def __post_init__(self) -> None:
        check_positive("keep_steps", self.keep_steps, allow_zero=True)
        check_positive("max_mb", self.max_mb, allow_zero=True)
        check_choice("compression", self.compression, COMPRESSIONS)
