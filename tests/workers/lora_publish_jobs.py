"""The controller (and its probe part) of the adapter-only publication test; it writes result.json.

A LoRA run (train.lora.rank > 0) with the native engine: each rank's engine holds the frozen base and
applies the adapters at run time; a mode switch publishes the adapters only. The job trains the adapters
once, switches, and records what the publication carried (names, bytes), the engine's greedy generations
(and the trainer's logprobs of them, scored by the test), what the engine refuses (a whole model, an old
version), the merged-weight path an engine without adapters takes (SGLang's, vLLM's) on a second native
engine, and the post-copy verification of a damaged adapter copy (retried once, then the run stops).
"""

from __future__ import annotations

from hybridrl.controller.placements import build_colocated
from hybridrl.controller.worker_group import WorkerGroupError
from hybridrl.data.batch import Batch, pad_sequences
from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.jobs import Job
from hybridrl.workers.base import Part, register
from hybridrl.workers.rank import RankWorker
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch
from hybridrl.workers.train_side import TrainSide
from tests.workers.hybrid_jobs import PROMPTS, CopyDamage, _train_once, _write

DAMAGED = "model.layers.0.self_attn.q_proj.lora_A.weight"


class LoraProbe(Part):
    def __init__(self, cfg, ctx, worker: RankWorker):
        self.cfg, self.ctx = cfg, ctx
        self.switch, self.rollout, self.train = worker.part(ModeSwitch), worker.part(RolloutSide), worker.part(TrainSide)

    @register(dispatch=ONE_TO_ALL)
    def publication(self) -> dict:
        """What the last publication carried, and what the engine holds."""
        publisher, core = self.switch.publisher, self.rollout.engine.core
        specs = publisher.release.tensor_specs
        import torch

        return {"names": sorted(specs), "bytes_copied": publisher.stats.bytes_copied,
                "spec_bytes": sum(_nbytes(s, getattr(torch, d)) for s, d in specs.values()),
                "engine_adapter_bytes": core.stats()["adapter_bytes"], "engine_weight_bytes": core.stats()["weight_bytes"],
                "full_weight_bytes": sum(_nbytes(s, d) for s, d in self.train.actor.hf_spec().values()),
                "engine_spec": sorted(self.rollout.engine.weight_spec())}

    @register(dispatch=ONE_TO_ALL)
    def refusals(self) -> dict:
        """A whole-model publication into the adapter engine (structure check) and an older version (the
        engine's version check): both refused, the engine still serving what it had."""
        from hybridrl.publication.manifest import PublicationRefused
        from hybridrl.publication.publish import publish

        engine, publisher, out = self.rollout.engine, self.switch.publisher, {}
        try:
            self.rollout.run(publish(self.train.actor, engine=engine, transport=self.switch.transport,
                                     cfg=self.cfg.publish, version=engine.policy_version + 1, step=0,
                                     hashes=publisher.hashes, staging=publisher.staging))
            out["whole_model"] = None
        except PublicationRefused as err:
            out["whole_model"] = str(err)
        name, view = next(iter(engine.core.views.items()))
        try:
            self.rollout.run(engine.update_weights([(name, view.clone())], engine.policy_version - 1))
            out["old_version"] = None
        except ValueError as err:
            out["old_version"] = str(err)
        out["serving"] = engine.policy_version
        return out

    @register(dispatch=ONE_TO_ALL)
    def merged(self, *, version: int) -> dict:
        """The merged-weight path (an engine without adapters: SGLang, vLLM): the actor's whole model, B A
        added, published into a second native engine of this rank; its greedy generations."""
        from hybridrl.backends.native.engine import NativeEngine
        from hybridrl.publication.buckets import Staging
        from hybridrl.publication.publish import publish
        from hybridrl.publication.transport_inprocess import InProcessTransport
        from hybridrl.rollout.protocol import SamplingParams

        engine = NativeEngine.from_pretrained(self.cfg.model.path, self.cfg.rollout.native, device=self.ctx.device)
        release, stats = self.rollout.run(publish(
            self.train.actor, engine=engine, transport=InProcessTransport(engine), cfg=self.cfg.publish,
            version=version, step=version, hashes=self.switch.publisher.hashes, staging=Staging(self.ctx.device)))
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0, seed=0)

        async def go():
            return [await engine.generate(p, sampling, f"merged-{i}") for i, p in enumerate(PROMPTS)]

        outputs = self.rollout.run(go())
        engine.close()
        return {"bytes_copied": stats.bytes_copied, "num_buckets": stats.num_buckets,
                "outputs": [{"token_ids": o.token_ids, "logprobs": o.logprobs, "policy_version": o.policy_version}
                            for o in outputs]}


def _nbytes(shape, dtype) -> int:
    import torch

    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def lora_worker(cfg, ctx) -> RankWorker:
    worker = build_colocated(cfg, ctx)
    worker.extend(CopyDamage(worker.part(RolloutSide)))
    return worker.extend(LoraProbe(cfg, ctx, worker))


def _trainer_logprobs(wg, outputs: list[dict]) -> list[list[float]]:
    """The trainer's logprobs of the engine's generations (TRAIN mode), at the generated positions."""
    rows = [p + o["token_ids"] for p, o in zip(PROMPTS, outputs)]
    batch = Batch({"input_ids": pad_sequences(rows), "attention_mask": pad_sequences([[1] * len(r) for r in rows])})
    lp = wg.call(TrainSide.compute_logprobs, batch)["old_logprobs"]
    return [lp[b, len(p): len(r)].tolist() for b, (p, r) in enumerate(zip(PROMPTS, rows))]


def adapter_publication(cfg, wg):
    wg.call(ModeSwitch.enter_rollout, version=0, step=0)            # the engines serve the base (B = 0)
    before = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(ModeSwitch.enter_train)
    _train_once(wg, vocab=500)
    switch = wg.call(ModeSwitch.enter_rollout, version=1, step=1)
    after = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    carried = wg.call(LoraProbe.publication)
    merged = wg.call(LoraProbe.merged, version=1)
    refusals = wg.call(LoraProbe.refusals)
    wg.call(ModeSwitch.enter_train)
    trainer = _trainer_logprobs(wg, after[0])
    trainer_merged = _trainer_logprobs(wg, merged[0]["outputs"])
    _train_once(wg, vocab=500, seed=1)
    wg.call(CopyDamage.set_fault, name=DAMAGED, times=1)        # one bad copy of an adapter: copied again
    retried = wg.call(ModeSwitch.enter_rollout, version=2, step=2)
    v2 = wg.call(RolloutSide.sample, prompts=PROMPTS[:1], max_new_tokens=4)
    wg.call(ModeSwitch.enter_train)
    _train_once(wg, vocab=500, seed=2)
    wg.call(CopyDamage.set_fault, name=DAMAGED, times=-1)       # every copy bad: the switch stops
    try:
        wg.call(ModeSwitch.enter_rollout, version=3, step=3)
        failure = None
    except WorkerGroupError as err:
        failure = str(err)
    _write(cfg, {"before": before, "after": after, "switch": switch, "carried": carried, "merged": merged,
                 "refusals": refusals, "trainer": trainer, "trainer_merged": trainer_merged, "retried": retried,
                 "v2": v2, "failure": failure})
    if failure:
        raise RuntimeError("expected failure recorded")   # the group is aborted after a worker error


ADAPTERS = Job("lora_adapter_publication", lora_worker, adapter_publication)
