"""Vocab-parallel log-probabilities and entropy, with their own backward.

Each TP rank holds the logits of its vocabulary slice ([..., V/tp]); the full logits are never
gathered. The forward all-reduces three per-token scalars over the TP group (max, sum of exp,
the target's logit) and one more for entropy (E_p[z]). The backward needs no communication:
with z = logits / T, p = softmax(z), lse = logsumexp(z), for each local column j

    d logp(y) / dz_j = 1[j = y] - p_j
    d H / dz_j       = -p_j (z_j - E_p[z])              (H = lse - E_p[z])

and d/dlogits = d/dz / T. Columns at or beyond `vocab_size` (Megatron's vocabulary padding)
are excluded from the softmax and get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, vocab_size, group, with_entropy):
        # logits [..., Vl] (this rank's vocab slice starting at vocab_start); targets [...] global ids
        z = logits.float() / temperature                                 # [..., Vl]
        num_local = z.shape[-1]
        num_real = max(0, min(num_local, vocab_size - vocab_start))    # columns that are real tokens
        if num_real < num_local:
            z[..., num_real:] = float("-inf")
        zmax = z.max(dim=-1).values                                      # [...]
        _all_reduce(zmax, group, dist.ReduceOp.MAX)
        shifted = z - zmax.unsqueeze(-1)
        sumexp = shifted.exp().sum(dim=-1)                               # [...]
        _all_reduce(sumexp, group)
        lse = zmax + sumexp.log()                                        # [...]

        local = targets - vocab_start
        in_slice = (local >= 0) & (local < num_real)
        picked = z.gather(-1, local.clamp(0, num_local - 1).unsqueeze(-1)).squeeze(-1)
        target_z = torch.where(in_slice, picked, torch.zeros_like(picked))
        _all_reduce(target_z, group)
        logprobs = target_z - lse                                         # [...]

        mean_z = torch.zeros_like(lse)                                   # E_p[z], only with entropy
        if with_entropy:
            p = (z - lse.unsqueeze(-1)).exp()                              # padded columns: exp(-inf) = 0
            mean_z = torch.where(p > 0, p * z, torch.zeros_like(p)).sum(dim=-1)
            _all_reduce(mean_z, group)
        entropy = lse - mean_z if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(z, lse, local, in_slice, mean_z)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.logits_dtype = logits.dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        z, lse, local, in_slice, mean_z = ctx.saved_tensors
        p = (z - lse.unsqueeze(-1)).exp()                                # [..., Vl]
        grad = torch.zeros_like(z)
        if grad_logprobs is not None:
            grad -= p * grad_logprobs.unsqueeze(-1)
            onehot_grad = torch.where(in_slice, grad_logprobs, torch.zeros_like(grad_logprobs))
            grad.scatter_add_(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1), onehot_grad.unsqueeze(-1))
        if ctx.with_entropy and grad_entropy is not None:
            centered = torch.where(p > 0, z - mean_z.unsqueeze(-1), torch.zeros_like(z))
            grad -= p * centered * grad_entropy.unsqueeze(-1)
        grad /= ctx.temperature
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[targets] and (optionally) the entropy, for logits split over vocab.

    logits [..., Vl]: this rank's columns [vocab_start, vocab_start + Vl) of the (padded) vocab;
    targets [...]: global token ids; vocab_size: real tokens (padding columns are excluded).
    Returns float32 logprobs [...] and entropy [...] (None unless asked)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logprobs, entropy = _VocabParallelLogprobs.apply(
        logits, targets, float(temperature), int(vocab_start), int(vocab_size), group, bool(with_entropy))
    return logprobs, (entropy if with_entropy else None)


def token_aligned(per_next: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Shift next-token values to token alignment: out[b, t] = per_next[b, t-1], out[:, 0] = 0,
    and 0 where attention_mask is 0. per_next [B, T] holds at t the value for token t+1."""
    out = torch.zeros_like(per_next)
    out[:, 1:] = per_next[:, :-1]
    return torch.where(attention_mask.bool(), out, torch.zeros_like(out))


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """targets[b, t] = input_ids[b, t+1] (the last column repeats a valid id; it is never used)."""
    targets = input_ids.clone()
    targets[:, :-1] = input_ids[:, 1:]
    return targets
