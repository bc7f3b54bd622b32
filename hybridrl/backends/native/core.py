"""`EngineCore`: the synchronous engine (one thread owns it): requests, steps, weights, memory.

`NativeEngine` (engine.py) runs it on a dedicated thread and gives it the async protocol;
tests can also drive it directly, step by step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence as Seq

import torch

from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.backends.native.kv_cache import BlockPool
from hybridrl.backends.native.lora import LoraSpec, LoraWeights
from hybridrl.backends.native.model import CausalLM, RotaryTable
from hybridrl.backends.native import cpu_kernels, speculative
from hybridrl.backends.native.latency import LatencyLog
from hybridrl.backends.native.runner import ModelRunner
from hybridrl.backends.native.sampler import request_seed
from hybridrl.backends.native.scheduler import Scheduler, Sequence, SeqStatus
from hybridrl.backends.native.staging import StagedWeights
from hybridrl.backends.heap import release_host_memory
from hybridrl.backends.model_spec import ModelSpec
from hybridrl.backends.native.weights import ModelWeights, hf_views, load_checkpoint
from hybridrl.publication.digest import tensor_digests
from hybridrl.rollout.protocol import FinishReason, GenerationOutput, GenerationTimings, SamplingParams
from hybridrl.rollout.versions import NO_WEIGHTS, Publication
from hybridrl.rollout.weight_spec import WeightMismatch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def choose_kernels(choice: str, device: torch.device, dtype: torch.dtype) -> cpu_kernels.Kernels | None:
    """The C kernels for `rollout.native.kernels` = choice on this device and dtype, or None for torch.
    auto takes them where they apply and build (logging why not where they would have applied); c insists."""
    if choice == "torch":
        return None
    if device.type != "cpu":
        reason = f"they run on the CPU, this engine on {device}"
    elif dtype != torch.float32:
        reason = f"they take float32, this engine runs {dtype}"
    else:
        try:
            return cpu_kernels.load()
        except cpu_kernels.KernelUnavailable as exc:
            reason = str(exc)
    if choice == "c":
        raise ValueError(f"rollout.native.kernels=c: the engine's C kernels cannot be used: {reason}. "
                         f"Set rollout.native.kernels=auto (or torch) to run torch operators instead")
    if device.type == "cpu" and dtype == torch.float32:
        log.warning("the native engine runs torch operators (slower decode steps): %s", reason)
    return None


class EngineCore:
    """With `lora` the engine serves the base weights (loaded once, never published) plus LoRA
    adapters applied at run time, and a publication carries the adapters only: `views` (what
    `update_weights` writes, `weight_spec`) are then the adapters' HF views, `base_views` the base's."""

    def __init__(self, spec: ModelSpec, cfg: NativeEngineConfig, *, device: torch.device,
                 dtype: torch.dtype, policy_version: int = 0, lora: LoraSpec | None = None):
        self.spec = spec
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.weights = ModelWeights.empty(spec, dtype=dtype, device=device)
        self.base_views = hf_views(self.weights, spec)
        self.lora = LoraWeights(spec, lora, dtype=dtype, device=device) if lora is not None else None
        self.views = self.lora.views if self.lora is not None else self.base_views
        # what `update_weights` takes: the HF shapes (a view of q/k/v served in a trainer's layout has another)
        self.spec_shapes = {name: (tuple(t.shape), t.dtype) for name, t in self.views.items()}
        self.num_blocks, self.max_model_len = self._size_cache(spec, cfg, dtype)
        kernels = choose_kernels(cfg.kernels, device, dtype)
        self.kernels = "c" if kernels is not None else "torch"
        self.model = CausalLM(spec, self.weights, RotaryTable(spec, self.max_model_len, device), self.lora, kernels)
        self.pool = BlockPool(self.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        drafter = (speculative.Drafter(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
                   if cfg.speculative_tokens else None)
        self.scheduler = Scheduler(self.pool, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   watermark_blocks=cfg.watermark_blocks, drafter=drafter,
                                   max_drafts=cfg.speculative_tokens)
        self.runner = ModelRunner(self.model, num_blocks=self.num_blocks, block_size=cfg.block_size, dtype=dtype,
                                  device=device)
        self.runner.allocate_kv()
        self.requests: dict[str, Sequence] = {}
        self.publication = Publication(self.views, policy_version)     # the version and what has arrived
        self.scheduler.version = policy_version
        if cfg.on_weight_update == "continue" and spec.is_moe:
            raise ValueError("rollout.native.on_weight_update=continue: a mixture-of-experts model's routing record "
                             "of the tokens sampled before an update would be overwritten when their KV is "
                             "recomputed; use drain (or abort) with this model")
        self.staged = StagedWeights(self.views, policy_version)        # on_weight_update=continue
        self.hold_at: int | None = None            # a staged version is applied exactly at this step count
        self._held_since: float | None = None
        self.asleep = False
        self.weights_released = False              # `release_weights`: the storage is freed until restored
        self.counters = {"steps": 0, "step_time_s": 0.0, "requests_finished": 0, "requests_aborted": 0,
                         "weight_updates": 0, "weight_tensors_copied": 0, "weight_tensors_in_place": 0,
                         "weight_tensors_mismatched": 0, "prefix_cache_invalidations": 0,
                         "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "weight_tensors_staged": 0,
                         "updates_mid_request": 0, "update_continued_requests": 0, "update_recompute_tokens": 0,
                         "update_apply_s": 0.0, "update_hold_s": 0.0, "update_late_steps": 0,
                         "weight_bytes_shared": 0}
        self.latency = LatencyLog()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, cfg: NativeEngineConfig, *, device: torch.device,
                        policy_version: int = 0, lora: LoraSpec | None = None) -> "EngineCore":
        spec = ModelSpec.from_dir(model_dir)
        core = cls(spec, cfg, device=device, dtype=resolve_dtype(cfg.dtype, device), policy_version=policy_version,
                   lora=lora)
        load_checkpoint(model_dir, core.base_views, spec)
        return core

    @staticmethod
    def _size_cache(spec: ModelSpec, cfg: NativeEngineConfig, dtype: torch.dtype) -> tuple[int, int]:
        elem = torch.empty((), dtype=dtype).element_size()
        block_bytes = spec.num_layers * cfg.block_size * 2 * spec.num_kv_heads * spec.head_dim * elem
        if spec.is_moe:      # the routing record beside the KV (one byte or two per expert id)
            id_bytes = torch.empty((), dtype=spec.routing_dtype).element_size()
            block_bytes += spec.num_moe_layers * cfg.block_size * spec.num_experts_per_tok * id_bytes
        num_blocks = cfg.num_blocks or (cfg.kv_cache_mb * 2**20) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"rollout.native.kv_cache_mb={cfg.kv_cache_mb} holds no KV block of this model "
                             f"({block_bytes / 2**20:.2f} MiB each)")
        capacity = num_blocks * cfg.block_size
        model_max = spec.max_position_embeddings
        if cfg.max_model_len > model_max:
            raise ValueError(f"rollout.native.max_model_len={cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max}")
        if cfg.max_model_len > capacity:
            raise ValueError(f"rollout.native.max_model_len={cfg.max_model_len} needs more KV than the cache holds "
                             f"({num_blocks} blocks x {cfg.block_size} = {capacity} tokens): raise "
                             f"rollout.native.kv_cache_mb or lower max_model_len")
        max_len = cfg.max_model_len or model_max
        if max_len > capacity:
            log.warning("max_model_len capped at %d tokens by the KV cache (%d blocks; the model allows %d)",
                        capacity, num_blocks, model_max)
            max_len = capacity
        return num_blocks, max_len

    # -- requests -----------------------------------------------------------------------------

    def make_sequence(self, prompt: list[int], sampling: SamplingParams, request_id: str,
                      generated: tuple[list[int], list[float]] = ((), ())) -> Sequence:
        """`generated`: output tokens (and their logprobs) a request already has, from another engine with the
        same weights; it goes on from there, the next token drawn with the uniform of its output index (so
        the tokens are those one uninterrupted request would have drawn)."""
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop.update(self.spec.eos_token_ids)
        seed = sampling.seed if sampling.seed is not None else request_seed(self.cfg.seed, request_id)
        ids, logprobs = generated
        return Sequence(request_id=request_id, tokens=[*prompt, *ids], prompt_len=len(prompt), params=sampling,
                        seed=seed, stop_ids=frozenset(stop), max_len=self.max_model_len, logprobs=list(logprobs))

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return not self.asleep and not self.held() and self.scheduler.has_work()

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Schedule and run one step; returns the sequences that finished in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        result = self.runner.execute(plan)
        bad = next((i for i, lp in enumerate(result.logprobs) if not math.isfinite(lp)), None)
        if bad is not None:      # NaN/inf logits: broken weights or numerics; never hand such tokens out
            raise FloatingPointError(f"non-finite logits (logprob {result.logprobs[bad]}) for request "
                                     f"{result.sampled[bad].request_id!r} at policy version {self.policy_version}")
        rows: dict[Sequence, tuple[list[int], list[float]]] = {}
        for seq, token, logprob in zip(result.sampled, result.tokens, result.logprobs):
            tokens, logprobs = rows.setdefault(seq, ([], []))
            tokens.append(token)
            logprobs.append(logprob)
        now = time.monotonic()
        self.latency.record_step(len(plan.decodes) + len(plan.prefills),
                                 len(self.scheduler.running) / self.scheduler.max_num_seqs)
        reasons: dict[Sequence, FinishReason | None] = {}
        for seq in plan.decodes:         # their KV then covers the inputs that became tokens (drafts rolled back)
            reasons[seq] = self._append(seq, *self._verified(seq, *rows[seq], plan.drafts.get(seq)), now)
            self.scheduler.advance(seq, len(seq.tokens) - 1 - seq.num_computed)
        for seq, n in plan.prefills:
            self.scheduler.advance(seq, n)
        finished = []
        for seq, (tokens, logprobs) in rows.items():
            reason = reasons[seq] if seq in reasons else self._append(seq, tokens, logprobs, now)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif seq in reasons:
                self.scheduler.trim(seq)
        self.counters["steps"] += 1
        self.counters["step_time_s"] += time.perf_counter() - t0
        if self.counters["steps"] == self.hold_at and self.staged.ready is None:
            self._held_since = time.perf_counter()        # at the update's step, before its weights: wait
        return finished

    def _verified(self, seq: Sequence, tokens: list[int], logprobs: list[float],
                  drafts: list[int] | None) -> tuple[list[int], list[float]]:
        """A decoding sequence's tokens of the step: its one sampled token, or with drafts the accepted ones
        and the draw after them (`speculative.py`)."""
        if not drafts:
            return tokens, logprobs
        a = speculative.accepted_drafts(tokens, drafts)
        self.counters["spec_draft_tokens"] += len(drafts)
        self.counters["spec_accepted_tokens"] += a
        return drafts[:a] + [tokens[a]], logprobs[:a + 1]

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float], now: float) -> FinishReason | None:
        """Append a step's tokens to seq up to the first that ends it; returns why it ends (None: it goes on)."""
        for token, logprob in zip(tokens, logprobs):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            self.latency.record_token(seq, now)
            if token in seq.stop_ids:
                return FinishReason.STOP
            if seq.num_generated >= seq.params.max_new_tokens:
                return FinishReason.LENGTH
            if len(seq.tokens) >= seq.max_len:
                return FinishReason.CONTEXT
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.blocks and self.runner.routing is not None:     # before the blocks go back to the pool
            seq.routed_experts = self.runner.read_routing(seq)
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        seq.t_finish = time.monotonic()
        self.requests.pop(seq.request_id, None)
        key = "requests_aborted" if reason in (FinishReason.ABORT, FinishReason.WEIGHTS_UPDATED) else "requests_finished"
        self.counters[key] += 1
        if seq.on_finish is not None:
            seq.on_finish(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self.finish(seq, reason)
        return True

    def abort_all(self, reason: FinishReason, *, started_only: bool = False) -> int:
        victims = [s for s in self.requests.values() if s.started or not started_only]
        for seq in victims:
            self.finish(seq, reason)
        return len(victims)

    def output(self, seq: Sequence) -> GenerationOutput:
        t0 = seq.t_submit
        return GenerationOutput(
            request_id=seq.request_id,
            token_ids=seq.output_ids,
            logprobs=list(seq.logprobs),
            finish_reason=seq.finish_reason,
            policy_version=seq.version if seq.started else self.policy_version,
            prompt_tokens=seq.prompt_len,
            cached_prompt_tokens=seq.cached_prompt_tokens,
            version_starts=tuple(seq.version_starts),
            routed_experts=seq.routed_experts,
            timings=GenerationTimings(
                queued_s=(seq.t_scheduled - t0) if seq.t_scheduled else 0.0,
                first_token_s=(seq.t_first_token - t0) if seq.t_first_token else 0.0,
                total_s=((seq.t_finish or time.monotonic()) - t0)),
        )

    # -- weights ------------------------------------------------------------------------------

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self.spec_shapes)

    def held_tensor(self, name: str) -> torch.Tensor:
        """The engine's tensor `name` in its HF shape (a copy where its view cannot have that shape)."""
        return self.views[name].reshape(self.spec_shapes[name][0])

    @property
    def policy_version(self) -> int:
        return self.publication.version

    def apply_update(self, items: Seq[tuple[str, torch.Tensor]], version: int,
                     digests: Mapping[str, str] | None = None) -> None:
        """Copy validated tensors in place. Call only when no started request is in the engine.

        With `digests` (the sender's), every tensor is read back from this engine's storage after
        the copy and only the matching ones count as arrived; the others raise WeightMismatch.
        The version switches once every tensor has arrived (verified)."""
        self.publication.check(version)
        self.copy_into_storage(items)
        self.counters["weight_tensors_copied"] += len(items)
        bad = []
        if digests is not None:
            held = tensor_digests([(name, self.held_tensor(name)) for name, _ in items])
            bad = [name for name, _ in items if held[name] != digests.get(name)]
        self._arrived([name for name, _ in items if name not in bad], version)
        if bad:
            self.counters["weight_tensors_mismatched"] += len(bad)
            raise WeightMismatch(bad, f"update_weights v{version}: {len(bad)} tensor(s) read back from the engine's "
                                      f"storage differ from the sender's digest: {bad[:5]}")

    # -- weights without draining (on_weight_update=continue) --------------------------------------------

    def stage_update(self, items: Seq[tuple[str, torch.Tensor]], version: int,
                     digests: Mapping[str, str] | None = None) -> bool:
        """Stage validated tensors beside the live weights (`staging.py`); True once `version` is staged whole."""
        self.publication.check(version)
        self.counters["weight_tensors_staged"] += len(items)
        try:
            return self.staged.stage(items, version, digests)
        except WeightMismatch as err:
            self.counters["weight_tensors_mismatched"] += len(err.names)
            raise

    def hold_update_at(self, step: int | None) -> None:
        """Apply the next version staged whole exactly at engine step `step` (None: at once). A wait at the
        step before counts as time held (`update_hold_s`), and as the engine steps it could have run in that
        time at its mean step time so far (`update_late_steps`: how much further after the grant the landing
        step would have had to be for the engine not to wait)."""
        if self._held_since is not None:
            held = time.perf_counter() - self._held_since
            c = self.counters
            c["update_hold_s"] += held
            if c["steps"] and c["step_time_s"] > 0:
                c["update_late_steps"] += math.ceil(held / (c["step_time_s"] / c["steps"]))
        self.hold_at, self._held_since = step, None
        if self.held():                          # the step has come already, without the weights
            self._held_since = time.perf_counter()

    def held(self) -> bool:
        """At the step a staged update is due, before its weights are staged whole: no step runs."""
        return self.hold_at is not None and self.counters["steps"] >= self.hold_at and self.staged.ready is None

    def update_due(self) -> bool:
        """A version is staged whole and its step has come (no step is set: at once)."""
        return self.staged.ready is not None and (self.hold_at is None or self.counters["steps"] >= self.hold_at)

    def apply_staged(self) -> None:
        """Between two steps: every request that has started gives back its KV and waits, in its order, to be
        computed again under the new weights (`Scheduler.requeue_running`); the staged version is copied into
        the live weights and read back; each started request's later tokens are a new segment of it."""
        t0 = time.perf_counter()
        items, version, digests = self.staged.take()
        started = [s for s in self.requests.values() if s.started]
        recompute = sum(s.num_computed for s in self.scheduler.running)
        self.scheduler.requeue_running()
        try:
            self.apply_update(items, version, digests)
        except WeightMismatch as err:         # read back differently from storage: copy those once more
            self.apply_update([(n, t) for n, t in items if n in set(err.names)], version, digests)
        for seq in started:
            if seq.num_generated == 0:
                seq.version = version
            elif seq.version_starts and seq.version_starts[-1][0] == seq.num_generated:
                seq.version_starts[-1] = (seq.num_generated, version)
            else:
                seq.version_starts.append((seq.num_generated, version))
        c = self.counters
        c["updates_mid_request"] += bool(started)
        c["update_continued_requests"] += len(started)
        c["update_recompute_tokens"] += recompute
        c["update_apply_s"] += time.perf_counter() - t0
        self.hold_update_at(None)

    def commit_in_place(self, names: Seq[str], version: int) -> None:
        """Count tensors a publisher wrote straight into `views` as arrived for `version` (no copy
        here). Call only while asleep: nothing may read the weights while they are written."""
        if not self.asleep or self.scheduler.num_started():
            raise RuntimeError("weights written in place can be committed only while the engine is asleep")
        self.publication.check(version)
        self.counters["weight_tensors_in_place"] += len(names)
        self._arrived(list(names), version)

    def _arrived(self, names: list[str], version: int) -> None:
        self.pool.invalidate()
        self.counters["prefix_cache_invalidations"] += 1
        if self.publication.arrive(names, version):
            self.scheduler.version = version
            self.scheduler.admit_new = True
            self.counters["weight_updates"] += 1

    def copy_into_storage(self, items: Seq[tuple[str, torch.Tensor]]) -> None:
        """Copy into the views; tensors that lie back to back in memory on both sides (a flat bucket
        into the flat weight buffer) go as one copy."""
        with torch.no_grad():
            for dst, src in _runs([(self.views[name], t) for name, t in items]):
                dst.copy_(src.view(dst.shape) if src.shape != dst.shape else src)

    # -- memory -------------------------------------------------------------------------------

    def sleep(self) -> int:
        """Abort everything in flight (ABORT), free the KV cache (tag "kv_cache"; kept allocated with
        `keep_kv_cache`, its blocks forgotten all the same). Returns the bytes released."""
        self.abort_all(FinishReason.ABORT)
        self.pool.invalidate()
        self.asleep = True
        if self.cfg.keep_kv_cache:
            return 0
        freed = self.runner.kv_cache_bytes
        self.runner.free_kv()
        release_host_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def wake_up(self) -> None:
        if self.weights_released or self.policy_version == NO_WEIGHTS:
            raise RuntimeError("the native engine's weights were released: wake_up(['weights']) and publish a "
                               "whole version before serving")
        self.runner.allocate_kv()
        self.asleep = False

    def release_weights(self) -> int:
        """Free the weights' storage while asleep (tag "weights", `rollout.native.release_weights`); the
        version is forgotten, so the next publication must bring every tensor. Every tensor of the model
        is a view of one flat buffer (`weights.py`), so resizing that buffer's storage to nothing frees it
        and the views stay valid for `restore_weights`. Returns the bytes released."""
        if not self.asleep:
            raise RuntimeError("release the KV cache (sleep) before the weights: requests may be reading them")
        if self.lora is not None:
            raise RuntimeError("a LoRA engine's base weights are never published: they cannot be released")
        if self.weights_released:
            return 0
        storage = self.weights.flat.untyped_storage()
        if not storage.resizable():
            raise RuntimeError("the engine's weights cannot be released: their buffer was exported (a numpy() or "
                               "buffer view of it was taken), which makes its storage fixed in size")
        freed = storage.nbytes()
        storage.resize_(0)
        self.weights_released = True
        self.publication.forget()
        self.scheduler.version = self.policy_version
        self.pool.invalidate()
        release_host_memory()
        return freed

    def share_weights(self, source: Mapping[str, torch.Tensor]) -> int:
        """Serve `source`'s tensors where they are laid out as this engine stores them (`ModelWeights.share_from`):
        a trainer's parameters in this process, which a publication then writes onto themselves (torch skips
        a copy onto the same memory) and hashes. Call while no request runs; the prefix cache is dropped.
        Returns the bytes shared."""
        if self.scheduler.num_started():
            raise RuntimeError("share_weights: requests are running on the weights")
        if self.lora is not None or self.cfg.release_weights:
            raise RuntimeError("share_weights: not with LoRA adapters nor with release_weights")
        if self.device.type != "cpu":     # a trainer may move its parameters off a GPU between modes
            if self.cfg.trainer_weights == "share":
                raise ValueError(f"rollout.native.trainer_weights=share: a trainer's parameters may move off "
                                 f"{self.device} between modes, which would leave the engine serving a stale copy; "
                                 f"it needs distributed.device=cpu (auto copies them there)")
            return 0
        shared = self.weights.share_from(self.spec, source)
        self.base_views.clear()
        self.base_views.update(hf_views(self.weights, self.spec))
        self.pool.invalidate()
        self.counters["weight_bytes_shared"] = shared
        release_host_memory()
        return shared

    def restore_weights(self) -> None:
        """Allocate the weights' storage again (its contents undefined until a whole version is published)."""
        if self.weights_released:
            flat = self.weights.flat
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            self.weights_released = False

    def fail_all(self, error: BaseException) -> list[Sequence]:
        """A step raised: end every request (their callers see the error) and reset the cache."""
        failed = list(self.requests.values())
        for seq in failed:
            self.scheduler.remove(seq)
        self.requests.clear()
        self.pool.invalidate()
        return failed

    # -- observability ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        out: dict[str, Any] = dict(asdict(sched.counters))
        out.update(self.counters)
        out.update({
            "policy_version": self.policy_version,
            "pending_version": self.publication.pending,
            "requests_running": len(sched.running),
            "requests_waiting": len(sched.waiting),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": len(self.pool.evictable),
            "kv_block_size": self.cfg.block_size,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "kernels": self.kernels,
            "decode_attention_groups": self.runner.num_decode_groups,
            "weight_bytes": self.weights.num_bytes(),
            "staged_weight_bytes": self.staged.num_bytes(),
            "adapter_bytes": self.lora.num_bytes() if self.lora is not None else 0,
            "max_model_len": self.max_model_len,
            "asleep": self.asleep,
            "latency": self.latency.snapshot(),
        })
        return out


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


def _runs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merge consecutive (dst, src) pairs whose dsts and srcs each lie back to back into one flat pair."""
    merged: list[tuple[torch.Tensor, torch.Tensor]] = []
    i = 0
    while i < len(pairs):
        dst, src = pairs[i]
        j, n = i + 1, dst.numel()
        while j < len(pairs) and _adjacent(pairs[j - 1][0], pairs[j][0]) and _adjacent(pairs[j - 1][1], pairs[j][1]):
            n += pairs[j][0].numel()
            j += 1
        merged.append((dst.as_strided((n,), (1,)), src.as_strided((n,), (1,))) if j > i + 1 else (dst, src))
        i = j
    return merged
