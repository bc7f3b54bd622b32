"""Family adapters without any process group: layouts checked against hand-built tensors, and
HF -> per-TP-rank shards -> HF bitwise for both families and several TP sizes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen2Config

from hybridrl.backends.megatron.adapters import LlamaAdapter, Qwen2Adapter, Role, Split, adapter_for
from hybridrl.backends.model_spec import ModelSpec


def _spec_config(**kw):
    base = dict(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=12, max_position_embeddings=64)
    base.update(kw)
    return base


@pytest.mark.parametrize("family,tp", [("qwen2", 1), ("qwen2", 2), ("llama", 1), ("llama", 2)])
def test_round_trip_through_tp_shards_is_bitwise(tiny_models, family, tp):
    path = tiny_models(family, init_std=0.1)
    hf = load_file(str(path / "model.safetensors"))
    adapter = adapter_for(ModelSpec.from_dir(path), tp=tp)
    shards = [adapter.shard_state_dict(hf, rank) for rank in range(tp)]
    back = adapter.merge_state_dicts(shards)
    assert sorted(back) == sorted(hf) == adapter.hf_names()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
        assert tuple(tensor.shape) == adapter.hf_shapes()[name]


def test_qkv_fused_per_query_group_and_split_by_whole_groups():
    adapter = Qwen2Adapter(ModelSpec.from_hf_config(Qwen2Config(**_spec_config())), tp=2)
    s = adapter.spec                                           # 4 heads, 2 KV groups, head_dim 2
    q = torch.arange(s.num_heads * s.head_dim * 1.0).unsqueeze(1) * torch.ones(1, 8)
    k = 100 + torch.arange(s.num_kv_heads * s.head_dim * 1.0).unsqueeze(1) * torch.ones(1, 8)
    v = 200 + torch.arange(s.num_kv_heads * s.head_dim * 1.0).unsqueeze(1) * torch.ones(1, 8)
    slot = next(x for x in adapter.layer_slots(0) if x.role is Role.QKV_WEIGHT)
    hf = dict(zip(slot.hf_names, (q, k, v)))
    rank0 = adapter.from_hf(slot, hf, 0)[:, 0].tolist()
    rank1 = adapter.from_hf(slot, hf, 1)[:, 0].tolist()
    # group 0: query heads 0-1 (rows 0-3), key head 0, value head 0; group 1 on TP rank 1
    assert rank0 == [0, 1, 2, 3, 100, 101, 200, 201]
    assert rank1 == [4, 5, 6, 7, 102, 103, 202, 203]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_lent_qkv_views_are_the_fused_parameter_holding_the_hf_tensors_in_order(kv_heads):
    """`lendable_views` lends the fused q/k/v as views of the parameter itself ([groups, rows per group,
    *rest]; with one group in the HF shape): reshaped to the HF shape each is the HF tensor, and a publication
    un-fusing the parameter onto those views (`write_hf`) leaves the parameter as it was."""
    from hybridrl.backends.megatron.weights import lendable_views

    adapter = Qwen2Adapter(ModelSpec.from_hf_config(Qwen2Config(**_spec_config(num_key_value_heads=kv_heads))))
    s = adapter.spec
    slots = [x for x in adapter.layer_slots(0) if x.role in (Role.QKV_WEIGHT, Role.QKV_BIAS)]
    g = torch.Generator().manual_seed(0)
    params = {}
    for slot in slots:
        hf = {n: torch.randn(shape, generator=g) for n, shape in adapter.hf_shapes().items() if n in slot.hf_names}
        params[slot] = torch.nn.Parameter(adapter.from_hf(slot, hf, 0))
        lent = lendable_views(adapter, {slot: params[slot]})
        before = params[slot].detach().clone()
        for name in slot.hf_names:
            view = lent[name]
            assert view.untyped_storage().data_ptr() == params[slot].untyped_storage().data_ptr()
            assert torch.equal(view.reshape(hf[name].shape), hf[name]), name
            if kv_heads == 1:
                assert view.shape == hf[name].shape
            else:
                assert view.dim() == hf[name].dim() + 1 and view.shape[0] == s.num_kv_heads
        adapter.write_hf(slot, [params[slot].detach()], lent)
        assert torch.equal(params[slot].detach(), before)


def test_fc1_is_gate_then_up_per_tp_rank():
    adapter = LlamaAdapter(ModelSpec.from_hf_config(LlamaConfig(**_spec_config())), tp=2)
    gate = torch.arange(12.0).unsqueeze(1).expand(12, 8)
    up = 100 + gate
    slot = next(x for x in adapter.layer_slots(1) if x.role is Role.FC1_WEIGHT)
    hf = dict(zip(slot.hf_names, (gate, up)))
    assert adapter.from_hf(slot, hf, 1)[:, 0].tolist() == [6, 7, 8, 9, 10, 11, 106, 107, 108, 109, 110, 111]
    # naive concatenation of the two ranks' shards would not give [gate; up]
    merged = adapter.to_hf(slot, [adapter.from_hf(slot, hf, r) for r in range(2)])
    assert torch.equal(merged[slot.hf_names[0]], gate) and torch.equal(merged[slot.hf_names[1]], up)


def test_vocab_padded_with_zero_rows_and_cut_on_export():
    adapter = LlamaAdapter(ModelSpec.from_hf_config(LlamaConfig(**_spec_config(vocab_size=100))), tp=2,
                           vocab_divisible_by=8)
    assert adapter.padded_vocab_size == 112                 # multiple of 8 * tp
    emb = torch.randn(100, 8)
    slot = adapter.slots()[0]
    assert slot.role is Role.EMBEDDING and slot.split is Split.VOCAB
    shards = [adapter.from_hf(slot, {slot.hf_names[0]: emb}, r) for r in range(2)]
    assert [tuple(x.shape) for x in shards] == [(56, 8), (56, 8)]
    assert torch.count_nonzero(shards[1][44:]) == 0          # rows 100..111 are padding
    assert torch.equal(adapter.to_hf(slot, shards)[slot.hf_names[0]], emb)


def test_tied_and_untied_output_slots():
    tied = Qwen2Adapter(ModelSpec.from_hf_config(Qwen2Config(**_spec_config(), tie_word_embeddings=True)))
    untied = LlamaAdapter(ModelSpec.from_hf_config(LlamaConfig(**_spec_config())))
    out_tied = [s for s in tied.slots() if s.role is Role.OUTPUT][0]
    assert not out_tied.exported and out_tied.hf_names == ("model.embed_tokens.weight",)
    assert "lm_head.weight" not in tied.hf_names() and "lm_head.weight" in untied.hf_names()
    assert any(s.role is Role.QKV_BIAS for s in tied.slots())          # qwen2: q/k/v biases
    assert not any(s.role is Role.QKV_BIAS for s in untied.slots())


def test_rope_base_and_norm_eps_come_from_the_config():
    spec = adapter_for(Qwen2Config(**_spec_config(), rope_theta=12345.0, rms_norm_eps=1e-3)).spec
    assert spec.rope_theta == 12345.0 and spec.rms_norm_eps == 1e-3


@pytest.mark.parametrize("make,match", [
    (lambda: adapter_for(Qwen2Config(**_spec_config()), tp=4), "must divide the number of KV heads"),
    (lambda: adapter_for(LlamaConfig(**_spec_config(), attention_bias=True)), "attention_bias"),
    (lambda: adapter_for(LlamaConfig(**_spec_config(), hidden_act="gelu")), "hidden_act"),
    (lambda: adapter_for(LlamaConfig(**_spec_config(), rope_scaling={"rope_type": "yarn", "factor": 2.0})),
     "rope_type='yarn'"),
    (lambda: adapter_for(Qwen2Config(**_spec_config(), use_sliding_window=True)), "sliding"),
    (lambda: adapter_for({"model_type": "gpt2"}), "model_type='gpt2': hybridrl implements"),
])
def test_unsupported_configs_fail_with_a_named_reason(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("family,tp", [("qwen2", 1), ("qwen2", 2), ("llama", 2)])
def test_write_hf_into_a_flat_bucket_equals_to_hf(tiny_models, family, tp):
    """What publication uses: every slot's HF tensors written (q/k/v un-fused) straight into the views of
    one flat bucket, bitwise equal to `to_hf`."""
    from hybridrl.publication.buckets import FlatBucket, plan_buckets

    path = tiny_models(family, init_std=0.1)
    hf = load_file(str(path / "model.safetensors"))
    adapter = adapter_for(ModelSpec.from_dir(path), tp=tp)
    shards = [adapter.shard_state_dict(hf, rank) for rank in range(tp)]
    slots = [s for s in adapter.slots() if s.exported]
    shapes = adapter.hf_shapes()
    plan = plan_buckets([[(n, shapes[n], torch.float32) for n in s.hf_names] for s in slots], 1 << 40)[0]
    bucket = FlatBucket(plan, torch.full((plan.nbytes,), 255, dtype=torch.uint8))
    for slot in slots:
        adapter.write_hf(slot, [shards[0][slot]] if slot.split is Split.NONE else [s[slot] for s in shards],
                         bucket.views)
    assert [e.name for e in plan.entries] == [n for s in slots for n in s.hf_names]
    for name, tensor in hf.items():
        assert torch.equal(bucket.views[name], tensor), name


@pytest.mark.parametrize("family,tp", [("qwen3", 2), ("qwen3_moe", 2)])
def test_qwen3_round_trip_keeps_qk_norms_whole_and_groups_experts(family_models, family, tp):
    path = family_models(family)
    hf = load_file(str(path / "model.safetensors"))
    adapter = adapter_for(ModelSpec.from_dir(path), tp=tp, ep=2 if family == "qwen3_moe" else 1)
    shards = [adapter.shard_state_dict(hf, rank) for rank in range(tp)]
    back = adapter.merge_state_dicts(shards)
    assert sorted(back) == sorted(hf) == adapter.hf_names()
    assert all(torch.equal(back[n], t) for n, t in hf.items())
    norms = [s for s in adapter.slots() if s.role in (Role.Q_NORM, Role.K_NORM)]
    assert len(norms) == 2 * adapter.spec.num_layers and all(s.split is Split.NONE for s in norms)
    assert all(torch.equal(shards[1][s], hf[s.hf_names[0]]) for s in norms)        # replicated, not split
    if family == "qwen3_moe":
        experts = [g for g in adapter.groups() if g[0].expert is not None]
        assert len(experts) == 2 * 8                                                # 2 sparse layers x 8
        assert all([s.role for s in g] == [Role.EXPERT_FC1, Role.EXPERT_FC2] for g in experts)
        assert [adapter.ep_owner(g[0]) for g in experts[:8]] == [0] * 4 + [1] * 4
        router = next(s for s in adapter.slots() if s.role is Role.ROUTER)
        assert router.split is Split.NONE and hf[router.hf_names[0]].shape == (8, 64)
