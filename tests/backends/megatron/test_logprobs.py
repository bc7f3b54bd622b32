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


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunks_give_the_same_values_and_gradients(with_entropy):
    torch.manual_seed(1)
    vocab, padded = 50, 56
    logits = 2 * torch.randn(3, 7, padded)
    targets = torch.randint(0, vocab, (3, 7))
    w_lp, w_ent = torch.randn(3, 7), torch.randn(3, 7)
    results = []
    for chunk in (1000, 5, 1):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(x, targets, vocab_start=0, vocab_size=vocab, temperature=0.8,
                                          with_entropy=with_entropy, chunk_tokens=chunk)
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
        loss.backward()
        results.append((lp.detach(), None if ent is None else ent.detach(), x.grad))
    for lp, ent, grad in results[1:]:
        assert torch.allclose(lp, results[0][0], atol=1e-6) and torch.allclose(grad, results[0][2], atol=1e-6)
        if with_entropy:
            assert torch.allclose(ent, results[0][1], atol=1e-6)


_PEAK_CHILD = r"""
import sys, torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from hybridrl.backends.megatron.logprobs import vocab_parallel_logprobs


class LiveTensorBytes(TorchDispatchMode):
    # bytes of every tensor storage an aten op returns, held until the storage is freed; the peak of
    # their sum is what the allocator had to hand out, independent of the OS's page accounting
    def __init__(self, exclude):
        super().__init__()
        self.exclude, self.live, self.peak = {t.untyped_storage().data_ptr() for t in exclude}, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.exclude:
                s = t.untyped_storage()
                self.live.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


tokens, vocab, chunk, with_entropy = map(int, sys.argv[1:])
torch.manual_seed(0)
logits = torch.randn(tokens, vocab).requires_grad_(True)
targets = torch.randint(0, vocab, (tokens,))
w = torch.randn(tokens)
with LiveTensorBytes(exclude=[logits, targets, w]) as live:
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=vocab, with_entropy=bool(with_entropy),
                                      chunk_tokens=chunk)
    (grad,) = torch.autograd.grad((lp * w).sum() + ((ent * w).sum() if with_entropy else 0.0), logits)
print(live.peak)
"""


def test_peak_memory_is_bounded_by_chunking_for_a_large_vocabulary(with_entropy=True):
    """Peak tensor memory above the logits (a fresh process per variant; every storage an aten op
    returns, counted until it is freed, so the figure does not depend on the OS's page accounting,
    which under memory pressure or lazily-mapped zero pages hid the unchunked copies) of forward +
    backward over 512 tokens x a 65,536-token vocabulary (128 MiB of float32 logits): chunked,
    the logits' own gradient (inherent) plus one chunk's working copies; unchunked (one chunk of
    every token), several full-vocabulary float32 tensors at once."""
    import subprocess
    import sys

    tokens, vocab = 512, 65536
    logits_bytes = tokens * vocab * 4

    def peak(chunk: int) -> int:
        proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(tokens), str(vocab), str(chunk),
                               str(int(with_entropy))], capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(proc.stdout.strip().splitlines()[-1])

    chunked, unchunked = peak(16), peak(tokens)
    # the gradient of the logits (one logits-sized tensor) is inherent; a 16-token chunk is 4 MiB
    assert chunked < 1.5 * logits_bytes, (chunked, logits_bytes)
    assert unchunked > 2.5 * logits_bytes, (unchunked, logits_bytes)
    print(f"peak above the logits: chunked {chunked / logits_bytes:.2f}x, unchunked {unchunked / logits_bytes:.2f}x")
