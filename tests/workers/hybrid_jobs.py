"""Controllers (and a fault-injecting worker) for the hybrid-worker tests; each writes result.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridrl.controller.worker_group import WorkerGroupError
from hybridrl.data.batch import Batch
from hybridrl.jobs import Job
from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.workers.base import register
from hybridrl.workers.hybrid import HybridWorker
from hybridrl.workers.modes import IllegalTransition  # noqa: F401  (re-exported for tests)

PROMPTS = [[1, 276, 201, 19, 20, 21], [1, 312, 201, 318, 311, 22, 23, 24, 12, 25], [1, 280, 201]]


class FaultyHybridWorker(HybridWorker):
    @register(dispatch=ONE_TO_ALL)
    def set_fault(self, name: str | None) -> None:
        """Corrupt tensor `name` in transit (one element moved by 1.0), or stop corrupting (None)."""
        def corrupt(n, t):
            if n != name:
                return t
            bad = t.clone()
            bad.view(-1)[0] += 1.0
            return bad
        self.transport.fault = corrupt if name else None


def _write(cfg, result):
    out = Path(cfg.run.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result))


def _train_once(wg, vocab: int, seed: int = 0) -> dict:
    """One update on a synthetic batch, so that the next version's weights differ."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 16), generator=g)
    mask = torch.zeros(4, 16)
    mask[:, 8:] = 1
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long), "loss_mask": mask})
    old = wg.call(HybridWorker.compute_logprobs, batch)["old_logprobs"]
    batch.set("old_logprobs", old)
    batch.set("behavior_logprobs", old.clone())
    batch.set("advantages", torch.where(torch.rand(4, 1, generator=g) > 0.5, 1.0, -1.0).expand(4, 16) * mask)
    return wg.call(HybridWorker.train_step, batch)[0]


def publish_then_sample(cfg, wg):
    wg.call(HybridWorker.enter_rollout, version=0, step=0)
    before = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(HybridWorker.enter_train)
    update = _train_once(wg, vocab=500)
    switch = wg.call(HybridWorker.enter_rollout, version=1, step=1)
    after = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(HybridWorker.export_hf, out_dir=str(Path(cfg.run.dir) / "hf"))
    _write(cfg, {"prompts": PROMPTS, "before": before, "after": after, "switch": switch, "update": update})


def corrupted_publication(cfg, wg):
    wg.call(HybridWorker.enter_rollout, version=0, step=0)
    v0 = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(HybridWorker.enter_train)
    _train_once(wg, vocab=500)
    wg.call(FaultyHybridWorker.set_fault, name="model.layers.0.mlp.down_proj.weight")
    refused = wg.call(HybridWorker.enter_rollout, version=1, step=1)
    still_v0 = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(HybridWorker.enter_train)
    wg.call(FaultyHybridWorker.set_fault, name=None)
    accepted = wg.call(HybridWorker.enter_rollout, version=1, step=1)
    v1 = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    try:                       # an illegal call order is an error naming the modes
        wg.call(HybridWorker.train_step, Batch({"input_ids": torch.zeros(2, 4, dtype=torch.long)}))
        illegal = None
    except WorkerGroupError as err:
        illegal = str(err)
    _write(cfg, {"v0": v0, "refused": refused, "still_v0": still_v0, "accepted": accepted, "v1": v1,
                 "illegal": illegal})
    if illegal:
        raise RuntimeError("expected failure recorded")   # the group is aborted after a worker error


def memory(cfg, wg):
    _train_once(wg, vocab=500)
    train = wg.call(HybridWorker.memory_report)[0]
    wg.call(HybridWorker.enter_rollout, version=1, step=1)
    wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=4)
    rollout = wg.call(HybridWorker.memory_report)[0]
    wg.call(HybridWorker.enter_train)
    back = wg.call(HybridWorker.memory_report)[0]
    again = _train_once(wg, vocab=500, seed=1)
    _write(cfg, {"train": train, "rollout": rollout, "back": back, "again": again})


PUBLISH = Job("publish", HybridWorker, publish_then_sample)
CORRUPT = Job("corrupt", FaultyHybridWorker, corrupted_publication)
MEMORY = Job("memory", HybridWorker, memory)


def grouped_rollout(cfg, wg):
    """rollout.tp=2 with the native engine: one engine on rank 0 serves the group of 2 ranks."""
    first = wg.call(HybridWorker.enter_rollout, version=0, step=0)
    per_rank = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=6)
    wg.call(HybridWorker.enter_train)
    _train_once(wg, vocab=500)
    switch = wg.call(HybridWorker.enter_rollout, version=1, step=1)
    from hybridrl.controller.metrics import episode_rows
    from hybridrl.data.trajectory import from_batch
    from hybridrl.envs.tasks import get_task

    task = get_task(cfg.task.name, cfg.task)
    trajectories = from_batch(wg.call(HybridWorker.rollout, episode_rows(task.train_split(2), 2, 1)))
    after = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=6)
    _write(cfg, {"first": first, "per_rank": per_rank, "switch": switch, "after": after,
                 "versions": sorted({v for t in trajectories for v in t.versions}),
                 "episodes": len(trajectories)})


GROUPED = Job("grouped", HybridWorker, grouped_rollout)
