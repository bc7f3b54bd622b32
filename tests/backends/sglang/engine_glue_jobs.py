"""`SGLangEngine` over the sglang stand-in (tests/backends/sglang/fake_sglang.py), in a process of its
own, started as torchrun starts a rank: what its start does to this process and to its children,
the signal handlers after its first coroutine, one payload per TP rank, the resolved length.
Usage: python -m tests.backends.sglang.engine_glue_jobs MODEL_DIR OUT.json [--unprotected]

`--unprotected` starts the stand-in engine without `launch_scope` and `_bind` (the code before
they existed), for the test to show what they prevent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time

from tests.backends.sglang import fake_sglang

fake_sglang.install()

import torch  # noqa: E402

from hybridrl.backends.sglang import engine as engine_mod  # noqa: E402
from hybridrl.backends.sglang.config import SGLangConfig  # noqa: E402
from hybridrl.backends.sglang.engine import SGLangEngine  # noqa: E402

ENV_KEYS = ("TORCHELASTIC_USE_AGENT_STORE", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "CUDA_DEVICE_MAX_CONNECTIONS",
            "SGLANG_RUN_ID")


def main(model_dir: str, out: str, unprotected: bool) -> None:
    os.environ.update({"TORCHELASTIC_USE_AGENT_STORE": "True", "NCCL_CUMEM_ENABLE": "1", "MASTER_PORT": "29500"})
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    received = []
    on_term = lambda signum, frame: received.append(signum)          # noqa: E731 - the trainer's handlers
    on_quit = lambda signum, frame: received.append(signum)          # noqa: E731
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGQUIT, on_quit)
    multiprocessing.set_start_method("fork", force=True)
    torch.cuda.ipc_collect = lambda: None                             # CUDA only; nothing to collect here
    if unprotected:
        engine_mod.launch.launch_scope = contextlib.contextmanager(lambda: (yield {}))
        SGLangEngine._bind = _bind_without_release

    memory_log = out + ".memory.jsonl"
    os.environ[engine_mod.MEMORY_LOG] = memory_log
    cfg = SGLangConfig(load_format="auto", cuda_graph=False, deterministic_inference=True)
    engine = SGLangEngine(model_dir, cfg, tp_size=2)
    fake = fake_sglang.ENGINES[-1]
    r = {"child_env": fake.child_env, "env_after_start": {k: os.environ.get(k) for k in ENV_KEYS},
         "start_method": multiprocessing.get_start_method(allow_none=True),
         "sigquit_is_ours": signal.getsignal(signal.SIGQUIT) is on_quit,
         "deterministic_kwarg": fake.kwargs.get("enable_deterministic_inference"),
         "max_model_len": engine.max_model_len}

    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.sleep(engine.releasable_tags))    # the worker's first call: start in TRAIN
    r["bound_to_our_loop"] = fake.tokenizer_manager.event_loop is loop
    r["sigterm_is_ours"] = signal.getsignal(signal.SIGTERM) is on_term
    os.kill(os.getpid(), signal.SIGTERM)                              # between two phases: the loop is not running
    time.sleep(0.2)
    r["sigterm_received"] = received == [signal.SIGTERM]

    loop.run_until_complete(engine.wake_up(["weights"]))
    tensors = [(name, torch.zeros(shape, dtype=dtype)) for name, (shape, dtype) in engine.weight_spec().items()]
    loop.run_until_complete(engine.update_weights(tensors, 1))
    r["serialized"] = list(fake_sglang.SERIALIZED)
    loop.run_until_complete(engine.wake_up(["kv_cache"]))             # everything back: the scheduler runs again
    r["requests"] = fake.tokenizer_manager.requests
    with open(memory_log) as f:
        r["memory"] = [json.loads(line) for line in f]
    r["policy_version"] = engine.policy_version
    with open(out, "w") as f:
        json.dump(r, f)


async def _bind_without_release(self) -> None:
    self._tm.auto_create_handle_loop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--unprotected" in sys.argv[3:])
