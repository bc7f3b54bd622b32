"""A stand-in for the parts of sglang 0.5.21 that `SGLangEngine` touches, with the side effects the
real engine has on the calling process (so the glue can be tested on CPU, in a subprocess):

- `Engine.__init__` does what `_set_envs_and_config` does (entrypoints/engine.py:1791-1890): writes
  NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE, CUDA_DEVICE_MAX_CONNECTIONS=8 and SGLANG_RUN_ID into the
  environment, installs a SIGQUIT handler, forces the start method to "spawn"; then it starts a
  real child process, as it starts its schedulers, which reports the environment it was given.
- the tokenizer manager's `auto_create_handle_loop` binds to the running loop and adds SIGTERM and
  SIGQUIT handlers to it from the main thread (managers/tokenizer_manager.py:2305-2326); its
  coroutines call it first, as sglang's do; it reports a resolved context length, reserved tokens
  and the scheduler's longest input (tokenizer_manager.py:550, engine.py:1273-1317).
- `MultiprocessingSerializer.serialize` counts its calls (utils/common.py).
- `pause_generation` / `continue_generation` are recorded with the other control requests.

`install()` puts these modules in `sys.modules` under sglang's names.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import types
from types import SimpleNamespace

CHILD_KEYS = ("TORCHELASTIC_USE_AGENT_STORE", "NCCL_CUMEM_ENABLE", "MASTER_PORT")
SERIALIZED: list[int] = []          # one entry (the number of tensors) per serialize() call
ENGINES: list["Engine"] = []


class TokenizerManager:
    def __init__(self, context_length: int | None):
        self.event_loop = None
        self.context_len = context_length or 32768          # the model's, when the knob is unset
        self.num_reserved_tokens = 0
        self.max_req_input_len = None                       # set by the engine from the scheduler's info
        self.requests: list[str] = []

    def auto_create_handle_loop(self):
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, lambda: setattr(self, "gracefully_exit", True))
            loop.add_signal_handler(signal.SIGQUIT, lambda: os.kill(os.getpid(), signal.SIGKILL))

    async def _answer(self, what: str):
        self.auto_create_handle_loop()
        self.requests.append(what)
        return SimpleNamespace(success=True, message="")

    async def release_memory_occupation(self, obj, request):
        return await self._answer(f"release {obj.tags}")

    async def resume_memory_occupation(self, obj, request):
        return await self._answer(f"resume {obj.tags}")

    async def begin_weight_update(self, obj, request):
        return await self._answer("begin")

    async def end_weight_update(self, obj, request):
        return await self._answer("end")

    async def update_weights_from_tensor(self, obj, request):
        return await self._answer(f"update {len(obj.serialized_named_tensors)} payloads")

    async def flush_cache(self):
        return await self._answer("flush")

    async def pause_generation(self, obj):
        return await self._answer(f"pause {obj.mode}")

    async def continue_generation(self, obj):
        return await self._answer("continue")


class Engine:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.server_args = SimpleNamespace(context_length=kwargs.get("context_length"))
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
        os.environ["SGLANG_RUN_ID"] = "sglang-run-fake"
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        multiprocessing.set_start_method("spawn", force=True)
        code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {CHILD_KEYS!r}}}))"
        self.child_env = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout)
        self.tokenizer_manager = TokenizerManager(kwargs.get("context_length"))
        self.tokenizer_manager.max_req_input_len = 4096 - 6       # min(context - 1, KV tokens - 1) - 5
        ENGINES.append(self)

    async def async_generate(self, **kwargs):
        raise NotImplementedError

    def shutdown(self):
        pass


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False) -> bytes:
        SERIALIZED.append(len(obj))
        return f"payload-{len(SERIALIZED)}".encode()


def install() -> None:
    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    module("sglang", Engine=Engine)
    module("sglang.srt")
    module("sglang.srt.utils", MultiprocessingSerializer=MultiprocessingSerializer)
    module("sglang.srt.utils.patch_torch", monkey_patch_torch_reductions=lambda: None)
    module("sglang.srt.managers")
    io = module("sglang.srt.managers.io_struct")
    for name in ("BeginWeightUpdateReqInput", "EndWeightUpdateReqInput", "UpdateWeightsFromTensorReqInput",
                 "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput", "PauseGenerationReqInput",
                 "ContinueGenerationReqInput"):
        setattr(io, name, lambda **kw: SimpleNamespace(**kw))
