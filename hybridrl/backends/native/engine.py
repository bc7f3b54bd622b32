"""`NativeEngine`: the async `RolloutEngine` over `EngineCore`.

Where steps run (`rollout.native.driver`):
- "thread": one daemon thread owns the `EngineCore` and runs steps back to back while there is
  work; every call (generate, abort, update_weights, sleep, wake_up) is a command put on its
  queue and answered through the caller's event loop (`call_soon_threadsafe`). The loop never
  waits on a forward pass, so agent code and tool I/O overlap the engine's compute (torch
  releases the GIL inside its kernels); several loops or threads may share one engine.
- "loop": a driver task on the caller's event loop runs one step at a time and yields to the
  loop between steps (`await asyncio.sleep(0)`), so other coroutines run between steps; commands
  are applied at once. It exists because on CPU, OpenMP kernels launched from a second thread
  pay a thread wake-up per parallel region (small models' steps are dominated by it; figures in
  docs/native-engine.md), which the loop's own (main) thread does not. "auto" = loop on CPU, thread on CUDA.
Either way nothing depends on the loop staying up: a loop may stop and restart between rollout
phases (`loop.run_until_complete` per phase; the loop driver resumes with it), and a new loop
may be used each time.

Weight updates (`update_weights`): each call is validated whole (names, shapes, dtypes) in
the caller before anything is queued; a bad call raises ValueError naming the tensor and
changes nothing. Then new requests stop being admitted; with `on_weight_update="drain"` the
copy waits until every request already started has finished on its version, with "abort"
those end at once with FinishReason.WEIGHTS_UPDATED. Requests not yet started wait and run on
the new version. The version advances only when every tensor of `weight_spec()` has arrived
for it (several calls may stream one version in buckets); until then nothing is generated.
While asleep, a publisher in this process may instead write into the engine's own tensors
(`writable_views`) and then count them as arrived (`commit_in_place`): one copy, not two.

With `on_weight_update="continue"` no request waits for an update: the buckets are staged beside
the live weights (`staging.py`, read back there) while steps go on, and once the version is staged
whole it is copied in between two steps (`EngineCore.apply_staged`): each running request has
finished the token of the last step on the old version, gives back its KV, is computed again under
the new weights (a prefill of its prompt and tokens so far) and samples its next tokens from them,
labelled with the new version (`GenerationOutput.version_starts`). Keeping the stale KV instead
would make the new segment's behaviour policy neither version, so it is recomputed. Where the
update lands may be fixed in engine steps (`hold_next_update`): a caller that needs runs to be
reproducible applies it at a step count, not at the moment it arrived.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence as Seq

import torch

from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.backends.native.core import EngineCore
from hybridrl.backends.native.lora import LoraSpec, lora_spec_of
from hybridrl.backends.native.scheduler import Sequence
from hybridrl.rollout.protocol import KV_CACHE, WEIGHTS, FinishReason, GenerationOutput, SamplingParams, check_tags
from hybridrl.rollout.weight_spec import validate_named_tensors

log = logging.getLogger(__name__)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class _Waiter:
    """An asyncio future on a given loop, settable from the engine thread."""

    __slots__ = ("loop", "future")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        def apply() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(apply)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


class NativeEngine:
    """The native rollout engine: Qwen2 / Llama in torch, paged KV cache, continuous batching."""

    def __init__(self, core: EngineCore):
        self._core = core
        driver = core.cfg.driver
        if driver == "auto":
            driver = "thread" if core.device.type == "cuda" else "loop"
        self.driver = driver
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._pending_updates: list[tuple[list, int, _Waiter]] = []
        self._version_waiters: list[tuple[int, _Waiter]] = []   # `serving` calls, settled when the version is served
        self._waiters: dict[str, _Waiter] = {}          # touched by whoever runs the core
        self._inflight: set[str] = set()                # request ids between generate() and its answer
        self._inflight_lock = threading.Lock()
        self._asleep = False
        # "weights" too with `release_weights`: freed while the trainer trains, published whole on return
        self.releasable_tags = core.cfg.releasable_tags()
        self._closed = False
        self._task: asyncio.Task | None = None          # the loop driver
        self._thread: threading.Thread | None = None
        if driver == "thread":
            self._thread = threading.Thread(target=self._run, name="hybridrl-native-engine", daemon=True)
            self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, cfg: NativeEngineConfig | None = None,
                        device: str | torch.device = "cpu", *, policy_version: int = 0,
                        lora: LoraSpec | None = None) -> "NativeEngine":
        """Load an HF directory (config.json + *.safetensors); the weights are `policy_version`. With
        `lora` those are the frozen base and the engine applies LoRA adapters (zero at start) at run
        time; `update_weights` then takes the adapters' tensors only (`lora.py`)."""
        core = EngineCore.from_pretrained(model_dir, cfg or NativeEngineConfig(), device=resolve_device(device),
                                          policy_version=policy_version, lora=lora)
        return cls(core)

    # -- as a registered rollout engine (`rollout.registry`) -------------------------------------

    serves_before_publication = True            # loaded from the model directory: it serves version 0

    @classmethod
    def for_rank(cls, cfg: Any, ctx: Any) -> "NativeEngine":
        """The run's engine on this rank: the model directory, `rollout.native`'s knobs, the rank's device."""
        if cfg.rollout.tp > 1:
            log.warning("the native engine has no tensor parallelism: with rollout.tp=%d one replica on rank %d "
                        "serves its group of %d ranks", cfg.rollout.tp, ctx.rank, cfg.rollout.tp)
        return cls.from_pretrained(cfg.model.path, cfg.rollout.native, device=ctx.device, lora=lora_spec_of(cfg))

    @classmethod
    def adapter_publication(cls, cfg: Any) -> bool:
        """Whether a publication of this run carries the LoRA adapters only (a LoRA run: the engine holds
        the frozen base and applies the adapters itself), rather than the whole (merged) model."""
        return lora_spec_of(cfg) is not None

    @classmethod
    def releasable_tags_for(cls, cfg: Any) -> frozenset[str]:
        return cfg.rollout.native.releasable_tags()

    @classmethod
    def colocated_transport(cls, engine: Any, ranks: Seq[int], group: Any) -> Any:
        """Flat buckets copied into `engine`'s own storage (the group's follower stand-in tracks them), in
        the trainer's process."""
        from hybridrl.publication.transport_inprocess import InProcessTransport

        return InProcessTransport(engine)

    # -- properties ---------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._core.policy_version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._core.spec.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._core.spec.vocab_size

    @property
    def config(self) -> NativeEngineConfig:
        return self._core.cfg

    @property
    def core(self) -> EngineCore:
        """The synchronous engine. Touch it only where it runs: the engine thread, or the event loop's
        thread with the loop driver (`run_in_engine` does that for you)."""
        return self._core

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF tensor name -> (shape, dtype) that `update_weights` accepts (all of them make a version)."""
        return self._core.weight_spec()

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (see EngineCore.stats); a snapshot, read without stopping the engine."""
        return {**self._core.stats(), "driver": self.driver}

    # -- the protocol -------------------------------------------------------------------------

    async def generate(self, token_ids: Seq[int], sampling: SamplingParams, request_id: str, *,
                       generated: tuple[Seq[int], Seq[float]] = ((), ())) -> GenerationOutput:
        """Generate from a prompt of token ids; returns the new ids, their logprobs, why it stopped and
        the policy version of every token. Cancelling the awaiting task aborts the request.

        `generated`: the output tokens and logprobs the request already has (a replica that served it
        was lost): it goes on from them, drawing each next token as the uninterrupted request would
        have (its output index's uniform, `sampler.py`); the answer holds them and what follows."""
        prompt = self._check_prompt(token_ids, request_id)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        generated = self._check_generated(prompt, generated, sampling, request_id)
        self._check_open()
        if self._asleep:
            raise RuntimeError("the native engine is asleep: call wake_up() before generate()")
        core = self._core
        if len(prompt) >= core.max_model_len:
            return GenerationOutput(request_id=request_id, token_ids=[], logprobs=[],
                                    finish_reason=FinishReason.CONTEXT, policy_version=core.policy_version,
                                    prompt_tokens=len(prompt))
        with self._inflight_lock:
            if request_id in self._inflight:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._inflight.add(request_id)
        try:
            seq = core.make_sequence(prompt, sampling, request_id, generated)
            waiter = _Waiter()
            self._submit(("add", seq, waiter))
            try:
                return await waiter.future
            except asyncio.CancelledError:
                self._submit(("abort", request_id, FinishReason.ABORT, None), drive=False)
                raise
        finally:
            with self._inflight_lock:
                self._inflight.discard(request_id)

    def progress(self, request_id: str, start: int = 0) -> tuple[list[int], list[float], int,
                                                               tuple[tuple[int, int], ...]] | None:
        """What a running request has generated so far, from output index `start` on: those ids and their
        logprobs, the version of its first token and where later versions begin (None: not running here).
        Read from any thread: a token is appended before its logprob, so the ids are cut at the logprobs'."""
        seq = self._core.requests.get(request_id)
        if seq is None:
            return None
        logprobs = seq.logprobs[start:]
        begin = seq.prompt_len + start
        ids = seq.tokens[begin:begin + len(logprobs)]
        return ids, logprobs, seq.version if seq.started else self._core.policy_version, tuple(seq.version_starts)

    async def abort(self, request_id: str) -> bool:
        """End a request now (FinishReason.ABORT, with the tokens it has). False if unknown or finished."""
        return await self._call("abort", request_id, FinishReason.ABORT)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None:
        """Copy HF-named tensors into the live weights (in place). Validated whole first: a bad call raises
        ValueError naming the tensor and changes nothing. With the sender's `digests`, each tensor is read
        back from the engine's storage after the copy; mismatches raise WeightMismatch and do not count
        as arrived. See the module doc for requests in flight."""
        items = list(named_tensors)
        validate_named_tensors(items, self._core.weight_spec())
        self._core.publication.check(version)
        if digests is not None and set(digests) < {n for n, _ in items}:
            raise ValueError("update_weights: digests must cover every tensor of the call")
        await self._call("update", items, version, digests)

    def writable_views(self, names: Seq[str]) -> dict[str, torch.Tensor] | None:
        """The engine's own tensors for `names`, for a publisher that writes the new weights straight
        into them (one copy, not two: no bucket in between), then calls `commit_in_place`. Given only
        while the engine is asleep with no update queued, when nothing reads the weights; None
        otherwise, or when a name is not one it accepts (the caller then sends buckets)."""
        views = self._core.views
        if (not self._asleep or self._pending_updates or self._core.staged.busy
                or any(n not in views for n in names)):
            return None
        return {n: views[n] for n in names}

    async def commit_in_place(self, names: Seq[str], version: int) -> None:
        """Count `names`, written into `writable_views`, as arrived for `version`; the version switches
        once every tensor of `weight_spec()` has arrived (as with `update_weights`)."""
        unknown = [n for n in names if n not in self._core.views]
        if unknown:
            raise ValueError(f"commit_in_place: {unknown[:5]} are not tensors this engine holds")
        self._core.publication.check(version)
        await self._call("commit", list(names), version)

    @property
    def steps(self) -> int:
        """Engine steps run so far (the clock `hold_next_update` counts in)."""
        return self._core.counters["steps"]

    @property
    def staged_version(self) -> int:
        """The newest version this engine holds verified: served, or staged whole and waiting for its step
        (`on_weight_update=continue`); what a publisher may count as delivered."""
        ready = self._core.staged.ready
        return ready if ready is not None else self.policy_version

    async def hold_next_update(self, at_step: int | None) -> None:
        """With on_weight_update=continue: apply the next version staged whole exactly when the engine has run
        `at_step` steps (`steps`), waiting there if it has not arrived by then; None: at the first step
        boundary after it is staged. The hold ends with that update (or `hold_next_update(None)`)."""
        await self._call("hold", at_step)

    async def serving(self, version: int) -> None:
        """Return once the engine serves `version` or newer (a staged version is applied at its step)."""
        await self._call("serving", version)

    async def sleep(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        """Release the tagged memory: "kv_cache" aborts every request in flight (FinishReason.ABORT)
        and frees the KV cache; "weights" (with `release_weights`, after the KV cache or with it) frees
        the weights and forgets their version: the next publication brings every tensor."""
        tags = check_tags(self, tags)
        if KV_CACHE in tags:
            await self._call("sleep")
            self._asleep = True
        if WEIGHTS in tags:
            await self._call("release_weights")

    async def wake_up(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        """Allocate what `tags` name again: "weights" (to publish into; no version until one arrives
        whole), "kv_cache" (then serve; refused while the weights are released)."""
        tags = check_tags(self, tags)
        if WEIGHTS in tags:
            await self._call("restore_weights")
        if KV_CACHE in tags and self._asleep:
            await self._call("wake_up")
            self._asleep = False

    async def share_weights(self, source: Mapping[str, torch.Tensor]) -> int:
        """Serve a colocated trainer's parameters in place where their layout is the engine's (HF name -> a
        view of the trainer's storage; `EngineCore.share_weights`); returns the bytes shared."""
        return await self._call("share", dict(source))

    async def run_in_engine(self, fn, *args) -> Any:
        """Run fn(core, *args) on the engine thread between steps (tests, diagnostics)."""
        return await self._call("call", fn, args)

    def close(self) -> None:
        """Stop the engine (thread or driver task) and free the KV cache. Requests in flight are aborted."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            self._shutdown()
            return
        with self._cv:
            self._commands.append(("stop",))
            self._cv.notify()
        self._thread.join(timeout=60)

    shutdown = close       # the name the SGLang backend uses

    def __enter__(self) -> "NativeEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers (caller side) ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the native engine is closed")

    def _check_prompt(self, token_ids: Seq[int], request_id: str) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        prompt = [int(t) for t in token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self._core.spec.vocab_size
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= vocab:
            bad = next(i for i, t in enumerate(prompt) if t < 0 or t >= vocab)
            raise ValueError(f"request {request_id!r}: token id {prompt[bad]} at position {bad} is outside the "
                             f"vocabulary [0, {vocab})")
        return prompt

    def _check_generated(self, prompt: list[int], generated: tuple[Seq[int], Seq[float]], sampling: SamplingParams,
                         request_id: str) -> tuple[list[int], list[float]]:
        ids = self._check_prompt(generated[0], request_id) if len(generated[0]) else []
        logprobs = [float(x) for x in generated[1]]
        if len(ids) != len(logprobs):
            raise ValueError(f"request {request_id!r}: {len(ids)} generated tokens but {len(logprobs)} logprobs")
        if ids and (len(ids) >= sampling.max_new_tokens or len(prompt) + len(ids) >= self._core.max_model_len):
            raise ValueError(f"request {request_id!r}: its {len(ids)} generated tokens leave nothing to generate "
                             f"(max_new_tokens {sampling.max_new_tokens}, max_model_len {self._core.max_model_len})")
        return ids, logprobs

    def _submit(self, command: tuple, *, drive: bool = True) -> None:
        if self._thread is not None:
            with self._cv:
                self._commands.append(command)
                self._cv.notify()
            return
        # loop driver: the core belongs to this thread; apply now, then make sure steps will run
        self._handle(command)
        self._apply_ready_updates()
        if drive and self._core.has_work():
            loop = asyncio.get_running_loop()
            task = self._task
            # a driver on another loop that is not running (stopped or closed) cannot serve this caller
            if task is None or task.done() or (task.get_loop() is not loop and not task.get_loop().is_running()):
                self._task = loop.create_task(self._drive())

    async def _drive(self) -> None:
        """The loop driver: one step, then let the loop run everything else that is ready."""
        core = self._core
        try:
            while not self._closed and core.has_work():
                self._step()
                self._apply_ready_updates()
                await asyncio.sleep(0)
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    async def _call(self, *command: Any) -> Any:
        self._check_open()
        waiter = _Waiter()
        self._submit((*command, waiter))
        return await waiter.future

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)        # per thread
        core = self._core
        while True:
            with self._cv:
                while not self._commands and not core.has_work():
                    self._cv.wait()
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "stop":
                    self._shutdown()
                    return
                self._handle(command)
            self._apply_ready_updates()
            if core.has_work():
                self._step()
                self._apply_ready_updates()          # the step may have drained the last started request

    def _handle(self, command: tuple) -> None:
        kind, *args = command
        core = self._core
        waiter: _Waiter | None = args[-1]
        try:
            if kind == "add":
                seq = args[0]
                if waiter.cancelled:
                    return
                if core.asleep:
                    waiter.settle(error=RuntimeError("the native engine is asleep: call wake_up() first"))
                    return
                self._waiters[seq.request_id] = waiter
                seq.on_finish = self._deliver
                core.add(seq)
            elif kind == "abort":
                found = core.abort(args[0], args[1])
                if waiter is not None:
                    waiter.settle(found)
            elif kind == "update" and core.cfg.on_weight_update == "continue":
                core.stage_update(args[0], args[1], args[2])
                waiter.settle(None)
            elif kind == "update":
                items, version, digests = args[0], args[1], args[2]
                core.publication.check(version)
                core.scheduler.admit_new = False
                if core.cfg.on_weight_update == "abort":
                    core.abort_all(FinishReason.WEIGHTS_UPDATED, started_only=True)
                self._pending_updates.append((items, version, digests, waiter))
            elif kind == "hold":
                core.hold_update_at(args[0])
                waiter.settle(None)
            elif kind == "serving":
                self._version_waiters.append((args[0], waiter))
            elif kind == "commit":
                core.commit_in_place(args[0], args[1])
                waiter.settle(None)
            elif kind == "sleep":
                freed = core.sleep()
                log.debug("native engine asleep: released %.1f MiB of KV cache", freed / 2**20)
                waiter.settle(freed)
            elif kind == "wake_up":
                core.wake_up()
                waiter.settle(None)
            elif kind == "release_weights":
                freed = core.release_weights()
                log.debug("native engine: released %.1f MiB of weights", freed / 2**20)
                waiter.settle(freed)
            elif kind == "share":
                waiter.settle(core.share_weights(args[0]))
            elif kind == "restore_weights":
                core.restore_weights()
                waiter.settle(None)
            elif kind == "call":
                waiter.settle(args[0](core, *args[1]))
            else:
                raise AssertionError(f"unknown command {kind}")
        except Exception as err:  # noqa: BLE001 - the caller gets it
            if waiter is not None:
                waiter.settle(error=err)
            else:
                log.exception("native engine: command %s failed", kind)

    def _apply_ready_updates(self) -> None:
        core = self._core
        if core.update_due():
            self._apply_staged()
        while self._pending_updates and core.scheduler.num_started() == 0:
            items, version, digests, waiter = self._pending_updates.pop(0)
            try:
                core.apply_update(items, version, digests)
                waiter.settle(None)
            except Exception as err:  # noqa: BLE001
                waiter.settle(error=err)
        if not self._pending_updates and core.publication.pending is None:
            core.scheduler.admit_new = True
        if self._version_waiters:
            waiting, self._version_waiters = self._version_waiters, []
            for version, waiter in waiting:
                if core.policy_version >= version:
                    waiter.settle(None)
                else:
                    self._version_waiters.append((version, waiter))

    def _apply_staged(self) -> None:
        """A staged version's step has come: apply it (a failure fails every request: the weights may be
        partly written, and the `serving` callers hear why)."""
        try:
            self._core.apply_staged()
        except Exception as err:  # noqa: BLE001
            log.exception("native engine: applying a staged version failed; failing the requests in flight")
            self._fail(err)
            for _, waiter in self._version_waiters:
                waiter.settle(error=err)
            self._version_waiters.clear()

    def _step(self) -> None:
        try:
            self._core.step()
        except Exception as err:  # noqa: BLE001 - fail the requests, keep serving
            log.exception("native engine: a step failed; failing the requests in flight")
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        for seq in self._core.fail_all(err):
            waiter = self._waiters.pop(seq.request_id, None)
            if waiter is not None:
                waiter.settle(error=RuntimeError(f"native engine step failed: {err!r}"))

    def _deliver(self, seq: Sequence) -> None:
        waiter = self._waiters.pop(seq.request_id, None)
        if waiter is not None:
            waiter.settle(self._core.output(seq))

    def _shutdown(self) -> None:
        self._core.abort_all(FinishReason.ABORT)
        for *_, waiter in self._pending_updates:
            waiter.settle(error=RuntimeError("the native engine was closed before the update was applied"))
        for _, waiter in self._version_waiters:
            waiter.settle(error=RuntimeError("the native engine was closed before the version was served"))
        self._pending_updates.clear()
        self._version_waiters.clear()
        self._core.runner.free_kv()
