"""The RL loop end to end with real ranks: a 4-step run, SFT, and kill -9 + resume=auto."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from hybridrl import preflight
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.launch import ROOT, env_with_repo, processes_mentioning

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"

# metrics that measure time or throughput differ between runs; everything else must not
_TIMING = ("time/", "switch/", "gen/", "val/gen/", "yield/", "val/seconds", "engine/step_time_s", "val/engine/step_time_s",
           "perf/mfu", "perf/peak_flops", "success/per_", "success/run_per_")


def hybridrl_train(recipe, *overrides, timeout=600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridrl", "train", str(recipe), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(rl_model):
    return rl_model


@pytest.fixture(scope="module")
def straight(straight_run):
    """A 4-step run with a checkpoint every 2 steps (tests/controller/conftest.py): the run the tests
    below read, and the reference the killed-and-resumed run must reproduce."""
    return straight_run


def test_a_run_logs_trains_and_exports(straight, model):
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["val/accuracy"] is not None and rows[-1]["val/accuracy"] is not None
    for r in rows[1:]:
        for key in ("reward/mean", "time/T_rollout", "time/T_reward", "time/T_prep", "time/T_train", "time/T_sync",
                    "gen/tokens_per_s", "yield/tokens_per_s", "policy/lag_max", "mismatch/max_abs",
                    "train/grad_norm", "train/clip_fraction", "train/entropy", "filter/all_equal_group",
                    "status/truncated", "switch/sleep_s", "tokens/admitted",
                    "gen/ttft_p50_s", "gen/ttft_p90_s", "gen/itl_p50_s", "gen/itl_p90_s", "gen/batch_size",
                    "gen/batch_utilisation"):
            assert key in r, key
        assert r["episodes"] == 16 and r["tokens/admitted"] > 0 and r["policy/lag_max"] == 0
        assert r["mismatch/max_abs"] < 1e-4              # the engine samples what the trainer scores
        assert r["policy/version"] == r["step"]
        assert r["gen/ttft_p90_s"] >= r["gen/ttft_p50_s"] > 0 and 0 < r["gen/batch_utilisation"] <= 1
    assert rows[2]["parity/max_abs"] < 1e-4 and rows[2]["switch/publish_s"] > 0   # v1 was published for step 2
    assert rows[2]["parity/probed"] == 1.0 and rows[2]["switch/untimed_s"] >= 0
    assert any((straight / "tensorboard").iterdir())
    assert json.loads((straight / "config.json").read_text())["trainer"]["total_steps"] == 4
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert samples and "<|im_start|>user" in samples[0]["text"]
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(straight / "hf")
    initial = AutoModelForCausalLM.from_pretrained(model)
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters()))
    assert moved > 0                                      # the updates happened and were exported


def test_sft_trains_on_demonstrations_and_exports(tmp_path, model):
    recipe = ROOT / "recipes" / "calc_sft_cpu.yaml"
    proc = hybridrl_train(recipe, f"model.path={model}", f"run.dir={tmp_path}", "sft.steps=20",
                          "sft.num_demonstrations=256", "sft.batch_size=32", "sft.log_every=5",
                          "train.lr_warmup_steps=2", "train.lr_decay_steps=20", "train.micro_batch_size=16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [r["sft/loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5        # nats
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def _comparable(row: dict, ignore: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(_TIMING + tuple(ignore))}


def assert_same_run(straight, resumed, *, from_step: int = 3, ignore: tuple[str, ...] = ()):
    """Bitwise: every logged number except timings (and `ignore`) from `from_step` on, and the exported weights."""
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a[from_step:], b[from_step:]):
        ca, cb = _comparable(ra, ignore), _comparable(rb, ignore)
        assert ca == cb, (ra["step"], set(ca.items()) ^ set(cb.items()))
    from safetensors.torch import load_file

    ea, eb = load_file(str(straight / "hf" / "model.safetensors")), load_file(str(resumed / "hf" / "model.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)


def kill_9_then_resume(straight, killed, common: list[str], recipe=RECIPE, **same_run) -> None:
    """SIGKILL the whole job (agent, every rank) in step 3 of a run of `straight`'s config, after its update and
    before it is logged; run it again (resume=auto from the step-2 checkpoint; the fault fires once): it must
    reproduce `straight` bitwise (`assert_same_run`, given `same_run`)."""
    proc = hybridrl_train(recipe, *common, f"run.dir={killed}", "--inject", "kill_job@3:train")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    assert "fault injection: kill_job@3:train" in proc.stderr
    assert not processes_mentioning(str(killed))
    assert [r["step"] for r in read_metrics(killed)] == [0, 1, 2]
    proc = hybridrl_train(recipe, *common, f"run.dir={killed}", "--inject", "kill_job@3:train")   # fired once
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming from" in proc.stderr
    assert_same_run(straight, killed, **same_run)


def test_kill_9_then_resume_auto_continues_to_the_same_numbers(tmp_path, model, straight):
    kill_9_then_resume(straight, tmp_path / "killed", [f"model.path={model}", *STRAIGHT])


def test_releasing_the_engines_weights_while_training_changes_nothing_trained(tmp_path, model, straight):
    """`rollout.native.release_weights`: each rank's engine frees its weights at every switch to training and
    takes every tensor again at the next publication; the run is the straight one, number for number."""
    proc = hybridrl_train(RECIPE, f"model.path={model}", *STRAIGHT, f"run.dir={tmp_path}",
                          "rollout.native.release_weights=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_run(straight, tmp_path, from_step=0)
    rows = read_metrics(tmp_path)
    assert all(r["parity/max_abs"] < 1e-4 for r in rows[1:] if r.get("parity/probed") == 1.0)


def test_an_engine_serving_the_trainers_parameters_in_place_trains_the_same_run(tmp_path, model, straight):
    """`rollout.native.trainer_weights`: each rank's engine serves its Megatron parameters in place
    (all of them: q/k/v in Megatron's per-group layout); the run is the straight one, number for number and
    in its weights."""
    import re

    from safetensors.torch import load_file

    proc = hybridrl_train(RECIPE, f"model.path={model}", *STRAIGHT, f"run.dir={tmp_path}",
                          "rollout.native.trainer_weights=share", "publish.verify=structure")   # written in place
    assert proc.returncode == 0, proc.stderr[-4000:]
    model_mib = sum(t.numel() * 4 for t in load_file(str(model / "model.safetensors")).values()) / 2**20
    served = [float(m) for m in re.findall(r"serves ([0-9.]+) MiB of the trainer's parameters in place", proc.stderr)]
    assert served and all(mib == round(model_mib, 1) for mib in served), (served, model_mib)
    in_place = [r["publish/in_place"] for r in read_metrics(tmp_path) if "publish/in_place" in r]
    assert in_place and set(in_place) == {1.0}                      # every publication wrote in place
    assert_same_run(straight, tmp_path, from_step=0, ignore=("publish/in_place",))


def test_sft_demonstrations_follow_the_task_seed_not_the_run_seed(model):
    from transformers import AutoTokenizer

    from hybridrl.config import load_config
    from hybridrl.controller.sft import demonstration_rows

    tok = AutoTokenizer.from_pretrained(model)
    recipe = ROOT / "recipes" / "calc_sft_cpu.yaml"
    rows = lambda *o: demonstration_rows(load_config(recipe, [f"model.path={model}", "sft.num_demonstrations=16", *o]),  # noqa: E731
                                         tok)
    assert rows() == rows("run.seed=5")              # run.seed: init and data order, not the data
    assert rows() != rows("task.seed=7")


@pytest.mark.skipif(bool(preflight.cpu_lacks_matrix_units("bfloat16")),
                    reason="this CPU has no bfloat16 matrix instructions (hybridrl refuses bfloat16 training on it)")
def test_bfloat16_training_on_a_cpu_with_bfloat16_matrix_instructions(tmp_path, model):
    """train.dtype=bfloat16 on a CPU that multiplies bfloat16 natively (AVX512-BF16, AMX): Megatron trains bfloat16
    parameters with float32 master weights, the engine serves them in place in bfloat16, and every check holds
    at bfloat16's precision (the parity probe, the engine's logprobs against the trainer's)."""
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={tmp_path}", "train.dtype=bfloat16",
                          "rollout.native.dtype=bfloat16", "publish.parity_tolerance=0.1",
                          "rollout.native.trainer_weights=share")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "of the trainer's parameters in place" in proc.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["episodes"] == 16 and r["mismatch/max_abs"] < 0.25, r["mismatch/max_abs"]   # bfloat16, not 1e-4
    assert rows[2]["parity/probed"] == 1.0 and rows[2]["parity/max_abs"] < 0.1
    from safetensors.torch import load_file

    trained, initial = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert {t.dtype for t in trained.values()} == {torch.bfloat16}
    assert max((trained[k].float() - initial[k].float()).abs().max().item() for k in trained) > 0    # it trained
