"""Deterministic, real implementations of the engine protocol and of slow tools, for tests and
benchmarks of the agent layer.

`TorchReferenceEngine` runs a transformers model one request at a time, without a KV cache,
following sampler contract v1 (a slow, obviously-correct engine to test against).

`ScriptedEngine` batches like a serving engine: every `step_latency_s` all active requests
advance by one token (up to `max_batch` of them), so concurrent episodes share decode steps.
What a request generates comes from a `responder(context_ids, turn) -> text | ids` (the
turn is the number of assistant headers after the prompt; a turn re-requested after an
interruption continues its script where it stopped); each token's logprob is a fixed
function of (position, token), so tests can check exactly what reached the trajectory. Every
request is recorded (`engine.requests`) with the ids it saw and returned.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from hybridrl.agent.actions import ToolSpec
from hybridrl.agent.tools.base import ToolResult
from hybridrl.rollout.protocol import (
    SAMPLER_CONTRACT_VERSION,
    FinishReason,
    GenerationOutput,
    GenerationTimings,
    SamplingParams,
)

Responder = Callable[[list[int], int], "str | list[int]"]


def scripted_logprob(position: int, token: int) -> float:
    """The logprob the scripted engine reports for `token` at absolute `position`."""
    return -(((token * 2654435761) ^ (position * 40503)) % 997 + 1) / 1000.0


@dataclass
class RecordedRequest:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    output: GenerationOutput | None = None


@dataclass
class _Active:
    rec: RecordedRequest
    script: list[int]
    future: asyncio.Future
    version: int
    submitted: float
    produced: list[int] = field(default_factory=list)
    first_token: float = 0.0
    abort_reason: FinishReason | None = None
    version_starts: list[tuple[int, int]] = field(default_factory=list)   # continued across an update
    recompute: int = 0                     # steps left recomputing its prefix under new weights


class ScriptedEngine:
    """A `RolloutEngine` that replays scripted turns with batched, timed decode steps."""

    def __init__(self, tokenizer: Any, responder: Responder, *, step_latency_s: float = 0.0,
                 max_batch: int = 256,
                 max_model_len: int = 4096, version: int = 0, assistant_header: str = "<|im_start|>assistant"):
        self.tokenizer = tokenizer
        self.responder = responder
        self.step_latency_s = step_latency_s
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.eos_token_ids = [int(tokenizer.eos_token_id)]
        self._version = version
        self._header = list(tokenizer.encode(assistant_header, add_special_tokens=False))
        self._active: dict[str, _Active] = {}
        self._runner: asyncio.Task | None = None
        self.requests: list[RecordedRequest] = []
        self.abort_on_update = True
        # an update lands between two decode steps instead: the requests running go on under the new version
        # (their later tokens labelled with it, `version_starts`), after one step spent recomputing their prefix
        self.continue_on_update = False
        self._stats = {"steps": 0, "busy_s": 0.0, "tokens": 0, "max_batch_seen": 0}

    @property
    def policy_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ protocol

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str) -> GenerationOutput:
        ids = list(token_ids)
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        turn, started_at = self._turn_of(ids)
        reply = self.responder(ids, turn)
        script = list(self.tokenizer.encode(reply, add_special_tokens=False)) + self.eos_token_ids \
            if isinstance(reply, str) else list(reply)
        so_far = ids[started_at:]                  # a turn continued after an interruption
        if so_far and script[:len(so_far)] == so_far:
            script = script[len(so_far):]
        rec = RecordedRequest(request_id, ids, sampling)
        self.requests.append(rec)
        active = _Active(rec, script, asyncio.get_running_loop().create_future(), self._version,
                         time.monotonic())
        self._active[request_id] = active
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return await active.future

    async def abort(self, request_id: str) -> bool:
        active = self._active.get(request_id)
        if active is None:
            return False
        active.abort_reason = FinishReason.ABORT
        self._finish(active, FinishReason.ABORT)
        return True

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        for _ in named_tensors:
            pass
        if self.continue_on_update:
            for active in self._active.values():
                if active.produced:
                    active.version_starts.append((len(active.produced), version))
                else:
                    active.version = version
                active.recompute = 1
        elif self.abort_on_update:
            for active in list(self._active.values()):
                self._finish(active, FinishReason.WEIGHTS_UPDATED)
        self._version = version

    async def sleep(self) -> None:
        for active in list(self._active.values()):
            self._finish(active, FinishReason.ABORT)

    async def wake_up(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "requests": len(self.requests), "running": len(self._active)}

    # ------------------------------------------------------------------ internals

    def _turn_of(self, ids: list[int]) -> tuple[int, int]:
        """(assistant headers after the prompt's, index where the current turn's text starts)."""
        h, n, start = self._header, 0, len(ids)
        for i in range(len(ids) - len(h) + 1):
            if ids[i:i + len(h)] == h:
                n += 1
                start = i + len(h)
        nl = self.tokenizer.encode("\n", add_special_tokens=False)
        if ids[start:start + len(nl)] == nl:
            start += len(nl)
        return n - 1, start          # the prompt ends with the first assistant header

    async def _run(self) -> None:
        while self._active:
            started = time.monotonic()
            if self.step_latency_s:
                await asyncio.sleep(self.step_latency_s)
            else:
                await asyncio.sleep(0)
            batch = list(self._active.values())[: self.max_batch]
            self._stats["max_batch_seen"] = max(self._stats["max_batch_seen"], len(batch))
            self._stats["steps"] += 1
            for active in batch:
                if active.future.done():
                    continue
                if active.recompute:
                    active.recompute -= 1
                    continue
                self._advance(active)
            self._stats["busy_s"] += time.monotonic() - started

    def _advance(self, active: _Active) -> None:
        rec, sp = active.rec, active.rec.sampling
        position = len(rec.input_ids) + len(active.produced)
        if position >= self.max_model_len:
            self._finish(active, FinishReason.CONTEXT)
            return
        if not active.produced:
            active.first_token = time.monotonic()
        if len(active.produced) >= len(active.script):    # the script ran out without EOS: keep
            token = active.script[-1] if active.script else self.eos_token_ids[0]
        else:
            token = active.script[len(active.produced)]
        active.produced.append(token)
        self._stats["tokens"] += 1
        if token in self.eos_token_ids or token in sp.stop_token_ids:
            self._finish(active, FinishReason.STOP)
        elif len(active.produced) >= sp.max_new_tokens:
            self._finish(active, FinishReason.LENGTH)

    def _finish(self, active: _Active, reason: FinishReason) -> None:
        self._active.pop(active.rec.request_id, None)
        if active.future.done():
            return
        start = len(active.rec.input_ids)
        now = time.monotonic()
        out = GenerationOutput(
            request_id=active.rec.request_id, token_ids=list(active.produced),
            logprobs=[scripted_logprob(start + i, t) for i, t in enumerate(active.produced)],
            finish_reason=reason, policy_version=active.version, prompt_tokens=start,
            version_starts=tuple(active.version_starts),
            timings=GenerationTimings(first_token_s=(active.first_token or now) - active.submitted,
                                      total_s=now - active.submitted),
            sampler_contract=SAMPLER_CONTRACT_VERSION)
        active.rec.output = out
        active.future.set_result(out)


class SleepTool:
    """A tool that waits `latency_s` (an API call, a slow environment) and echoes its argument."""

    def __init__(self, latency_s: float = 0.2, name: str = "sleep"):
        self.latency_s = latency_s
        self.spec = ToolSpec(name, f"wait {latency_s}s and echo", {
            "type": "object", "properties": {"text": {"type": "string", "maxLength": 200}}})

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(self.latency_s)
        return ToolResult(str(arguments.get("text", "done")), True)


def calculator_oracle(tokenizer: Any, *, calls: int = 1, call_format: str = "calc") -> Responder:
    """A perfect calculator agent: `calls` tool calls on the question, then the last tool result
    as the answer (or the evaluator's value when `calls` is 0)."""
    from hybridrl.envs.arithmetic import evaluate, format_value

    def respond(ids: list[int], turn: int) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        question = re.findall(r"What is (.*)\?", text)[-1]
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text, flags=re.S)
        if turn < calls:
            if call_format == "json":
                return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % question
            return f"<calc>{question}</calc>"
        return f"<answer>{results[-1] if results else format_value(evaluate(question))}</answer>"

    return respond


