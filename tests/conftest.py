"""Shared test setup: markers that skip with a reason, and cached tiny-model assets."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from hybridrl.host_memory import choose_blas_path

ROOT = Path(__file__).resolve().parents[1]

choose_blas_path()      # this process multiplies on the MKL path the CLI's and the ranks' processes use


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


# `make test-fast` (HYBRIDRL_FAST=1): the inner loop, without the modules that start processes (torchrun jobs,
# runs of the CLI, subprocesses, the controller's shared runs); read from each module's text, so a new module
# that launches anything leaves the fast set by itself. `make test` runs everything.
_LAUNCHES = re.compile(r"\b(subprocess|multiprocessing|Popen|torchrun|run_job|hybridrl_train|straight_run|rl_model"
                       r"|tests\.launch|tests\.controller)\b")


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("HYBRIDRL_FAST") != "1" or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    return True if _LAUNCHES.search(collection_path.read_text()) else None


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or os.environ.get("HYBRIDRL_SLOW") == "1"
    try:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        num_gpus = 0
    try:
        import sglang  # noqa: F401

        has_sglang = True
    except Exception:  # noqa: BLE001
        has_sglang = False
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM: make test-vllm (its own venv, .venv-vllm)"))
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: set HYBRIDRL_SLOW=1 or pass --run-slow"))
        gpu = item.get_closest_marker("gpu")
        if gpu is not None:
            need = gpu.args[0] if gpu.args else 1
            if num_gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {num_gpus}"))
        if item.get_closest_marker("sglang") and not (has_sglang and num_gpus):
            item.add_marker(pytest.mark.skip(reason="needs sglang and a CUDA GPU"))
        if item.get_closest_marker("slurm") and os.environ.get("HYBRIDRL_SLURM") != "1":
            item.add_marker(pytest.mark.skip(reason="slurm: a local SLURM cluster (about 2 minutes): make test-slurm"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build-once factory: tiny_models(arch="qwen2", **spec) -> HF model directory."""
    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model

    cache: dict[tuple, Path] = {}
    base = tmp_path_factory.mktemp("tiny_models")

    def make(arch: str = "qwen2", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            name = f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())) if kwargs else arch
            cache[key] = build_tiny_model(base / name, TinyModelSpec(arch=arch, **kwargs))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """Cached loader: hf_model(model_dir) -> the transformers model in float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(model_dir):
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return cache[model_dir]

    return load
