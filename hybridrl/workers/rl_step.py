"""The training side of one RL step, on one rank's share of the batch, against the training-engine
protocol (`training.protocol.TrainEngine`): pipeline stages, pass counting and ratio capture live in
the engines; this file is the algorithm.

    reference logprobs (a KL term)      -> batch['ref_logprobs']
    teacher logprobs (distillation)      -> batch['teacher_logprobs']
    old logprobs                         a forward only when the batch takes more than one optimizer
                                         step, the KL goes into the reward or a teacher distils (the
                                         advantages need the policy's logprobs); otherwise the first
                                         training forward's detached logprobs serve (ratio 1 by
                                         construction, and the rollout/trainer mismatch comes from it)
    the critic's values (GAE)            -> batch['values']
    KL in the reward, advantages         on the loss ranks; group and batch statistics summed over
                                         the data-parallel ranks, so a group split over ranks gets the
                                         whole group's statistics; a teacher's per-token term added
                                         (`algo/distill.py`)
    critic steps, then ppo_epochs x mini-batches actor steps, on the same mini-batches

The batch arrives laid out by `algo.minibatches` (tensors: input_ids, attention_mask, loss_mask,
behavior_logprobs, reward, group_index; MoE: routed_experts, which the engine's routers replay or
compare with their own choice). What returns, on the output ranks, is one Batch row per
input row: the row's mean advantage and worst mismatch, the per-token old logprobs, advantages
(and reference logprobs) the run ledger keeps, and in `info` the step's scalars ('metrics'), one
dict per optimizer step ('per_update') and the critic's scalars ('critic').
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridrl.algo.correction import mismatch_sums
from hybridrl.algo.minibatches import mini_batch_slices
from hybridrl.algo.objective import compute_advantages, compute_gae, kl_token_rewards
from hybridrl.data.batch import Batch


@dataclass
class Objective:
    """The configured losses: `policy` when old logprobs come from a separate forward, `on_policy` when
    the training forward's own detached logprobs are the old ones; `value` for a critic; `distill` the
    distillation section when a teacher scores the tokens."""

    algo: Any
    policy: Callable
    on_policy: Callable
    value: Callable | None = None
    distill: Any = None


def update_policy(actor, ref, critic, objective: Objective, batch: Batch, *, mini_batch_rows: list[int],
                  num_groups: int, epochs: int, temperature: float, update_actor: bool = True,
                  teacher=None) -> Batch | None:
    """score (reference, teacher, old logprobs) -> advantages (and the critic's values) -> train (critic,
    then the actor) -> report (the step's rows and scalars, on the output ranks; None elsewhere)."""
    algo = objective.algo
    if (teacher is None) != (objective.distill is None):
        raise ValueError("update_policy: a teacher needs the objective's distill section, and that section a teacher")
    batch = batch.to(actor.device)
    slices = mini_batch_slices(mini_batch_rows)
    if slices[-1][1] != len(batch):
        raise ValueError(f"mini_batch_rows {mini_batch_rows} cover {slices[-1][1]} rows, this rank holds "
                         f"{len(batch)}: lay the batch out with algo.minibatches.lay_out")
    separate_old = epochs * len(slices) > 1 or (ref is not None and algo.kl_in == "reward") or teacher is not None
    before = _passes_now(actor, ref, teacher)
    timings = {"time/T_ref": 0.0, "time/T_old": 0.0, "time/T_teacher": 0.0}
    _score(actor, ref, teacher, batch, temperature=temperature, separate_old=separate_old, timings=timings)
    started = time.perf_counter()
    advantages, distilled = _advantages(actor, ref, critic, teacher, objective, batch, num_groups)
    timings["time/T_adv"] = time.perf_counter() - started
    critic_metrics = {}
    if critic is not None:
        started = time.perf_counter()
        critic_metrics = _train_critic(critic, objective.value, batch, slices, epochs)
        timings["time/T_critic"] = time.perf_counter() - started
    per_update: list[dict] = []
    captured = None
    if update_actor:
        started = time.perf_counter()
        per_update, captured = _train_actor(actor, objective.policy if separate_old else objective.on_policy, batch,
                                            slices, epochs, temperature=temperature, capture=not separate_old)
        timings["time/T_update"] = time.perf_counter() - started
    passes = _passes_since(before, actor, ref, teacher)
    if not actor.is_loss_rank:
        return None
    old = batch["old_logprobs"] if separate_old else captured
    metrics: dict[str, float] = {**timings, **passes, **distilled}
    if update_actor:
        metrics.update(_step_scalars(actor, per_update, len(slices), old, batch["behavior_logprobs"],
                                     batch["loss_mask"]))
    if not actor.is_output_rank:
        return None
    return _report(batch, advantages, old, ref=ref, teacher=teacher, update_actor=update_actor,
                   info={"metrics": metrics, "per_update": per_update, "critic": critic_metrics})


def _everywhere(out: Batch | None, name: str, device: Any, mask: torch.Tensor) -> torch.Tensor:
    """`out[name]` on `device`, or zeros shaped like `mask` off the loss ranks (no loss there)."""
    return out[name].to(device) if out is not None else torch.zeros_like(mask)


def _score(actor, ref, teacher, batch: Batch, *, temperature: float, separate_old: bool,
           timings: dict[str, float]) -> None:
    """The logprobs the advantages and the losses need: batch['ref_logprobs'] (a KL term),
    ['teacher_logprobs'] (distillation), ['old_logprobs'] (when the old ones need a forward of their own)."""
    mask = batch["loss_mask"]
    for name, model, key in (("ref", ref, "ref_logprobs"), ("teacher", teacher, "teacher_logprobs"),
                             ("old", actor if separate_old else None, "old_logprobs")):
        if model is None:
            continue
        started = time.perf_counter()
        out = model.compute_logprobs(batch, temperature=temperature, on_last_stage=True)
        batch.set(key, _everywhere(out, "logprobs", actor.device, mask))
        timings[f"time/T_{name}"] = time.perf_counter() - started


def _advantages(actor, ref, critic, teacher, objective: Objective, batch: Batch,
                num_groups: int) -> tuple[torch.Tensor, dict[str, float]]:
    """batch['advantages'] (and the critic's ['values'] and ['returns']) on the loss ranks, zeros elsewhere;
    returns them and the distillation's scalars."""
    algo, mask = objective.algo, batch["loss_mask"]
    if critic is not None:
        batch.set("values", _everywhere(critic.compute_values(batch, on_last_stage=True), "values", actor.device,
                                        mask))
    advantages = torch.zeros_like(mask)
    distilled: dict[str, float] = {}
    if actor.is_loss_rank:
        token_rewards = (kl_token_rewards(algo, batch["old_logprobs"], batch["ref_logprobs"], mask)
                         if ref is not None and algo.kl_in == "reward" else None)
        if critic is not None:
            advantages, returns = compute_gae(algo, batch["reward"], batch["values"], mask,
                                              token_rewards=token_rewards, reduce=actor.dp_sum)
            batch.set("returns", returns)
        else:
            advantages = compute_advantages(algo, batch["reward"], batch["group_index"], mask,
                                            token_rewards=token_rewards, num_groups=num_groups, reduce=actor.dp_sum)
        if teacher is not None:        # the teacher's per-token term on the student's old logprobs
            from hybridrl.algo import distill

            old, scored = batch["old_logprobs"], batch["teacher_logprobs"]
            advantages = distill.token_advantages(objective.distill, advantages, old, scored, mask)
            distilled = distill.metrics(actor.dp_sum(distill.reverse_kl_sums(old, scored, mask)))
    elif critic is not None:                 # ranks off the last stage compute no loss: shapes only
        batch.set("returns", torch.zeros_like(mask))
    batch.set("advantages", advantages.to(torch.float32))
    return advantages, distilled


def _train_actor(actor, loss_fn: Callable, batch: Batch, slices: list[tuple[int, int]], epochs: int, *,
                 temperature: float, capture: bool) -> tuple[list[dict], torch.Tensor | None]:
    """`epochs` passes over the mini-batches, one optimizer step each: their scalars, and with `capture` the
    first forward's detached logprobs (the old ones when no separate forward computed them), placed in a
    tensor shaped like the share."""
    per_update: list[dict] = []
    captured = None
    for _ in range(epochs):
        for lo, hi in slices:
            first = capture and not per_update
            out = actor.train_step(batch.slice(lo, hi), loss_fn, temperature=temperature, with_entropy=True,
                                   extremes=("ratio",), capture=first)
            if first:
                captured = out.pop("logprobs")
                captured = None if captured is None else _rows(captured, batch["loss_mask"], lo, hi)
            per_update.append(out)
    return per_update, captured


def _passes_now(actor, ref, teacher) -> tuple[dict, dict, dict]:
    return (dict(actor.passes), dict(ref.passes) if ref is not None else {},
            dict(teacher.passes) if teacher is not None else {})


def _passes_since(before: tuple[dict, dict, dict], actor, ref, teacher) -> dict[str, float]:
    """The forward and training passes this step ran, per model."""
    return {"passes/train": float(actor.passes["train"] - before[0]["train"]),
            "passes/old_logprobs": float(actor.passes["logprobs"] - before[0]["logprobs"]),
            "passes/ref_logprobs": float(ref.passes["logprobs"] - before[1]["logprobs"]) if ref is not None else 0.0,
            "passes/teacher_logprobs": (float(teacher.passes["logprobs"] - before[2]["logprobs"])
                                        if teacher is not None else 0.0)}


def _report(batch: Batch, advantages: torch.Tensor, old: torch.Tensor | None, *, ref, teacher, update_actor: bool,
            info: dict[str, Any]) -> Batch:
    """One row per input row: its mean advantage and worst rollout/trainer mismatch, and when the actor
    trained the per-token old logprobs, advantages (reference and teacher logprobs) the ledger keeps."""
    mask = batch["loss_mask"]
    on = mask > 0
    tokens = on.sum(dim=1).clamp(min=1)
    worst = (torch.where(on, (old - batch["behavior_logprobs"]).abs(), torch.zeros_like(old)).max(dim=1).values
             if old is not None else torch.zeros(len(batch)))
    rows = {"advantage": (advantages * on).sum(dim=1) / tokens, "mismatch_max_abs": worst}
    if update_actor:
        rows.update(old_logprobs=old, advantages=advantages.to(torch.float32),
                    **({"ref_logprobs": batch["ref_logprobs"]} if ref is not None else {}),
                    **({"teacher_logprobs": batch["teacher_logprobs"]} if teacher is not None else {}))
    return Batch({k: v.detach().float().cpu() for k, v in rows.items()}, info=info)


def _rows(values: torch.Tensor, mask: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Values of rows [lo, hi) placed in a tensor shaped like the whole share (zeros elsewhere)."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    out[lo:hi, : values.shape[1]] = values.to(out.device)
    return out


def _step_scalars(actor, per_update: list[dict], per_epoch: int, old: torch.Tensor, behavior: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, float]:
    """One step's scalars from its optimizer steps: means of each metric, the last learning rate, the tokens
    and sequences of one epoch (the batch, counted once; model_tokens: the positions the model ran for
    them), ratio extremes, and the rollout/trainer mismatch
    over the data-parallel ranks."""
    counts = [k for k in ("num_tokens", "num_sequences", "model_tokens") if k in per_update[0]]
    keys = [k for k in per_update[0] if k not in ("lr", "ratio_max", "ratio_min", "grad_reduce_s", *counts)]
    out = {k: sum(u[k] for u in per_update) / len(per_update) for k in keys}
    out["lr"] = per_update[-1]["lr"]
    for k in counts:
        out[k] = sum(u[k] for u in per_update[:per_epoch])
    out["grad_norm_max"] = max(u["grad_norm"] for u in per_update)
    out["time/grad_reduce_s"] = sum(u.get("grad_reduce_s", 0.0) for u in per_update)    # every optimizer step's
    out["clip_fraction_last"] = per_update[-1].get("clip_fraction", 0.0)
    out["ratio_max"] = max(u["ratio_max"] for u in per_update)
    out["ratio_min"] = min(u["ratio_min"] for u in per_update)
    out["optimizer_steps"] = float(len(per_update))
    local = mismatch_sums(old, behavior, mask)
    total = actor.dp_sum(local["sums"])
    worst = float(actor.dp_max(local["max_abs"].reshape(1).double())[0])
    n = max(float(total[0]), 1.0)
    out.update({"mismatch/max_abs": worst, "mismatch/mean_abs": float(total[1]) / n, "mismatch/k3": float(total[2]) / n})
    return out


def _train_critic(critic, value_loss: Callable, batch: Batch, slices: list[tuple[int, int]],
                  epochs: int) -> dict[str, float]:
    """`epochs` passes of one critic step per mini-batch slice: critic/* (means over the steps, the last
    learning rate, the step count)."""
    steps = [critic.train_step(batch.slice(lo, hi), value_loss) for _ in range(epochs) for lo, hi in slices]
    out = {f"critic/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]
           if k not in ("lr", "num_tokens", "num_sequences", "grad_reduce_s")}
    out["critic/lr"] = steps[-1]["lr"]
    out["critic/optimizer_steps"] = float(len(steps))
    return out
