"""Vocab-parallel log-probabilities and entropy, with their own backward, computed in chunks.

Each TP rank holds the logits of its vocabulary slice ([..., V/tp]); the full logits are never
gathered. Tokens are processed in chunks of `chunk_tokens`, so the float32 working copies (the
tempered logits, their exponentials) exist for one chunk at a time, never for the whole
vocabulary of every token; nothing float32 of vocabulary width is kept for backward (only the
logits the model produced, which are alive anyway, and four per-token scalars). The forward is
one pass with a running (online) softmax: per chunk the local max m, sum exp(z - m) and, for
entropy only, sum exp(z - m) z; then three all-reduces over the TP group in all (max, then the
rescaled sums and the target's logit together). The backward recomputes p chunk by chunk and
needs no communication: with z = logits / T, p = softmax(z), lse = logsumexp(z), for each local
column j

    d logp(y) / dz_j = 1[j = y] - p_j
    d H / dz_j       = -p_j (z_j - E_p[z])              (H = lse - E_p[z])

and d/dlogits = d/dz / T. Columns at or beyond `vocab_size` (Megatron's vocabulary padding)
are excluded from the softmax and get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Default chunk: about this many float32 elements of vocabulary width per temporary (64 MiB).
CHUNK_ELEMENTS = 1 << 24


def default_chunk_tokens(vocab_local: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab_local))


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, vocab_size, group, with_entropy, chunk):
        # logits [..., Vl] (this rank's vocab slice starting at vocab_start); targets [...] global ids
        shape = logits.shape[:-1]
        num_local = logits.shape[-1]
        num_real = max(0, min(num_local, vocab_size - vocab_start))    # columns that are real tokens
        flat = logits.reshape(-1, num_local)
        local = (targets - vocab_start).reshape(-1)
        in_slice = (local >= 0) & (local < num_real)
        n = flat.shape[0]
        device = logits.device
        m = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
        sums = torch.zeros(3 if with_entropy else 2, n, dtype=torch.float32, device=device)   # sumexp, target z, sum p z
        if num_real:
            index = local.clamp(0, num_real - 1)
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                z = flat[a:b, :num_real].float() / temperature                          # [c, Vr]
                mc = z.max(dim=-1).values
                m[a:b] = mc
                e = (z - mc.unsqueeze(-1)).exp_()
                sums[0, a:b] = e.sum(dim=-1)
                sums[1, a:b] = z.gather(-1, index[a:b].unsqueeze(-1)).squeeze(-1)
                if with_entropy:
                    sums[2, a:b] = (e * z).sum(dim=-1)
                del z, e
        sums[1] = torch.where(in_slice, sums[1], torch.zeros_like(sums[1]))
        zmax = m.clone()
        _all_reduce(zmax, group, dist.ReduceOp.MAX)
        scale = torch.where(torch.isfinite(m), (m - zmax).exp(), torch.zeros_like(m))    # local -> global max
        sums[0] *= scale
        if with_entropy:
            sums[2] *= scale
        _all_reduce(sums, group)
        lse = zmax + sums[0].log()
        logprobs = sums[1] - lse
        mean_z = sums[2] / sums[0] if with_entropy else torch.zeros_like(lse)          # E_p[z]
        entropy = lse - mean_z if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(logits, lse, local, in_slice, mean_z)
        ctx.args = (temperature, num_real, with_entropy, chunk)
        return logprobs.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, lse, local, in_slice, mean_z = ctx.saved_tensors
        temperature, num_real, with_entropy, chunk = ctx.args
        num_local = logits.shape[-1]
        flat = logits.reshape(-1, num_local)
        n = flat.shape[0]
        grad = torch.zeros_like(flat)                                                    # logits' dtype
        g_lp = grad_logprobs.reshape(-1).float() if grad_logprobs is not None else None
        g_ent = grad_entropy.reshape(-1).float() if (with_entropy and grad_entropy is not None) else None
        if num_real and (g_lp is not None or g_ent is not None):
            index = local.clamp(0, num_real - 1)
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                z = flat[a:b, :num_real].float() / temperature
                p = (z - lse[a:b].unsqueeze(-1)).exp_()                                   # [c, Vr]
                if g_ent is not None:                       # d/dz of g_lp * logp(y) + g_ent * H
                    coef = (z - mean_z[a:b].unsqueeze(-1)).mul_(g_ent[a:b].unsqueeze(-1))
                    if g_lp is not None:
                        coef.add_(g_lp[a:b].unsqueeze(-1))
                    g = p.mul_(coef).neg_()
                    del coef
                else:
                    g = p.mul_(g_lp[a:b].unsqueeze(-1)).neg_()
                if g_lp is not None:
                    onehot = torch.where(in_slice[a:b], g_lp[a:b], torch.zeros_like(g_lp[a:b]))
                    g.scatter_add_(-1, index[a:b].unsqueeze(-1), onehot.unsqueeze(-1))
                grad[a:b, :num_real] = g.div_(temperature)
                del z, p, g
        return grad.view(logits.shape), None, None, None, None, None, None, None


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
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[targets] and (optionally) the entropy, for logits split over vocab.

    logits [..., Vl]: this rank's columns [vocab_start, vocab_start + Vl) of the (padded) vocab;
    targets [...]: global token ids; vocab_size: real tokens (padding columns are excluded).
    chunk_tokens: tokens per chunk of the float32 working copies (default: ~64 MiB of them).
    Returns float32 logprobs [...] and entropy [...] (None unless asked)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = int(chunk_tokens) if chunk_tokens else default_chunk_tokens(logits.shape[-1])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logprobs, entropy = _VocabParallelLogprobs.apply(
        logits, targets, float(temperature), int(vocab_start), int(vocab_size), group, bool(with_entropy), chunk)
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
