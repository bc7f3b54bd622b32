"""`rollout.native.release_weights`: the engine frees its weights while the trainer trains and takes a whole
publication on return; the memory goes back to the OS, what it serves afterwards is what it served before."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.config import ConfigError, load_config
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.native.conftest import generate_all, prompts_of
from tests.controller.test_rl_e2e import RECIPE

# ~13M parameters (53 MiB in float32): large enough that its buffer is its own mapping, which a free unmaps
SHAPE = {"hidden": 384, "layers": 6, "heads": 6, "kv_heads": 2, "intermediate": 1536}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_released_weights_go_back_to_the_os_and_a_whole_publication_serves_the_same_tokens(tiny_models,
                                                                                        make_engine):
    model = tiny_models("qwen2", **SHAPE)
    engine = make_engine(model, release_weights=True)
    assert engine.releasable_tags == {"kv_cache", "weights"}
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([5, 9, 13])
    before = generate_all(engine, prompts, greedy)
    nbytes = engine.core.weights.flat.numel() * 4

    rss = resident_bytes()
    asyncio.run(engine.sleep(engine.releasable_tags))
    assert engine.core.weights.flat.untyped_storage().nbytes() == 0 and engine.policy_version == -1
    assert rss - resident_bytes() > 0.8 * nbytes
    with pytest.raises(RuntimeError, match="released"):
        asyncio.run(engine.wake_up(["kv_cache"]))         # nothing to serve until a whole version arrives

    asyncio.run(engine.wake_up(["weights"]))
    with pytest.raises(RuntimeError, match="released"):
        asyncio.run(engine.wake_up(["kv_cache"]))         # allocated again, not yet published
    names = engine.weight_spec()
    tensors = load_file(str(model / "model.safetensors"))
    asyncio.run(engine.update_weights([(n, tensors[n]) for n in names], version=1))
    assert engine.policy_version == 1
    asyncio.run(engine.wake_up(["kv_cache"]))
    after = generate_all(engine, prompts, greedy, tag="again")
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.logprobs for o in after] == [o.logprobs for o in before]
    assert all(o.policy_version == 1 for o in after)


def test_an_engine_without_the_knob_keeps_its_weights(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"))
    assert engine.releasable_tags == {"kv_cache"}
    with pytest.raises(ValueError, match="cannot release"):
        asyncio.run(engine.sleep(["kv_cache", "weights"]))


def test_weights_are_released_only_after_the_kv_cache(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"), release_weights=True)
    with pytest.raises(RuntimeError, match="KV cache"):
        asyncio.run(engine.sleep(["weights"]))
    assert engine.core.weights.flat.untyped_storage().nbytes() > 0 and engine.policy_version == 0


DISAGGREGATED = ["placement.mode=disaggregated", "placement.rollout_ranks=1", "algo.max_policy_lag=1"]


@pytest.mark.parametrize("overrides,why", [
    (["train.lora.rank=4"], "LoRA"),
    (DISAGGREGATED, "never trains"),
])
def test_the_knob_is_refused_at_load_where_nothing_could_publish_the_weights_back(overrides, why):
    with pytest.raises(ConfigError) as err:
        load_config(str(RECIPE), ["model.path=/m", "rollout.native.release_weights=true", *overrides])
    assert "rollout.native.release_weights" in str(err.value) and why in str(err.value)
    load_config(str(RECIPE), ["model.path=/m", *overrides])      # the same run without it loads


def test_an_engine_serving_a_lenders_tensors_in_place_follows_them_and_frees_its_own(tiny_models, make_engine):
    """`share_weights`: what a colocated trainer lends (here a second copy of the model laid out like the
    engine, less q/k/v, as Megatron's fused q/k/v is not) is served in place; the engine keeps only the rest."""
    from hybridrl.backends.native.weights import ModelWeights, hf_views, load_checkpoint

    model = tiny_models("qwen2", **SHAPE)
    engine = make_engine(model)
    core = engine.core
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([5, 9, 13])
    before = generate_all(engine, prompts, greedy)

    lender = ModelWeights.empty(core.spec, dtype=torch.float32, device=torch.device("cpu"))
    lent = hf_views(lender, core.spec)
    load_checkpoint(model, lent, core.spec)
    lent = {n: t for n, t in lent.items() if not n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                             "q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    total = core.weights.flat.numel() * 4
    rss = resident_bytes()
    shared = asyncio.run(engine.share_weights(lent))
    own = core.weights.flat.numel() * 4
    assert shared + own == total and own == sum(l.qkv.numel() + l.qkv_bias.numel() for l in core.weights.layers) * 4
    assert rss - resident_bytes() > 0.8 * shared                     # the engine's own copy of them is gone
    lo, hi = lender.flat.data_ptr(), lender.flat.data_ptr() + total
    assert all(lo <= core.views[n].data_ptr() < hi for n in lent)   # served from the lender's memory
    after = generate_all(engine, prompts, greedy, tag="shared")
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.logprobs for o in after] == [o.logprobs for o in before]

    with torch.no_grad():                                            # the lender's update is what is served
        lender.layers[0].down.mul_(3.0)
    asyncio.run(engine.sleep())                                      # as between two modes: no stale prefix KV
    asyncio.run(engine.wake_up())
    reference = make_engine(model)
    asyncio.run(reference.update_weights([(n, t) for n, t in hf_views(lender, core.spec).items()], version=1))
    moved = generate_all(engine, prompts, greedy, tag="moved")
    assert [o.logprobs for o in moved] == [o.logprobs for o in generate_all(reference, prompts, greedy)]
    assert [o.logprobs for o in moved] != [o.logprobs for o in before]

    # lent again from elsewhere (a trainer that re-allocated its parameters): the engine follows the new storage
    again = ModelWeights.empty(core.spec, dtype=torch.float32, device=torch.device("cpu"))
    load_checkpoint(model, hf_views(again, core.spec), core.spec)
    assert asyncio.run(engine.share_weights({n: v for n, v in hf_views(again, core.spec).items() if n in lent})) == shared
    lo = again.flat.data_ptr()
    assert all(lo <= core.views[n].data_ptr() < lo + total for n in lent)
    assert core.weights.flat.numel() * 4 == own
    asyncio.run(engine.sleep())
    asyncio.run(engine.wake_up())
    assert [o.logprobs for o in generate_all(engine, prompts, greedy, tag="again")] == [o.logprobs for o in before]


def test_q_k_v_lent_per_kv_group_are_served_in_place_in_that_layout(tiny_models, make_engine):
    """A lender whose fused q/k/v rows run per KV group (Megatron's linear_qkv: each group's query heads, key
    head, value head) lends them as views in that order (`ModelSpec.qkv_by_group`): the engine serves every
    tensor in place, q/k/v included, reorders its product's columns, and still takes HF-shaped updates
    (copied into the lender's layout, read back against the sender's digests)."""
    from hybridrl.backends.native.weights import ModelWeights, hf_views
    from hybridrl.publication.digest import tensor_digests

    model = tiny_models("qwen2", **SHAPE)
    engine = make_engine(model)
    core = engine.core
    spec = core.spec
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([5, 9, 13, 40])
    before = generate_all(engine, prompts, greedy)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    before_sampled = generate_all(engine, prompts, sampled, tag="s")

    lender = ModelWeights.empty(spec, dtype=torch.float32, device=torch.device("cpu"))
    lender.qkv_groups = spec.num_kv_heads             # its q/k/v rows per group, as Megatron lays them out
    lent = hf_views(lender, spec)
    assert lent["model.layers.0.self_attn.q_proj.weight"].shape == (2, 3 * spec.head_dim, spec.hidden_size)
    hf = load_file(str(model / "model.safetensors"))
    with torch.no_grad():
        for name, view in lent.items():
            view.copy_(hf[name].view(view.shape))
    total = core.weights.flat.numel() * 4
    assert asyncio.run(engine.share_weights(lent)) == total      # every tensor, q/k/v included
    assert core.weights.flat.numel() == 0 and core.weights.qkv_groups == spec.num_kv_heads
    layer = lender.layers[1]
    assert core.weights.layers[1].qkv.data_ptr() == layer.qkv.data_ptr()
    assert core.weight_spec()["model.layers.1.self_attn.q_proj.weight"] == ((spec.q_size, spec.hidden_size),
                                                                          torch.float32)
    after = generate_all(engine, prompts, greedy, tag="shared")
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert torch.allclose(torch.tensor([o.logprobs for o in after]), torch.tensor([o.logprobs for o in before]),
                          atol=1e-5, rtol=0)
    assert ([o.token_ids for o in generate_all(engine, prompts, sampled, tag="s2")]
            == [o.token_ids for o in before_sampled])

    # an HF-shaped update lands in the lender's layout and reads back against the sender's digests
    k_name, bias_name = "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.bias"
    new_k, new_bias = hf[k_name] * 2.0, hf[bias_name] - 1.0
    asyncio.run(engine.sleep())
    asyncio.run(engine.wake_up())
    update = [(n, {k_name: new_k, bias_name: new_bias}.get(n, t)) for n, t in hf.items()]    # a whole version
    asyncio.run(engine.update_weights(update, version=1, digests=tensor_digests(update)))
    assert engine.policy_version == 1
    rows = spec.heads_per_group * spec.head_dim
    grouped = layer.qkv.view(spec.num_kv_heads, rows + 2 * spec.head_dim, -1)
    assert torch.equal(grouped[:, rows: rows + spec.head_dim].reshape(new_k.shape), new_k)
    assert torch.equal(layer.qkv_bias.view(spec.num_kv_heads, -1)[:, rows + spec.head_dim:].reshape(-1), new_bias)
    assert torch.equal(core.held_tensor(k_name), new_k)

    reference = make_engine(model)                    # its own [q; k; v] storage, the same update
    asyncio.run(reference.update_weights(update, version=1))
    changed = generate_all(engine, prompts, greedy, tag="changed")
    assert [o.token_ids for o in changed] == [o.token_ids for o in generate_all(reference, prompts, greedy, tag="ref")]


@pytest.mark.parametrize("overrides,why", [
    (["train.lora.rank=4"], "train.lora.rank=0"),
    (DISAGGREGATED, "placement.mode=colocated"),
    (["train.tp=2"], "tp=2"),
    (["rollout.native.dtype=bfloat16"], "dtype=bfloat16"),
    (["rollout.native.release_weights=true"], "release_weights=false"),
])
def test_serving_the_trainers_parameters_is_refused_where_it_cannot_apply_and_auto_copies_there(overrides, why):
    from hybridrl.backends.native.config import shares_trainer_weights

    with pytest.raises(ConfigError) as err:
        load_config(str(RECIPE), ["model.path=/m", "rollout.native.trainer_weights=share", *overrides])
    assert "rollout.native.trainer_weights" in str(err.value) and why in str(err.value)
    if "release_weights" not in why:                    # auto never refuses; it shares where it applies
        assert not shares_trainer_weights(load_config(str(RECIPE), ["model.path=/m",
                                                                   "rollout.native.trainer_weights=auto", *overrides]))
    assert shares_trainer_weights(load_config(str(RECIPE), ["model.path=/m", "rollout.native.trainer_weights=auto"]))
