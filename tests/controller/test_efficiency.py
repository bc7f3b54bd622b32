"""The efficiency metrics (hybridrl/controller/efficiency.py), each against an independent computation on
a tiny case: the FLOP count against torch's own FLOP counter on the HF model (a forward and a backward),
the matmul parameters against the model's linear layers, MFU, the prefix hit rate, successes per hour /
device-hour / money against the shipped price table, and the gradient-reduction timer."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from hybridrl.controller.efficiency import (Efficiency, model_shape, mfu, peak_flops, prefix_hit_rate,
                                             success_rates, train_flops)

TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 576,
        "tie_word_embeddings": True, "max_position_embeddings": 256}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 24, "intermediate_size": 48, "decoder_sparse_step": 1,
       "mlp_only_layers": [], "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_hf():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", **{k: v for k, v in TINY.items() if k != "model_type"})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def test_matmul_parameters_are_the_models_linear_layers(tiny_hf):
    shape = model_shape(TINY)
    # by hand: per layer q, o 64x64, k, v 64x32, gate/up/down 3x64x128; the (tied) head 64x576
    assert shape.matmul_params == 2 * (2 * 4096 + 2 * 2048 + 3 * 64 * 128) + 64 * 576 == 110592
    linear = sum(m.weight.numel() for m in tiny_hf.modules() if isinstance(m, torch.nn.Linear))
    assert shape.matmul_params == linear


def test_train_flops_match_torchs_flop_counter_on_a_forward_and_backward(tiny_hf):
    from torch.utils.flop_counter import FlopCounterMode

    length = 33
    ids = torch.randint(0, TINY["vocab_size"], (1, length))
    with FlopCounterMode(display=False) as counter:
        tiny_hf(input_ids=ids).logits.float().sum().backward()
    assert train_flops(model_shape(TINY), [length]) == pytest.approx(counter.get_total_flops(), rel=0.01)
    # two passes over two rows: the sum, twice
    assert train_flops(model_shape(TINY), [length, 5], passes=2) == 2 * (
        train_flops(model_shape(TINY), [length]) + train_flops(model_shape(TINY), [5]))


def test_moe_flops_count_the_routed_experts_only():
    shape = model_shape(MOE)
    # by hand, per layer: q, o 32x64, k, v 32x32; 2 routed experts of 3x32x24; the router 32x4. Head 32x128
    per_layer = 2 * 32 * 64 + 2 * 32 * 32 + 2 * 3 * 32 * 24 + 32 * 4
    assert shape.matmul_params == 2 * per_layer + 32 * 128 == 25856
    assert train_flops(shape, [16]) == 6 * 25856 * 16 + 12 * 2 * 64 * 16 ** 2


def test_mfu_and_peak():
    assert mfu(4e12, 2.0, 1e12, 2) == 1.0 and mfu(1e12, 0.0, 1e12, 1) == 0.0
    assert peak_flops(5e12, "cpu") == (5e12, "trainer.peak_flops")
    measured, source = peak_flops(0.0, "cpu")
    assert measured > 1e6 and source == "measured float32 matmul"


def test_prefix_hit_rate_is_hits_over_prompt_tokens():
    assert prefix_hit_rate({"engine/prefix_hit_tokens": 300.0, "engine/prefill_tokens": 100.0}) == 0.75
    assert prefix_hit_rate({"engine/prefix_hit_tokens": 0.0, "engine/prefill_tokens": 0.0}) is None
    assert prefix_hit_rate({}) is None


def test_successes_per_hour_device_hour_and_money_use_the_cost_price_table():
    from hybridrl.cost.prices import load_prices

    cpu_hour = load_prices().device_rate("cpu")
    rates = success_rates(12, 36.0, 2, cpu_hour)
    assert rates["success/per_hour"] == pytest.approx(12 / 0.01)
    assert rates["success/per_device_hour"] == pytest.approx(12 / 0.02)
    assert rates["success/per_usd"] == pytest.approx(12 / (0.02 * cpu_hour))
    assert "success/per_usd" not in success_rates(12, 36.0, 2, None) and success_rates(1, 0.0, 2, 1.0) == {}


def test_a_step_reports_checkpoint_and_communication_time_and_the_run_rate():
    eff = Efficiency(model_shape(TINY), peak=1e9, train_devices=2, devices=2, device_hour=None)
    step = {"time/T_train": 0.5, "time/grad_reduce_s": 0.02, "switch/publish_s": 0.01, "episodes/succeeded": 3.0,
            "time/step_s": 1.8, "train/updated": 1.0}
    first = eff.measured(step, [10, 20])
    assert first["time/T_checkpoint"] == 0.0 and first["time/T_comm"] == pytest.approx(0.03)
    assert first["perf/train_flops"] == train_flops(model_shape(TINY), [10, 20])
    assert first["perf/mfu"] == pytest.approx(first["perf/train_flops"] / (0.5 * 1e9 * 2))
    eff.checkpointed(0.25)                             # the checkpoint after the first step's row
    second = eff.measured({**step, "episodes/succeeded": 1.0, "train/updated": 0.0}, [10])
    assert second["time/T_checkpoint"] == 0.25 and "perf/mfu" not in second     # no update: no MFU
    assert second["success/run_per_hour"] == pytest.approx(4 / (3.6 / 3600))
    assert eff.measured(step, [])["time/T_checkpoint"] == 0.0


def test_a_batch_gives_its_rows_lengths():
    eff = Efficiency(model_shape(TINY), peak=1e9, train_devices=1, devices=1, device_hour=None)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    out = eff.step({"time/T_train": 1.0}, {"attention_mask": mask})
    assert out["perf/train_flops"] == train_flops(model_shape(TINY), [3, 4])


def test_the_gradient_reduction_is_timed_and_put_back():
    from hybridrl.backends.megatron.step import timed_grad_reduce

    calls = []
    config = SimpleNamespace(finalize_model_grads_func=lambda *a, **k: (calls.append(a), time.sleep(0.05)))
    original = config.finalize_model_grads_func
    into: dict = {}
    with timed_grad_reduce(config, torch.device("cpu"), into):
        config.finalize_model_grads_func([1])
        config.finalize_model_grads_func([2])
    assert calls == [([1],), ([2],)] and into["seconds"] >= 0.1
    assert config.finalize_model_grads_func is original


def test_the_tiny_model_config_on_disk_reads_the_same(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert model_shape(json.loads((tmp_path / "config.json").read_text())) == model_shape(TINY)
