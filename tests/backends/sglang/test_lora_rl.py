"""A LoRA run with the SGLang engine (marker `sglang`: sglang and one CUDA GPU; skipped elsewhere). Not yet
run anywhere: no GPU was available where it was written.

SGLang is given the merged weights (base + scale * B A of every targeted projection, `lora.add_merged_`
in the trainer's `write_hf_group`) through its usual full-weight publication: the pinned release's own
LoRA serving (adapters loaded from a directory per request) is not used, so a publication of a LoRA run
costs what one of the whole model does there. The run checks that every switch published the whole model
and that the engine's logprobs of what it sampled are the trainer's (the parity probe, float32 both sides).
"""

from __future__ import annotations

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

pytestmark = [pytest.mark.sglang, pytest.mark.gpu(1), pytest.mark.timeout(900)]

SGLANG = ("distributed.nproc_per_node=1", "distributed.device=cuda", "rollout.engine=sglang",
          "rollout.sglang.dtype=float32", "rollout.sglang.cuda_graph=false", "rollout.sglang.mem_fraction_static=0.3",
          "rollout.sglang.base_port=33000",
          'rollout.sglang.engine_args={"attention_backend": "torch_native", "sampling_backend": "pytorch"}')


def test_a_lora_run_publishes_merged_weights_into_sglang(tmp_path, tiny_models):
    model = tiny_models("qwen2", init_std=0.1, hidden=256, heads=4, kv_heads=2, intermediate=512)
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={tmp_path}", *SGLANG, "trainer.total_steps=2",
                          "train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-3", "publish.parity_tolerance=1e-3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    from safetensors.torch import load_file

    whole = sum(t.numel() * t.element_size() for t in load_file(str(model / "model.safetensors")).values())
    rows = read_metrics(tmp_path)
    for r in rows[1:]:
        assert r["publish/bytes"] > 0.9 * whole, r              # the merged model, not adapters
        assert r["parity/max_abs"] < 1e-3 and r["publish/refused"] == 0, r
