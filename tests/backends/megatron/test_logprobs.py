"""Vocab-parallel logprobs/entropy on one rank: values and gradients vs torch's log_softmax through
autograd, padded vocabulary columns excluded, temperature, token alignment. (Across TP ranks the
same function is checked by test_parity and test_train_step.)"""

from __future__ import annotations

import pytest
import torch

from hybridrl.backends.megatron.logprobs import next_token_targets, token_aligned, vocab_parallel_logprobs
from hybridrl.backends.megatron.schedule import check_sequence_batch, micro_batches
from hybridrl.data.batch import Batch


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_autograd_reference(temperature):
    torch.manual_seed(0)
    vocab, padded = 37, 40                                  # 3 padding columns, as Megatron pads
    logits = (3 * torch.randn(2, 5, padded, dtype=torch.float64)).float()
    logits[..., vocab:] = 50.0                               # huge: would dominate if not excluded
    targets = torch.randint(0, vocab, (2, 5))
    w_lp, w_ent = torch.randn(2, 5), torch.randn(2, 5)

    mine = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(mine, targets, vocab_start=0, vocab_size=vocab, temperature=temperature,
                                      with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    ref = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(ref[..., :vocab] / temperature, dim=-1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.allclose(mine.grad, ref.grad, atol=1e-5)
    assert torch.count_nonzero(mine.grad[..., vocab:]) == 0


def test_entropy_off_returns_none_and_still_differentiates():
    logits = torch.randn(3, 4, 16, requires_grad=True)
    targets = torch.randint(0, 16, (3, 4))
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=16)
    assert ent is None
    lp.sum().backward()
    expected = torch.nn.functional.one_hot(targets, 16) - torch.softmax(logits.detach(), -1)
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_token_alignment_first_position_and_padding_are_zero():
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert next_token_targets(ids).tolist() == [[6, 7, 8, 8], [2, 0, 0, 0]]
    per_next = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    assert token_aligned(per_next, mask).tolist() == [[0.0, 1.0, 2.0, 3.0], [0.0, 5.0, 0.0, 0.0]]


def test_micro_batches_cut_each_to_its_longest_sequence():
    ids = torch.arange(24).view(4, 6)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]])
    batch = Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.float(), "adv": torch.ones(4)})
    mbs = micro_batches(batch, 2, torch.device("cpu"))
    assert [mb.shape for mb in mbs] == [(2, 3), (2, 6)]
    assert mbs[0].batch["loss_mask"].shape == (2, 3) and mbs[0].batch["adv"].shape == (2,)
    assert mbs[0].causal_mask[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]


@pytest.mark.parametrize("tensors,match", [
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, "needs 'attention_mask'"),
    ({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}, "integer"),
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])},
     "right padding"),
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 0, 1], [1, 1, 1]])},
     "right-padded"),
])
def test_bad_batches_are_named(tensors, match):
    with pytest.raises((KeyError, ValueError), match=match):
        check_sequence_batch(Batch(tensors))
