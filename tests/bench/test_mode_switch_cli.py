"""`hybridrl bench mode-switch` says what its ratio means: against the copy floor with a verdict, or,
for a model so small that the floor is not measurable, that the ratio means nothing there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridrl.bench.cli import explain
from tests.launch import ROOT, env_with_repo


def _result(floor_s: float, switch_s: float) -> dict:
    return {"model_params": 1.9e6, "switch_s": switch_s, "cycles": 3, "copy_floor_s": floor_s,
            "ratio_to_floor": switch_s / floor_s, "copy_bandwidth_bytes_per_s": 5e9,
            "bytes_must_move": {"weights_into_engine": 5e9 * floor_s, "optimizer_out_and_back": 0,
                                "gradient_buffers_restored": 0},
            "phases": {"offload": {"median_s": switch_s / 2}, "publish": {"median_s": switch_s / 2}}}


def test_a_floor_too_small_to_measure_is_said_as_such():
    text = explain(_result(0.0001, 0.0058))
    assert "58x" in text and "not meaningful here" in text and "~100M parameters" in text
    assert "target" not in text.splitlines()[-1]


@pytest.mark.parametrize("ratio, verdict", [(1.5, "near copy speed"), (3.0, "within the target"),
                                            (9.0, "above the target")])
def test_a_measurable_floor_gets_a_verdict(ratio, verdict):
    text = explain(_result(0.2, 0.2 * ratio))
    assert f"ratio: {ratio:.2f}x the floor ({verdict}" in text and "<= 4x" in text
    assert "copy floor: the 953.7 MiB a switch must move" in text


@pytest.mark.slow
def test_the_command_on_a_tiny_model_explains_its_ratio(tiny_models, tmp_path):
    model = tiny_models("qwen2")
    out = subprocess.run([sys.executable, "-m", "hybridrl", "bench", "mode-switch", "--model", str(model),
                          "--cycles", "2", "--json", str(tmp_path / "ms.json")], cwd=ROOT, env=env_with_repo(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "ms.json").read_text())
    assert out.stdout.strip().splitlines()[-3:] == explain(result).splitlines()
    assert "not meaningful here" in out.stdout            # a ~1M-parameter model: the floor is microseconds


def test_the_lora_comparison_is_explained_side_by_side():
    from hybridrl.bench.lora_switch import explain as explain_lora

    def kind(switch, publish, mib, rate):
        spread = lambda v: {"median": v, "min": v * 0.9, "max": v * 1.2}       # noqa: E731
        return {"switch_s": spread(switch), "switch_with_probe_s": spread(switch + 0.3), "cycles": 5,
                "phases": {"publish": spread(publish)}, "bytes_published": mib * 2**20, "decode_tokens_per_s": spread(rate)}

    result = {"lora_rank": 16, "model_params": 88.6e6, "kinds": {"full": kind(0.33, 0.32, 337.8, 117),
                                                                 "adapters": kind(0.046, 0.03, 11.6, 88)},
              "speedup_switch": 0.33 / 0.046, "speedup_switch_with_probe": 0.63 / 0.346,
              "speedup_publish": 0.32 / 0.03, "merge_in_engine_s": 0.095, "decode_slowdown": 117 / 88}
    text = explain_lora(result)
    assert "LoRA rank 16 on a 88.6M-parameter model, 5 interleaved cycles of each" in text
    assert "337.80 MiB published" in text and "11.60 MiB published" in text
    assert "7.2x faster per cycle (1.8x with the parity probe), its publish phase 10.7x" in text
    assert "0.095s per publication" in text and "33% of decode speed" in text
