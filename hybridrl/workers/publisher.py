"""The training side's end of a weight publication, shared by both links between the sides (the
colocated mode switch and the disaggregated placement's remote publication).

    refusal(target, ...)     this rank's reason to refuse a publication (structure check, local state): the
                             ranks decide on it together before anything moves
    publish(version, step)   the actor's weights (a LoRA run's adapters only, where the engine applies
                             them: `publication_source`) into the target (`publication.publish`: structure
                             check, flat buckets, verified copy, manifest) through the link's transport;
                             returns why it was refused before any copy (None: published)
    check_parity(...)        the trainer's logprobs of the engine's greedy probe generations; the worst
                             difference over the ranks above `publish.parity_tolerance` fails it
    release_metrics()        the manifest's summary and where the publication's time went
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from hybridrl.publication import parity
from hybridrl.publication.agree import Verdict, refusal
from hybridrl.publication.buckets import Staging
from hybridrl.publication.manifest import PublicationError, PublicationRefused, model_hashes
from hybridrl.publication.publish import publish, published_spec

log = logging.getLogger(__name__)


def publication_source(cfg: Any, actor: Any) -> Any:
    """What a publication of this run sends: the actor's LoRA adapters alone when the rollout engine applies
    them itself (`adapter_publication` of its row: the native engine), else the whole model (merged with
    the adapters of a LoRA run). Decided from the config, so every rank sends the same."""
    from hybridrl.rollout.registry import engine_row

    return actor.adapter_source() if engine_row(cfg.rollout.engine).adapter_publication(cfg) else actor


class Publisher:
    def __init__(self, cfg: Any, ctx: Any, actor: Any, tokenizer: Any):
        self.cfg, self.ctx, self.actor = cfg, ctx, actor
        self.source = publication_source(cfg, actor)
        self.staging = Staging(ctx.device)
        self.hashes = model_hashes(cfg.model.path)
        self.release = None
        self.stats = None
        special = [t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None]
        n = cfg.publish.parity_prompts
        self.probe = parity.probe_prompts(len(tokenizer), n, avoid=special) if n else []
        self.schedule = parity.ProbeSchedule(cfg.publish.parity_every)

    def probe_due(self, version: int) -> bool:
        """Whether the parity probe checks this publication (the probe on, and the schedule says so)."""
        return bool(self.probe) and self.schedule.due(version)

    def refusal(self, target: Any) -> str | None:
        """This rank's reason to refuse publishing into `target` (None: it accepts), from local state only
        (`publication/agree.py`): what the ranks decide on together."""
        return refusal(published_spec(self.source.hf_group_specs()), target)

    def publish(self, version: int, step: int, *, target: Any, transport: Any, run: Callable[[Any, str], Any],
                peers: Any = None, verdict: Verdict | None = None) -> str | None:
        """Publish `version` into `target` (an engine, or what the sender knows of remote ones);
        `run(coro, waits_for)` awaits within the phase's deadline. `peers`: every rank the publication's
        collectives span, which decide together (`publication/agree.py`): a refusal on any of them is a
        refusal on all, before any copy, so every engine keeps serving what it had. `verdict`: that
        decision, already taken together (from every rank's `refusal`)."""
        try:
            self.release, self.stats = run(publish(
                self.source, engine=target, transport=transport, cfg=self.cfg.publish, version=version, step=step,
                hashes=self.hashes, staging=self.staging, peers=peers, verdict=verdict),
                "the weights to reach the rollout engine")
        except PublicationRefused as err:
            log.error("rank %d: %s", self.ctx.rank, err)
            return str(err)
        finally:
            if self.ctx.device.type == "cuda":
                self.staging.release()                # the bucket buffers' memory goes to the KV cache
        return None

    def check_parity(self, version: int, outputs: list, reduce_max: Callable[[float], float]) -> dict:
        """The trainer's logprobs of the engine's probe generations (every rank of the train mesh takes
        part); the worst difference over the ranks (`reduce_max`) above the tolerance fails the publication."""
        batch = parity.probe_batch(self.probe, outputs)
        mine = self.actor.compute_logprobs(batch)
        result = parity.compare(self.probe, outputs, mine["logprobs"]) if mine is not None else {}
        result["parity/max_abs"] = reduce_max(result.get("parity/max_abs", 0.0))
        if result["parity/max_abs"] > self.cfg.publish.parity_tolerance:
            raise PublicationError(f"parity probe after publishing v{version}: engine and trainer logprobs differ "
                                   f"by {result['parity/max_abs']:.3g} > publish.parity_tolerance="
                                   f"{self.cfg.publish.parity_tolerance}")
        return result

    def release_metrics(self, published: bool) -> dict:
        """The release a publication made (manifest summary) and where its time went."""
        if not published or self.release is None:
            return {}
        stats = self.stats
        return {"release": self.release.summary(), "switch/publish_prepare_s": stats.prepare_s,
                "switch/publish_deliver_s": stats.deliver_s, "publish/retried_tensors": float(stats.retries),
                "publish/bytes": float(stats.bytes_copied), "publish/in_place": float(stats.in_place)}

    def memory(self) -> dict:
        return {"staging_bytes": self.staging.nbytes}    # the bucket buffers (kept on a CPU device)
