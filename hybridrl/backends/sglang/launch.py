"""What starting an in-process SGLang engine does to the trainer's process, and how it is undone.

`sglang.Engine(...)` starts its scheduler and detokenizer processes from the calling process (the
trainer's rank), and on the way (sglang 0.5.21, `python/sglang/srt/...`):

- The children inherit the environment. Under torchrun it holds `TORCHELASTIC_USE_AGENT_STORE=True`
  (torch/distributed/elastic/agent/server/local_elastic_agent.py:429), with which a `tcp://`
  rendezvous creates its store as a client only (torch/distributed/rendezvous.py:188-196). The
  schedulers' `init_process_group(tcp://127.0.0.1:<nccl_port>)` (distributed/bootstrap.py:124,
  217-233) would then wait out its timeout for a store nobody hosts. The children get
  `child_environment()`, without it (torch clears it for its own checkpoint process the same way:
  torch/distributed/checkpoint/_async_process_executor.py:237).
- `_set_envs_and_config` (entrypoints/engine.py:1791-1890) writes NCCL_CUMEM_ENABLE,
  NCCL_NVLS_ENABLE, CUDA_DEVICE_MAX_CONNECTIONS=8 (and more) into the trainer's environment,
  installs a SIGQUIT handler that kills the whole process tree (engine.py:1863-1881), and forces
  the multiprocessing start method to "spawn" (engine.py:1890).
- Later, on its first call from our event loop, the tokenizer manager adds SIGTERM and SIGQUIT
  handlers to that loop (managers/tokenizer_manager.py:2305-2326). `loop.add_signal_handler`
  replaces the process's handler with one that only wakes the loop: a SIGTERM (scancel, torchrun
  stopping the job) arriving while the loop does not run would wait until torchrun kills the rank,
  one arriving while it runs only sets sglang's draining flag, and SIGQUIT kills the process tree.

`launch_scope()` wraps the construction: inside it the environment is the children's; after it the
trainer's own communication and CUDA variables (`TRAINER_ENV_PREFIXES`), its signal handlers and
its start method are what they were. sglang's own variables (SGLANG_* and the like) stay: its
tokenizer manager, in this process, reads them. `release_loop_signals` takes the tokenizer
manager's handlers off the loop once it is bound and puts the trainer's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
from typing import Any, Iterator, Mapping

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TRAINER_ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH", "PYTORCH_")
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGQUIT", "SIGINT", "SIGHUP") if hasattr(signal, name))


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment SGLang's processes start with: the trainer's, without torchrun's agent-store
    flag (hybridrl reads it only at bootstrap; in SGLang's children it hangs the rendezvous)."""
    return {k: v for k, v in env.items() if k != AGENT_STORE}


def _trainer_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(TRAINER_ENV_PREFIXES)}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def launch_scope() -> Iterator[dict[int, Any]]:
    """Start an engine inside this; yields the trainer's signal handlers as they were before (for
    `release_loop_signals`)."""
    saved_env = _trainer_env(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    start_method = multiprocessing.get_start_method(allow_none=True)
    child = child_environment(os.environ)
    for key in set(os.environ) - set(child):
        del os.environ[key]
    try:
        yield {sig: h for sig, h in handlers.items() if h is not None}
    finally:
        for key in set(_trainer_env(os.environ)) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
        if _main_thread():
            for sig, handler in handlers.items():
                if handler is not None and signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)
        if multiprocessing.get_start_method(allow_none=True) != start_method:
            multiprocessing.set_start_method(start_method, force=True)


def release_loop_signals(loop: asyncio.AbstractEventLoop, handlers: Mapping[int, Any]) -> None:
    """Take every signal handler off `loop` (the tokenizer manager's) and put `handlers` (the
    trainer's, from `launch_scope`) back. Only the main thread has signal handlers."""
    if not _main_thread():
        return
    for sig in SIGNALS:
        if loop.remove_signal_handler(sig) and sig in handlers:
            signal.signal(sig, handlers[sig])
