"""Controllers for the critic's worker tests (real ranks); each writes result.json."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.data.batch import Batch
from hybridrl.controller.placements import build_colocated
from hybridrl.jobs import Job
from hybridrl.workers.rank import RankWorker
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch
from hybridrl.workers.train_side import TrainSide
from tests.workers.hybrid_jobs import PROMPTS, _write


def _value_batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (4, 16), generator=g)
    mask = torch.zeros(4, 16)
    mask[:, 8:] = 1
    return Batch({"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long), "loss_mask": mask,
                  "returns": torch.randn(4, 16, generator=g) * mask})


def _critic_step(wg, seed: int) -> tuple[dict, list]:
    batch = _value_batch(seed)
    batch.set("values", wg.call(TrainSide.compute_values, batch)["values"])
    update = {k: v for k, v in wg.call(TrainSide.train_critic, batch)[0].items()
              if k != "grad_reduce_s"}                    # timing: not a number a resumed step reproduces
    return update, wg.call(TrainSide.compute_values, batch)["values"].tolist()


def memory_and_checkpoint(cfg, wg):
    """The critic's optimizer state by accounting in TRAIN / ROLLOUT / back in TRAIN; then save a
    checkpoint, take a step, load it and take the same step again."""
    first, _ = _critic_step(wg, seed=0)
    train = wg.call(RankWorker.memory_report)[0]
    wg.call(ModeSwitch.enter_rollout, version=0, step=1)
    wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=4)
    rollout = wg.call(RankWorker.memory_report)[0]
    wg.call(ModeSwitch.enter_train)
    back = wg.call(RankWorker.memory_report)[0]
    model_dir = Path(cfg.run.dir) / "ckpt" / "model"
    model_dir.mkdir(parents=True)
    wg.call(TrainSide.save_checkpoint, path=str(model_dir), extra={"step": 1})
    after_save, values_a = _critic_step(wg, seed=1)
    _critic_step(wg, seed=2)                          # moves the critic further
    wg.call(TrainSide.load_checkpoint, path=str(model_dir))
    after_load, values_b = _critic_step(wg, seed=1)
    _write(cfg, {"first": first, "train": train, "rollout": rollout, "back": back, "after_save": after_save,
                 "after_load": after_load, "values_a": values_a, "values_b": values_b,
                 "critic_dir": sorted(p.name for p in (model_dir.parent / "critic").iterdir())})


MEMORY_AND_CHECKPOINT = Job("critic-memory", build_colocated, memory_and_checkpoint)


def reward_model_rollout(cfg, wg):
    """One rollout with a reward model: every trajectory's ids, rewards and evaluators, and the phases."""
    from hybridrl.controller import metrics as M
    from hybridrl.data.trajectory import from_batch
    from hybridrl.envs.tasks import get_task

    instances = get_task(cfg.task.name, cfg.task).train_split()[:4]
    wg.call(ModeSwitch.enter_rollout, version=0, step=1)
    trajectories = from_batch(wg.call(RolloutSide.rollout, M.episode_rows(instances[:2], 2, 1)))
    # the partial collection's complete groups are scored too
    rows = M.episode_rows(instances[2:], 2, 2)
    episodes = [{"instance": i, "attempt": a, "group_id": g}
                for i, a, g in zip(rows["instance"], rows["attempt"], rows["group_id"])]
    outs = wg.call(RolloutSide.collect, episodes=episodes, quorum=10 ** 6, deadline_s=0.0, poll_s=0.01)
    collected = [t for out in outs for t in out["trajectories"]]
    report = wg.call(RankWorker.memory_report)[0]

    def record(t):
        return {"ids": t.prompt_ids + t.response_ids, "rewards": t.rewards, "evaluators": t.reward_evaluators,
                "reward": t.reward, "status": t.status.value}

    _write(cfg, {"trajectories": [record(t) for t in trajectories], "collected": [record(t) for t in collected],
                 "report": report})


REWARD_MODEL_ROLLOUT = Job("reward-model-rollout", build_colocated, reward_model_rollout)