class TorchReferenceEngine:
    """A `RolloutEngine` over a transformers causal LM: full forward per token (no cache), one
    request at a time in a worker thread, sampled per the sampler contract v1."""

    def __init__(self, model: Any, *, eos_token_ids: Sequence[int], max_model_len: int = 2048,
                 version: int = 0):
        self.model = model.eval()
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self._version = version
        self._lock = asyncio.Lock()
        self._aborted: set[str] = set()

    @classmethod
    def from_pretrained(cls, model_dir: str, **kwargs: Any) -> "TorchReferenceEngine":
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        return cls(model, eos_token_ids=eos if isinstance(eos, list) else [eos], **kwargs)

    @property
    def policy_version(self) -> int:
        return self._version

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str) -> GenerationOutput:
        async with self._lock:
            ids, logprobs, reason = await asyncio.to_thread(self._sample, list(token_ids), sampling,
                                                            request_id)
        return GenerationOutput(request_id=request_id, token_ids=ids, logprobs=logprobs, finish_reason=reason,
                                policy_version=self._version, prompt_tokens=len(token_ids))

    def _sample(self, context: list[int], sp: SamplingParams, request_id: str):
        import torch

        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        out: list[int] = []
        logprobs: list[float] = []
        while True:
            if request_id in self._aborted:
                return out, logprobs, FinishReason.ABORT
            if len(context) + len(out) >= self.max_model_len:
                return out, logprobs, FinishReason.CONTEXT
            with torch.no_grad():
                logits = self.model(torch.tensor([context + out])).logits[0, -1].float()
            if sp.greedy:
                token = int(torch.argmax(logits))
                logprob = torch.log_softmax(logits, -1)[token]
            else:
                scaled = logits / sp.temperature
                full = torch.log_softmax(scaled, -1)
                keep = torch.ones_like(scaled, dtype=torch.bool)
                if sp.top_k > 0:
                    keep &= scaled >= torch.topk(scaled, min(sp.top_k, scaled.numel())).values[-1]
                probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1)
                if sp.top_p < 1.0:
                    sorted_p, order = torch.sort(probs, descending=True)
                    drop = torch.cumsum(sorted_p, 0) - sorted_p >= sp.top_p
                    probs[order[drop]] = 0.0
                token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
                logprob = full[token]
            out.append(token)
            logprobs.append(float(logprob))
            if token in self.eos_token_ids or token in sp.stop_token_ids:
                return out, logprobs, FinishReason.STOP
            if len(out) >= sp.max_new_tokens:
                return out, logprobs, FinishReason.LENGTH

    async def abort(self, request_id: str) -> bool:
        self._aborted.add(request_id)
        return True

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        raise NotImplementedError("the reference engine has fixed weights")

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}
