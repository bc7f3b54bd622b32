"""The SGLang engine's glue on CPU, over a stand-in for sglang with its real side effects on the
calling process (tests/backends/sglang/fake_sglang.py), each run in a process of its own: what its
children inherit, what the trainer keeps, signal handlers, one payload per TP rank, the length."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.backends.sglang.engine import engine_kwargs, resolved_max_model_len
from tests.launch import ROOT, env_with_repo


def run_glue(model_dir, tmp_path, *flags) -> dict:
    out = tmp_path / f"glue{''.join(flags)}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.backends.sglang.engine_glue_jobs", str(model_dir), str(out),
                           *flags], cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def glue(tiny_models, tmp_path_factory):
    model_dir = tiny_models("qwen2", init_std=0.05)
    tmp = tmp_path_factory.mktemp("glue")
    return run_glue(model_dir, tmp), run_glue(model_dir, tmp, "--unprotected")


def test_children_start_without_the_agent_store_flag_and_the_trainer_keeps_its_settings(glue):
    r, unprotected = glue
    assert r["child_env"] == {"TORCHELASTIC_USE_AGENT_STORE": None, "NCCL_CUMEM_ENABLE": "0", "MASTER_PORT": "29500"}
    assert unprotected["child_env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"      # what hung the schedulers
    assert r["env_after_start"] == {"TORCHELASTIC_USE_AGENT_STORE": "True", "NCCL_CUMEM_ENABLE": "1",
                                    "NCCL_NVLS_ENABLE": None, "CUDA_DEVICE_MAX_CONNECTIONS": None,
                                    "SGLANG_RUN_ID": "sglang-run-fake"}            # sglang's own variable stays
    assert unprotected["env_after_start"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert r["start_method"] == "fork" and unprotected["start_method"] == "spawn"


def test_the_trainers_signal_handlers_survive_the_engine(glue):
    r, unprotected = glue
    assert r["sigquit_is_ours"] and not unprotected["sigquit_is_ours"]
    assert r["bound_to_our_loop"] and unprotected["bound_to_our_loop"]
    assert r["sigterm_is_ours"] and r["sigterm_received"]
    assert not unprotected["sigterm_is_ours"] and not unprotected["sigterm_received"]   # queued on the loop


def test_one_payload_per_tp_rank_paused_while_asleep_and_the_resolved_length(glue):
    r, _ = glue
    assert len(r["serialized"]) == 2 and len(set(r["serialized"])) == 1           # serialized once for each rank
    released = r["requests"][1]
    assert released.startswith("release")
    assert sorted(ast.literal_eval(released[len("release "):])) == ["kv_cache", "weights"]
    assert r["requests"][:1] + r["requests"][2:] == ["pause retract", "resume ['weights']", "begin",
                                                     "update 2 payloads", "end", "flush", "resume ['kv_cache']",
                                                     "continue"]
    assert r["policy_version"] == 1
    assert [(m["op"], m["tags"]) for m in r["memory"]] == [("release", ["kv_cache", "weights"]),
                                                          ("resume", ["weights"]), ("resume", ["kv_cache"])]
    assert all(m["used_before"] is None and m["used_after"] is None for m in r["memory"])    # no GPU here
    assert r["max_model_len"] == 4096 - 6 and r["deterministic_kwarg"] is True


def test_resolved_max_model_len():
    tm = SimpleNamespace(context_len=32768, num_reserved_tokens=0, max_req_input_len=None)
    assert resolved_max_model_len(None, tm) == 32768                               # the model's, not None
    assert resolved_max_model_len(2048, tm) == 2048
    tm = SimpleNamespace(context_len=4096, num_reserved_tokens=8, max_req_input_len=100_000)
    assert resolved_max_model_len(None, tm) == 4088                                # less the reserved tokens
    assert resolved_max_model_len(None, SimpleNamespace(context_len=4096, max_req_input_len=3000)) == 3000
    assert resolved_max_model_len(None, SimpleNamespace()) is None


def test_deterministic_inference_is_passed_only_when_asked():
    kwargs = engine_kwargs("/m", SGLangConfig(), tp_size=1, base_gpu_id=0, port_offset=0, seed=0)
    assert "enable_deterministic_inference" not in kwargs
    kwargs = engine_kwargs("/m", SGLangConfig(deterministic_inference=True), tp_size=1, base_gpu_id=0,
                           port_offset=0, seed=0)
    assert kwargs["enable_deterministic_inference"] is True
