"""The RL objective, assembled from the configured pieces (the trainer never branches on names).

`compute_advantages(cfg, ...)` / `compute_gae(cfg, ...)` run the configured estimator (its
registry entry, `algo/registry.py`); `make_loss_fn(cfg)` returns the per-token loss the training
engine aggregates:

    token_loss = w * pg_loss
               + kl_coef * sg(pi / pi_old) * w * KL      (when kl_in == 'loss')
               - entropy_coef * [w > 0] * H

pg_loss is the configured policy loss (its ratio to the proximal policy pi_old), w the behaviour
weight pi_old / pi_behaviour as `algo/correction.py` defines it (TIS / decoupled-PPO weight and
MIS masks; 1 with no correction), sg() a detached factor; the KL options and the gradient each
gives are in `algo/kl.py`. sg(pi / pi_old) * w is the importance weight of the KL term's samples:
they come from the behaviour policy, not from pi. A token the correction rejects (w = 0: MIS out
of its band, or decoupled PPO's mask above the cap) leaves the update whole: it gets no entropy
bonus either (the bonus would otherwise keep pushing the very tokens judged too far off-policy).

The micro-batch must carry `old_logprobs`, `advantages`, `loss_mask`, and as configured
`ref_logprobs` (KL in the loss) and `behavior_logprobs` (a behaviour weight), all [b, T]
token-aligned. With `make_loss_fn(cfg, old_from_forward=True)` (one optimizer step per rollout
batch) the training forward's own detached logprobs are the old logprobs: the ratio is 1 by
construction, its gradient is the policy gradient, and no separate old-logprob forward is needed.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.algo import correction, kl
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.groups import Reduce
from hybridrl.algo.registry import AdvantageInputs, estimator, policy_loss
from hybridrl.data.batch import Batch

LossFn = Callable[[torch.Tensor, "torch.Tensor | None", Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]

__all__ = ["compute_advantages", "compute_gae", "estimate", "kl_token_rewards", "make_loss_fn"]


def estimate(cfg: AlgoConfig, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The configured estimator: (advantages [N, T], returns [N, T] for a critic, else None)."""
    return estimator(cfg.advantage).compute(cfg, inputs)


def compute_advantages(cfg: AlgoConfig, rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor,
                       *, token_rewards: torch.Tensor | None = None, num_groups: int | None = None,
                       reduce: Reduce | None = None) -> torch.Tensor:
    """rewards [N] (outcome), group_index [N], mask [N, T], token_rewards [N, T] -> advantages [N, T],
    for an estimator without a critic.

    A batch split over data-parallel ranks (groups may straddle ranks): pass `reduce` (a sum over
    the ranks) and `num_groups`; every statistic is then the whole batch's (`groups.group_stats`)."""
    if estimator(cfg.advantage).needs_critic:
        raise ValueError(f"{cfg.advantage} needs the critic's values: use compute_gae(cfg, rewards, values, mask)")
    adv, _ = estimate(cfg, AdvantageInputs(rewards, group_index, mask, token_rewards=token_rewards,
                                           num_groups=num_groups, reduce=reduce))
    return adv


def compute_gae(cfg: AlgoConfig, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                *, token_rewards: torch.Tensor | None = None,
                reduce: Reduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For an estimator with a critic (gae): rewards [N] (outcome, on each row's last policy token),
    values [N, T] (the critic's, token-aligned), mask [N, T], token_rewards [N, T] -> (advantages
    [N, T] (whitened if cfg.gae_whiten), returns [N, T]). Per row; with `reduce` (a sum over the
    ranks holding the batch) whitening statistics are the whole batch's."""
    group_index = torch.zeros(rewards.shape[0], dtype=torch.long, device=rewards.device)
    adv, returns = estimate(cfg, AdvantageInputs(rewards, group_index, mask, token_rewards=token_rewards,
                                                 values=values, reduce=reduce))
    if returns is None:
        raise ValueError(f"{cfg.advantage} trains no critic (it returns no value targets): use compute_advantages")
    return adv, returns


def kl_token_rewards(cfg: AlgoConfig, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """-kl_coef * KL per policy token (for kl_in == 'reward'; `logprobs` are the old ones)."""
    return -cfg.kl_coef * kl.kl(logprobs, ref_logprobs, cfg.kl_option) * mask


def make_loss_fn(cfg: AlgoConfig, *, old_from_forward: bool = False) -> LossFn:
    """loss_fn(logprobs [b, T], entropy [b, T] | None, micro_batch) -> (token_loss [b, T], metrics
    {name: [b, T]} with 'ratio', 'pg_loss', and as configured 'tis_weight', 'tis_capped',
    'mis_masked', 'kl', 'entropy'); see the module docstring."""
    pg = policy_loss(cfg.policy_loss)
    kl_in_loss = cfg.kl_coef > 0 and cfg.kl_in == "loss"
    needs_rows = cfg.mis in ("sequence", "geometric")

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch):
        old = logprobs.detach() if old_from_forward else mb["old_logprobs"]
        token_loss, metrics = pg.compute(cfg, logprobs, old, mb["advantages"])
        weight = None
        if cfg.corrects_behavior:
            rows = mb["loss_mask"].to(logprobs.device) if needs_rows else None
            weight, extra = correction.behavior_weights(cfg, old, mb["behavior_logprobs"], rows)
            token_loss = token_loss * weight
            metrics.update(extra)
        metrics["pg_loss"] = token_loss.detach()
        if kl_in_loss:
            k = kl.kl(logprobs, mb["ref_logprobs"], cfg.kl_option)
            samples = torch.exp(logprobs.detach() - old)           # sg(pi / pi_old)
            if weight is not None:
                samples = samples * weight                         # ... x pi_old / pi_behaviour
            token_loss = token_loss + cfg.kl_coef * samples * k
            metrics["kl"] = k.detach()
        if entropy is not None:
            metrics["entropy"] = entropy.detach()
            if cfg.entropy_coef > 0:
                bonus = entropy if weight is None else entropy * (weight > 0).to(entropy.dtype)   # not on rejected tokens
                token_loss = token_loss - cfg.entropy_coef * bonus
        return token_loss, metrics

    return loss_fn
