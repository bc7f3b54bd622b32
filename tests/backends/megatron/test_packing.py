"""Sequence packing (`train.max_tokens_per_micro_batch`) with real ranks: packed micro-batches
(with logprobs in chunks of 5 tokens) and padded ones give the same logprobs, losses, gradient
norms and updated weights (two steps) at DP 2, TP 2 and PP 2 (one torchrun launch), and the
packed logprobs match transformers. On one
rank: how rows are packed, and attention that stays inside each sequence."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.backends.megatron.schedule import micro_batches, pack_rows
from hybridrl.data.batch import Batch
from tests.backends.megatron.conftest import run_job
from tests.backends.megatron.reference import assert_same_weights

LR = 1e-4          # see test_train_step: the 1e-5 bound holds at this rate
TOL = 1e-5
MAX_TOKENS = 20    # the test batch's lengths (12, 7, 3, 12, 9, 5, 11) make 2-3 rows per pack

STEPS = 2          # optimizer steps before the weights are compared


@pytest.fixture(scope="module")
def runs(tmp_path_factory, qwen2_dir):
    out = tmp_path_factory.mktemp("packed")
    run_job(2, "packed", out, qwen2_dir, LR, MAX_TOKENS)
    return out, json.loads((out / "packed_w2.json").read_text())


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_packed_equals_padded(runs, layout):
    out, results = runs
    padded, packed = results[layout]["padded"], results[layout]["packed"]
    for a, b in zip(padded, packed):                          # per rank
        assert max(b["rows_per_micro_batch"]) >= 2 and set(b["model_rows"]) == {1}, b    # packing did pack
        for step_a, step_b in zip(a["steps"], b["steps"]):
            assert abs(step_a["loss"] - step_b["loss"]) < TOL, (layout, step_a, step_b)
            assert abs(step_a["grad_norm"] - step_b["grad_norm"]) < TOL * step_a["grad_norm"], layout
            assert step_a["num_tokens"] == step_b["num_tokens"] and step_a["num_sequences"] == step_b["num_sequences"]
        if "logprobs_vs_hf" in b:
            assert b["logprobs_vs_hf"] < 1e-4 and b["entropy_vs_hf"] < 1e-4, b
            assert a["logprobs_vs_hf"] < 1e-4, a
    w_a, w_b = (torch.load(out / f"weights_{layout}_{m}.pt") for m in ("padded", "packed"))
    assert_same_weights(w_a, w_b, layout, lr=LR, steps=STEPS)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_shared_prefix_equals_padded(runs, layout):
    """Packs whose rows share their common prefixes (`share_prefix`) run fewer tokens and give the
    padded micro-batches' losses, gradient norms, logprobs (and transformers') and weights."""
    out, results = runs
    padded, packed, shared = (results[layout][m] for m in ("padded", "packed", "shared"))
    for a, p, b in zip(padded, packed, shared):                 # per rank
        assert b["real_tokens"] == p["real_tokens"] and b["model_tokens"] < p["model_tokens"], (p, b)
        for step_a, step_b in zip(a["steps"], b["steps"]):
            assert abs(step_a["loss"] - step_b["loss"]) < TOL, (layout, step_a, step_b)
            assert abs(step_a["grad_norm"] - step_b["grad_norm"]) < TOL * step_a["grad_norm"], layout
            assert step_a["num_tokens"] == step_b["num_tokens"] and step_a["num_sequences"] == step_b["num_sequences"]
        if "logprobs_vs_hf" in b:
            assert b["logprobs_vs_hf"] < 1e-4 and b["entropy_vs_hf"] < 1e-4, b
    for rank in range(2):
        name = f"logprobs_{layout}_{{}}_rank{rank}.pt"
        if (out / name.format("shared")).exists():
            a, b = (torch.load(out / name.format(m)) for m in ("padded", "shared"))
            assert (a - b).abs().max() < 1e-5, layout
    w_a, w_b = (torch.load(out / f"weights_{layout}_{m}.pt") for m in ("padded", "shared"))
    assert_same_weights(w_a, w_b, layout, lr=LR, steps=STEPS)


def test_layouts_agree_with_each_other(runs):
    out, results = runs
    base = torch.load(out / "weights_dp2_packed.pt")
    for layout in ("tp2", "pp2"):
        w = torch.load(out / f"weights_{layout}_packed.pt")
        assert_same_weights(w, base, layout, lr=LR, steps=STEPS)
        first = [r["steps"][0]["loss"] for r in results[layout]["packed"]]
        assert abs(first[0] - results["dp2"]["packed"][0]["steps"][0]["loss"]) < TOL


def test_pack_rows_first_fit_longest_first():
    assert pack_rows([12, 7, 3, 12, 9, 5, 11, 2], 20) == [[0, 1], [3, 5, 2], [6, 4], [7]]
    # a row longer than the budget gets a pack of its own; nothing is dropped
    packs = pack_rows([30, 4, 4], 10)
    assert packs == [[0], [1, 2]]
    assert sorted(i for p in pack_rows([5, 1, 9, 3, 3, 8], 9) for i in p) == list(range(6))


def test_packed_micro_batch_layout():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    mask = (torch.arange(4) < torch.tensor([[3], [2], [4]])).long()
    batch = Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.float()})
    [mb] = micro_batches(batch, 1, torch.device("cpu"), max_tokens=9)
    assert mb.rows == [2, 0, 1] and mb.shape == (3, 4) and mb.model_shape == (1, 9)
    assert mb.input_ids.tolist() == [[6, 7, 8, 9, 1, 2, 3, 4, 5]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]      # restart per sequence
    assert mb.packed.cu_seqlens_q.tolist() == [0, 4, 7, 9]
    values = torch.arange(9.0).view(1, 9)
    assert mb.to_rows(values).tolist() == [[0, 1, 2, 3], [4, 5, 6, 0], [7, 8, 0, 0]]
    assert mb.batch["input_ids"].tolist() == [[6, 7, 8, 9], [1, 2, 3, 0], [4, 5, 0, 0]]


def test_packed_attention_stays_inside_each_sequence(monkeypatch):
    """SDPAttention on a pack equals causal attention run on each sequence alone, and changing
    one sequence's keys leaves the other sequences' outputs unchanged."""
    import torch.nn.functional as F

    from hybridrl.backends.megatron.attention import SDPAttention
    from hybridrl.backends.megatron.schedule import _packed_params

    lengths = [9, 4, 8, 1, 3]
    params = _packed_params(lengths, torch.device("cpu"))
    assert len(params.groups) > 1                                # several attention groups
    attn = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(attn)
    attn.heads, attn.groups, attn.head_dim, attn.scale, attn.dropout = 4, 2, 8, 8 ** -0.5, 0.0
    torch.manual_seed(0)
    t = sum(lengths)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    out = attn(q, k, v, None, packed_seq_params=params)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        kk, vv = (x[sl].repeat_interleave(2, dim=1).permute(1, 0, 2) for x in (k, v))
        want = F.scaled_dot_product_attention(q[sl].permute(1, 0, 2), kk, vv, is_causal=True, scale=8 ** -0.5)
        assert torch.allclose(out[sl], want.permute(1, 0, 2).reshape(n, 32), atol=1e-6)
        start += n
    k2 = k.clone()
    k2[:9] += 5.0                                                 # disturb the first sequence only
    out2 = attn(q, k2, v, None, packed_seq_params=params)
    assert not torch.allclose(out2[:9], out[:9])
    assert torch.equal(out2[9:], out[9:])


def test_bfloat16_attention_on_a_cpu_is_computed_in_float32_with_gradients():
    """On a CPU, a bfloat16 model's attention runs in float32 (torch's bfloat16 CPU kernel is the slower one):
    the output is bfloat16, the float32 result rounded once, and the gradients reach q, k and v in bfloat16."""
    import torch.nn.functional as F

    from hybridrl.backends.megatron.attention import SDPAttention

    attn = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(attn)
    attn.heads, attn.groups, attn.head_dim, attn.scale, attn.dropout = 4, 2, 8, 8 ** -0.5, 0.0
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 5, 8, generator=gen).bfloat16().requires_grad_() for n in (4, 2, 2))
    out = attn._sdpa(q, k, v)
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
                                          is_causal=True, scale=8 ** -0.5)
    assert out.dtype is torch.bfloat16 and torch.equal(out, want.bfloat16())
    out.float().square().sum().backward()
    assert all(x.grad is not None and x.grad.dtype is torch.bfloat16 and x.grad.abs().sum() > 0 for x in (q, k, v))


def _rows_batch(seqs):
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.float()})


SHARED_ROWS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 3, 7, 7, 7, 7], [8, 8], [1, 2, 3, 4, 5, 6, 1]]


def test_prefix_units_pick_the_largest_saving():
    from hybridrl.backends.megatron.schedule import prefix_units

    units = [(u.rows, u.shared) for u in prefix_units(SHARED_ROWS, 100)]
    # {0, 4} share 5 tokens and {1, 2} 2 (7 saved), better than {0, 1, 4} sharing 3 (6 saved)
    assert units == [([0, 4], 5), ([1, 2], 2), ([3], 0)]
    # the last common token stays with every row: identical rows share all but it
    assert [(u.rows, u.shared) for u in prefix_units([[5, 6, 7], [5, 6, 7]], 100)] == [([0, 1], 2)]
    # a unit never exceeds the budget: at 10 tokens {0, 4} (13 - 5 = 8) fits, {1, 2} (12 - 2) too
    assert all(u.cost([len(s) for s in SHARED_ROWS]) <= 10 for u in prefix_units(SHARED_ROWS, 10))
    assert [u.shared for u in prefix_units(SHARED_ROWS, 7)] == [0] * 5


def test_shared_prefix_layout():
    [mb] = micro_batches(_rows_batch(SHARED_ROWS), 1, torch.device("cpu"), max_tokens=100, share_prefix=True)
    assert mb.rows == [1, 2, 0, 4, 3] and mb.model_shape == (1, 20)            # 27 real tokens
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 9, 3, 7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 6, 1, 8, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 5, 6, 0, 1]]
    assert mb.packed.cu_seqlens_q.tolist() == [0, 2, 5, 10, 15, 16, 18, 20]
    assert torch.equal(mb.packed.positions, mb.position_ids[0])
    # every row reads back its own tokens; each pack position's next token is every reader's next token
    assert mb.to_rows(mb.input_ids.unsqueeze(-1))[..., 0].tolist() == mb.batch["input_ids"].tolist()
    targets = mb.to_rows(mb.next_token_targets().unsqueeze(-1))[..., 0]
    for r, n in enumerate(mb.attention_mask.sum(dim=1).tolist()):
        assert targets[r, :n - 1].tolist() == mb.batch["input_ids"][r, 1:n].tolist()
    unshared = micro_batches(_rows_batch(SHARED_ROWS), 1, torch.device("cpu"), max_tokens=100)
    assert unshared[0].packed.positions is None and unshared[0].model_shape == (1, 27)


def test_shared_prefix_attention_equals_each_row_alone():
    """SDPAttention on a shared-prefix pack: every row's tokens get the causal attention of the row
    run alone (its keys: the shared prefix's, then its own)."""
    import torch.nn.functional as F

    from hybridrl.backends.megatron.attention import SDPAttention

    [mb] = micro_batches(_rows_batch(SHARED_ROWS), 1, torch.device("cpu"), max_tokens=100, share_prefix=True)
    attn = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(attn)
    attn.heads, attn.groups, attn.head_dim, attn.scale, attn.dropout = 4, 2, 8, 8 ** -0.5, 0.0
    torch.manual_seed(0)
    table = torch.randn(10, 8, 4, 24)              # q/k/v of a (token, position): shared positions agree
    qkv = table[mb.input_ids[0], mb.position_ids[0]]
    out = attn(qkv[..., :8], qkv[:, :2, 8:16], qkv[:, :2, 16:], None, packed_seq_params=mb.packed)
    for r, n in enumerate(mb.attention_mask.sum(dim=1).tolist()):
        e = table[mb.batch["input_ids"][r, :n], torch.arange(n)]
        k, v = (x.repeat_interleave(2, dim=1).permute(1, 0, 2) for x in (e[:, :2, 8:16], e[:, :2, 16:]))
        want = F.scaled_dot_product_attention(e[..., :8].permute(1, 0, 2), k, v, is_causal=True, scale=8 ** -0.5)
        got = out[mb.packed.unpack[r, :n]]
        assert torch.allclose(got, want.permute(1, 0, 2).reshape(n, 32), atol=1e-6), r


def test_share_prefix_needs_packing():
    from hybridrl.backends.megatron import MegatronConfig
    from hybridrl.config.fields import ConfigValueError

    with pytest.raises(ConfigValueError, match="max_tokens_per_micro_batch"):
        MegatronConfig(share_prefix=True)
    MegatronConfig(share_prefix=True, max_tokens_per_micro_batch=64)
