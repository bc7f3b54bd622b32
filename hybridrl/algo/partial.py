"""How the loss treats a trajectory whose policy tokens come from several policy versions
(`algo.partial_policy`), e.g. an episode interrupted by a partial rollout and continued after
a weight update. Tokens are never relabelled: `policy_version[b, t]` is the version that sampled
token t and `behavior_logprobs[b, t]` its logprob under that version.

    newest_segment  only the tokens of the row's newest version are trained; the earlier segments
                    stay in the sequence as fixed context (loss_mask 0). This is NOT on-policy in
                    general: the newest version of a row is older than the trainer's when the
                    episode finished early and waited for its group, or its group waited in the
                    queue for a later step. Those tokens are corrected like any stale token, by the
                    behaviour weight pi_old / pi_behaviour (`algo/correction.py`: algo.tis_cap,
                    algo.mis); `hybridrl config show --explain` refuses partial rollouts without
                    one, and algo.max_policy_lag bounds their age.
    per_segment     every policy token is trained; each token's off-policy correction uses the
                    behaviour logprob of the version that sampled it (the same behaviour weight,
                    per token); needs algo.tis_cap > 0.
    discard_mixed   a row with more than one version contributes no token to the loss (loss_mask
                    0 on the whole row); its reward still counts in its group's baseline, so the
                    baseline is not biased towards the episodes that finished within one version.

`apply(policy, batch)` rewrites `loss_mask` in place (denominators follow the mask) and returns
counts for the step's metrics.
"""

from __future__ import annotations

import torch

from hybridrl.algo.config import PARTIAL_POLICIES
from hybridrl.data.batch import Batch


def newest_segment_mask(loss_mask: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    """loss_mask [B, T] restricted to the tokens of each row's newest version (versions [B, T], -1 off-policy)."""
    policy = loss_mask > 0
    newest = torch.where(policy, versions, torch.full_like(versions, -1)).max(dim=1, keepdim=True).values
    return loss_mask * (versions == newest).to(loss_mask.dtype)


def mixed_rows(loss_mask: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose policy tokens come from more than one version."""
    policy = loss_mask > 0
    big = torch.iinfo(versions.dtype).max
    newest = torch.where(policy, versions, torch.full_like(versions, -1)).max(dim=1).values
    oldest = torch.where(policy, versions, torch.full_like(versions, big)).min(dim=1).values
    return policy.any(dim=1) & (newest != oldest)


def apply(policy: str, batch: Batch) -> dict[str, float]:
    """Rewrite batch['loss_mask'] per `policy`; returns partial/* counts (rows, tokens)."""
    if policy not in PARTIAL_POLICIES:
        raise ValueError(f"algo.partial_policy must be one of {', '.join(PARTIAL_POLICIES)}, got {policy!r}")
    mask, versions = batch["loss_mask"], batch["policy_version"]
    mixed = mixed_rows(mask, versions)
    before = float(mask.sum())
    if policy == "newest_segment":
        new = newest_segment_mask(mask, versions)
    elif policy == "discard_mixed":
        new = mask * (~mixed).to(mask.dtype).unsqueeze(1)
    else:
        new = mask
    batch.set("loss_mask", new)
    return {"partial/mixed_rows": float(mixed.sum()), "partial/context_tokens": before - float(new.sum())}
