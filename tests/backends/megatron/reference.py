"""Independent references for the Megatron backend tests: plain transformers + torch, no megatron."""

from __future__ import annotations

import torch

from hybridrl.algo.aggregation import aggregate, count
from hybridrl.data.batch import Batch, pad_sequences

LENGTHS = (12, 7, 3, 12, 9, 5, 11, 2)     # mixed lengths, right-padded to 12


def sequence_batch(num_rows: int, *, vocab: int, seed: int = 0, lengths=LENGTHS) -> Batch:
    """Random token ids of mixed lengths, right-padded: input_ids, attention_mask, loss_mask,
    and a per-row 'advantages' [B, T] (constant along each row)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=gen) for i in range(num_rows)]
    ids = pad_sequences(rows)
    mask = pad_sequences([[1] * len(r) for r in rows])
    loss_mask = mask.float().clone()
    loss_mask[:, :2] = 0.0                                # a "prompt" of 2 tokens is not trained on
    adv = torch.randn(num_rows, 1, generator=gen).expand(-1, ids.shape[1]).contiguous()
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, "advantages": adv})


def hf_logits(model, batch: Batch) -> torch.Tensor:
    """[B, T, V] logits of a transformers model, zero at padded positions."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits.float()
    return logits * mask.unsqueeze(-1)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned logprobs and entropies [B, T] from full logits (position 0 and padding: 0)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = torch.zeros(ids.shape, dtype=torch.float32)
    ent = torch.zeros(ids.shape, dtype=torch.float32)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]
    return lp * mask, ent * mask


def pg_loss(logprobs, entropy, mb: Batch):
    """The loss_fn used in the tests: a REINFORCE-style token loss plus two metrics."""
    adv = mb["advantages"].to(logprobs.device)
    token_loss = -adv * logprobs
    if entropy is not None:
        token_loss = token_loss - 0.01 * entropy
    return token_loss, {"logprob": logprobs, "adv": adv}


def hf_train_step(model, batch: Batch, *, lr: float, weight_decay: float, clip_grad: float, mode: str,
                  with_entropy: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of the same objective with transformers + torch AdamW over the whole batch.

    Weight decay spares 1-D parameters (norm scales, biases) like Megatron's optimizer; gradients
    are clipped by their total norm. Returns the loss and the updated state dict."""
    rows = batch.slice(0, batch.num_valid)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    ids, mask = rows["input_ids"], rows["attention_mask"].float()
    lp = torch.cat([torch.zeros(ids.shape[0], 1), logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)], 1)
    lp = lp * mask
    ent = None
    if with_entropy:
        e = -(logp.exp() * logp).sum(-1)
        ent = torch.cat([torch.zeros(ids.shape[0], 1), e[:, :-1]], 1) * mask
    token_loss, _ = pg_loss(lp, ent, rows)
    loss = aggregate(token_loss, rows["loss_mask"], mode, count(rows["loss_mask"]))
    opt.zero_grad()
    loss.backward()
    if clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    opt.step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict, what, *, lr: float, steps: int, tol: float = 1e-5) -> None:
    """Updated weights equal within `tol`, except the key biases: softmax is invariant to adding
    q.b_k to every key's score, so their exact gradient is 0 and what reaches Adam is rounding
    noise, which Adam's normalisation turns into steps of up to `lr` in either direction (layouts
    that sum in a different order differ there by O(lr)). Those may only move by the optimizer's
    bound over `steps` steps."""
    assert sorted(a) == sorted(b), what
    for name in a:
        diff = float((a[name] - b[name]).abs().max())
        bound = 2 * steps * lr * 1.01 if name.endswith("k_proj.bias") else tol
        assert diff < bound, (what, name, diff)


def numbers(step_metrics: dict) -> dict:
    """A training step's results without its timing (`grad_reduce_s`, the gradient reduction's seconds):
    what a resumed or repeated step must reproduce bit for bit."""
    return {k: v for k, v in step_metrics.items() if k != "grad_reduce_s"}
