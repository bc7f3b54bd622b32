"""The training side of the hybrid worker: one RL step's update in one call, and its single pieces.

- `update_policy`: on this rank's share of a batch laid out by `algo.minibatches`, reference logprobs
  (KL configured) -> old logprobs (a separate forward only when the batch takes more than one
  optimizer step or the KL goes into the reward; otherwise the first training forward's detached
  logprobs serve) -> KL-in-reward -> advantages (group and batch statistics summed over the
  data-parallel ranks, exact when a group is split; GAE with a critic) -> ppo_epochs x mini-batches
  optimizer steps. Returns scalars and per-row values, never the batch.
- `update_lineage`: the last update's per-token old logprobs and advantages for the run ledger.
- `compute_logprobs` / `compute_ref_logprobs` / `train_step`: the single pieces (tests, probes).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridrl.algo.correction import mismatch_sums
from hybridrl.algo.minibatches import mini_batch_slices
from hybridrl.algo.objective import compute_advantages, kl_token_rewards
from hybridrl.data.batch import Batch
from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit
from hybridrl.workers.base import register
from hybridrl.workers.modes import Mode


class PolicyUpdateMixin:
    """Mixed into `HybridWorker`; expects self.cfg, self.modes, self.actor, self.ref, self.loss_fn,
    self.on_policy_loss_fn and the critic's hooks (`CriticMixin`)."""

    @register(dispatch=DPSplit("train"))
    def compute_logprobs(self, batch: Batch) -> Batch | None:
        """old_logprobs [B, T] of the current actor at the rollout temperature (token-aligned)."""
        self.modes.require(Mode.TRAIN)
        out = self.actor.compute_logprobs(batch, temperature=self._temperature())
        return None if out is None else Batch({"old_logprobs": out["logprobs"]})

    @register(dispatch=DPSplit("train"))
    def compute_ref_logprobs(self, batch: Batch) -> Batch | None:
        self.modes.require(Mode.TRAIN)
        if self.ref is None:
            raise RuntimeError("no reference model: algo.kl_coef is 0")
        out = self.ref.compute_logprobs(batch, temperature=self._temperature())
        return None if out is None else Batch({"ref_logprobs": out["logprobs"]})

    @register(dispatch=DPSplit("train"))
    def train_step(self, batch: Batch) -> dict:
        self.modes.require(Mode.TRAIN)
        with self.modes.phase("train"):
            return self.actor.train_step(batch, self.loss_fn, temperature=self._temperature(),
                                         with_entropy=True)

    @register(dispatch=DPSplit("train"))
    def update_policy(self, batch: Batch, *, mini_batch_rows: list[int], num_groups: int,
                      ppo_epochs: int | None = None, update_actor: bool = True) -> dict:
        """The training side of one RL step on this rank's share of a batch laid out by
        `algo.minibatches` (tensors: input_ids, attention_mask, loss_mask, behavior_logprobs,
        reward, group_index), in one call:

          reference logprobs (KL configured) -> old logprobs (a forward only when this batch takes
          more than one optimizer step or the KL goes into the reward; otherwise the first training
          forward's detached logprobs serve, and the rollout/trainer mismatch comes from that
          forward) -> KL-in-reward ->
          advantages (group and batch statistics summed over the data-parallel ranks: exact when a
          group is split) -> ppo_epochs x len(mini_batch_rows) optimizer steps.

        Returns, on the output ranks: {'metrics': scalars, 'per_update': one dict per optimizer step,
        'rows': per-row lists (advantage, mismatch_max_abs) in this share's row order}.
        `ppo_epochs` defaults to algo.ppo_epochs. With a critic (algo.advantage=gae, hybridrl/workers/critic.py)
        its values come before the advantages (GAE), it takes the same optimizer steps on the same
        mini-batches ('critic': its metrics), and `update_actor=False` (its warm-up) stops there."""
        from megatron.core import parallel_state as ps

        self.modes.require(Mode.TRAIN)
        algo, temperature, actor = self.cfg.algo, self._temperature(), self.actor
        device = actor.device
        batch = batch.to(device)
        slices = mini_batch_slices(mini_batch_rows)
        if slices[-1][1] != len(batch):
            raise ValueError(f"mini_batch_rows {mini_batch_rows} cover {slices[-1][1]} rows, this rank holds "
                             f"{len(batch)}: lay the batch out with algo.minibatches.lay_out")
        epochs = algo.ppo_epochs if ppo_epochs is None else ppo_epochs
        updates = epochs * len(slices)
        separate_old = updates > 1 or (algo.uses_reference and algo.kl_in == "reward")
        last_stage = ps.is_pipeline_last_stage()
        dp_group = ps.get_data_parallel_group()
        reduce_device = collective_device(dp_group, device)

        def dp_sum(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
            out = t.to(reduce_device)
            dist.all_reduce(out, op=op, group=dp_group)
            return out.to(t.device)

        passes_before = (dict(actor.passes), dict(self.ref.passes) if self.ref is not None else {})
        timings: dict[str, float] = {}
        mask = batch["loss_mask"]
        rows, length = mask.shape

        def aligned(out: Batch | None) -> torch.Tensor:      # every last-stage rank has them; the others need none
            return out["logprobs"].to(device) if out is not None else torch.zeros_like(mask)

        with self.modes.phase("train"):
            started = time.perf_counter()
            if algo.uses_reference:
                batch.set("ref_logprobs", aligned(self.ref.compute_logprobs(batch, temperature=temperature,
                                                                            on_last_stage=True)))
            timings["time/T_ref"] = time.perf_counter() - started
            started = time.perf_counter()
            if separate_old:
                batch.set("old_logprobs", aligned(actor.compute_logprobs(batch, temperature=temperature,
                                                                         on_last_stage=True)))
            timings["time/T_old"] = time.perf_counter() - started
            started = time.perf_counter()
            self._critic_values(batch, temperature)                 # gae: the critic's values (old)
            if last_stage:      # the loss runs there; its data-parallel group is the last stage's ranks
                token_rewards = (kl_token_rewards(algo, batch["old_logprobs"], batch["ref_logprobs"], mask)
                                 if algo.uses_reference and algo.kl_in == "reward" else None)
                advantages = (self._gae(batch, token_rewards, dp_sum) if algo.uses_critic else
                              compute_advantages(algo, batch["reward"], batch["group_index"], mask,
                                                 token_rewards=token_rewards, num_groups=num_groups, reduce=dp_sum))
            else:
                advantages = torch.zeros_like(mask)
            batch.set("advantages", advantages.to(torch.float32))
            batch.set("token_index", torch.arange(rows * length, device=device).view(rows, length))
            timings["time/T_adv"] = time.perf_counter() - started
            critic = self._train_critic(batch, slices, epochs)      # gae: the critic's steps, same mini-batches
            if not update_actor:                                    # the critic's warm-up: only it trains
                return {"metrics": {}, "per_update": [], "rows": {}, "critic": critic} if last_stage else {}

            started = time.perf_counter()
            captured = torch.zeros(rows * length, device=device)   # the first forward's logprobs
            extremes: list[torch.Tensor] = []                      # per update: [max ratio, -min ratio]
            loss_fn = self.loss_fn if separate_old else self.on_policy_loss_fn

            def observed(logprobs, entropy, mb):
                token_loss, metrics = loss_fn(logprobs, entropy, mb)
                on = mb["loss_mask"].to(logprobs.device) > 0
                if not per_update:
                    captured[mb["token_index"].to(device)[on]] = logprobs.detach()[on].to(captured.dtype)
                ratio = metrics["ratio"][on]
                if ratio.numel():
                    extremes[-1] = torch.maximum(extremes[-1], torch.stack([ratio.max(), -ratio.min()]).double())
                return token_loss, metrics

            per_update: list[dict] = []
            for _ in range(epochs):
                for lo, hi in slices:
                    extremes.append(torch.full((2,), -float("inf"), dtype=torch.float64, device=device))
                    per_update.append(actor.train_step(batch.slice(lo, hi), observed, temperature=temperature,
                                                       with_entropy=True))
            timings["time/T_update"] = time.perf_counter() - started
        passes = {"passes/train": actor.passes["train"] - passes_before[0]["train"],
                  "passes/old_logprobs": actor.passes["logprobs"] - passes_before[0]["logprobs"],
                  "passes/ref_logprobs": (self.ref.passes["logprobs"] - passes_before[1]["logprobs"]
                                          if self.ref is not None else 0)}
        if not last_stage:
            return {}
        old = batch["old_logprobs"] if separate_old else captured.view(rows, length)
        local = mismatch_sums(old, batch["behavior_logprobs"], mask)
        total = dp_sum(local["sums"])
        worst = dp_sum(torch.cat([local["max_abs"].reshape(1), torch.stack(extremes).reshape(-1)]),
                       op=dist.ReduceOp.MAX)
        ratio_max, ratio_min = worst[1::2], -worst[2::2]
        for record, hi, lo in zip(per_update, ratio_max.tolist(), ratio_min.tolist()):
            record["ratio_max"], record["ratio_min"] = hi, lo
        metrics = _mean_over_updates(per_update, len(slices))
        n = max(float(total[0]), 1.0)
        metrics.update({"ratio_max": float(ratio_max.max()), "ratio_min": float(ratio_min.min()),
                        "optimizer_steps": float(len(per_update)), "mismatch/max_abs": float(worst[0]),
                        "mismatch/mean_abs": float(total[1]) / n, "mismatch/k3": float(total[2]) / n,
                        **timings, **{k: float(v) for k, v in passes.items()}})
        if actor.is_output_rank:     # the lineage's per-token values, fetched by `update_lineage`
            kept = {"old_logprobs": old, "advantages": advantages.to(torch.float32),
                    **({"ref_logprobs": batch["ref_logprobs"]} if algo.uses_reference else {})}
            self._lineage = Batch({k: v.detach().float().cpu() for k, v in kept.items()})
        on = mask > 0
        tokens = on.sum(dim=1).clamp(min=1)
        per_row = {"advantage": ((advantages * on).sum(dim=1) / tokens).tolist(),
                   "mismatch_max_abs": torch.where(on, (old - batch["behavior_logprobs"]).abs(),
                                                   torch.zeros_like(old)).max(dim=1).values.tolist()}
        return {"metrics": metrics, "per_update": per_update, "rows": per_row, "critic": critic}

    @register(dispatch=ONE_TO_ALL)
    def update_lineage(self) -> Batch | None:
        """The last `update_policy`'s per-token old logprobs, advantages (and reference logprobs) of this
        rank's share, in its row order, on the train mesh's output ranks (None elsewhere): what the run
        ledger records per trajectory. Handed out once."""
        out, self._lineage = getattr(self, "_lineage", None), None
        return out

    def _temperature(self) -> float:
        """Training logprobs use the rollout temperature, as the sampler contract defines them."""
        return self.cfg.agent.temperature if self.cfg.agent.temperature > 0 else 1.0


def collective_device(group, device: torch.device) -> torch.device:
    """Where a collective on `group` needs its tensors: on the GPU for an NCCL group (NCCL reduces no
    CPU tensor), on the CPU for a gloo group, else `device`."""
    backend = str(dist.get_backend(group)).lower()
    return backend_device(backend, device)


def backend_device(backend: str, device: torch.device) -> torch.device:
    if "nccl" in backend:
        return device if device.type == "cuda" else torch.device("cuda")
    if backend == "gloo":
        return torch.device("cpu")
    return device


def _mean_over_updates(per_update: list[dict], per_epoch: int) -> dict[str, float]:
    """One step's scalars from its optimizer steps: means of each metric, the last learning rate, and
    the tokens and sequences of one epoch (the batch, counted once)."""
    keys = [k for k in per_update[0] if k not in ("lr", "num_tokens", "num_sequences")]
    out = {k: sum(u[k] for u in per_update) / len(per_update) for k in keys}
    out["lr"] = per_update[-1]["lr"]
    for k in ("num_tokens", "num_sequences"):
        out[k] = sum(u[k] for u in per_update[:per_epoch])
    out["grad_norm_max"] = max(u["grad_norm"] for u in per_update)
    out["clip_fraction_last"] = per_update[-1].get("clip_fraction", 0.0)
    return out
