"""The critic on the Megatron backend with real ranks: token-aligned values equal the HF decoder's
final hidden states through the value head (loaded from the model directory), under TP1, TP2 and
PP2; training on the value loss lowers it and moves every layout alike."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridrl.backends.megatron.critic import save_value_head
from tests.launch import run_torchrun


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory, tiny_models):
    src = tiny_models("qwen2", init_std=0.1)
    out = tmp_path_factory.mktemp("critic") / "model"
    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(7)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    save_value_head(out, torch.randn(1, hidden, generator=g), torch.tensor([0.3]))
    return out


def test_values_match_hf_and_training_lowers_the_value_loss(tmp_path, critic_dir):
    proc = run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "tests.backends.megatron.critic_jobs", "values",
                         str(tmp_path), str(critic_dir)], timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    from safetensors.torch import load_file
    from transformers import AutoModel

    batch = torch.load(tmp_path / "critic_batch.pt")
    head = load_file(str(critic_dir / "value_head.safetensors"))
    decoder = AutoModel.from_pretrained(critic_dir, dtype=torch.float32).eval()
    mask = batch["attention_mask"]
    with torch.no_grad():
        hidden = decoder(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    per_position = hidden @ head["weight"][0] + head["bias"][0]           # [B, T]: V of the state after t
    want = torch.zeros_like(per_position)
    want[:, 1:] = per_position[:, :-1]                                     # token-aligned: V before token t
    want = want * mask
    layouts = ("tp1", "tp2", "pp2")
    got = {k: torch.load(tmp_path / f"critic_{k}.pt") for k in layouts}
    for k in layouts:
        assert torch.allclose(got[k]["first"], want, atol=1e-4), (k, (got[k]["first"] - want).abs().max())
    records = json.loads((tmp_path / "critic.json").read_text())
    for k in layouts:
        losses = records[k]["losses"]
        assert losses[-1] < 0.7 * losses[0], losses
        assert records[k]["losses"] == pytest.approx(records["tp1"]["losses"], rel=1e-4)
        assert torch.allclose(got[k]["last"], got["tp1"]["last"], atol=1e-4)
    assert not torch.allclose(got["tp1"]["head"]["weight"], head["weight"])      # the head trained
