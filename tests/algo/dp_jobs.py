"""Run under torchrun (gloo): every rank computes advantages on its share of one batch, with the
group and batch statistics summed over the ranks; rank 0 writes each estimator's largest difference
to the whole batch computed on one rank. Usage: python -m tests.algo.dp_jobs OUT.json"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.objective import compute_advantages

CONFIGS = {"grpo": AlgoConfig(advantage="grpo"), "grpo_no_std": AlgoConfig(advantage="grpo", norm_adv_by_std=False),
           "rloo": AlgoConfig(advantage="rloo"), "reinforce_pp": AlgoConfig(advantage="reinforce_pp"),
           "reinforce_pp_no_baseline": AlgoConfig(advantage="reinforce_pp", reinforce_baseline="none")}


def batch(n: int = 11, t: int = 7):
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([0, 1, 0, 2, 1, 0, 3, 2, 1, 3, 4])[:n]         # group 4 has one member
    lengths = torch.randint(2, t + 1, (n,), generator=g)
    mask = (torch.arange(t) < lengths.unsqueeze(1)).float()
    mask[:, 0] = 0
    rewards = torch.rand(n, generator=g)
    token_rewards = -0.1 * torch.rand(n, t, generator=g) * mask            # e.g. KL in the reward
    return rewards, groups, mask, token_rewards


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rewards, groups, mask, token_rewards = batch()
    cut = [0, 6, len(rewards)]                       # rank 0: rows 0-5, rank 1: rows 6-10 + a filler row
    lo, hi = cut[rank], cut[rank + 1]
    mine = [rewards[lo:hi], groups[lo:hi], mask[lo:hi], token_rewards[lo:hi]]
    if rank == 1:
        mine = [torch.cat([mine[0], torch.tensor([5.0])]), torch.cat([mine[1], torch.tensor([-1])]),
                torch.cat([mine[2], torch.zeros(1, mask.shape[1])]), torch.cat([mine[3], torch.zeros(1, mask.shape[1])])]

    def dp_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    result = {}
    for name, cfg in CONFIGS.items():
        for with_tokens in (False, True):
            local = compute_advantages(cfg, mine[0], mine[1], mine[2], token_rewards=mine[3] if with_tokens else None,
                                       num_groups=5, reduce=dp_sum)
            parts = [None] * world
            dist.all_gather_object(parts, local[: hi - lo].tolist())
            whole = compute_advantages(cfg, rewards, groups, mask, token_rewards=token_rewards if with_tokens else None)
            joined = torch.tensor([row for p in parts for row in p])
            result[f"{name}{'+tokens' if with_tokens else ''}"] = {
                "max_diff": float((joined - whole).abs().max()), "max_abs": float(whole.abs().max()),
                "filler_zero": bool(rank != 1 or float(local[hi - lo:].abs().sum()) == 0.0)}
    flags = [None] * world
    dist.all_gather_object(flags, {k: v["filler_zero"] for k, v in result.items()})
    if rank == 0:
        for k in result:
            result[k]["filler_zero"] = all(f[k] for f in flags)
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(lambda: main(sys.argv[1]))
