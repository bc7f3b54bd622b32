"""Continuous batching: which tokens of which sequences the next step computes.

Every step (`Scheduler.schedule`):
1. each running sequence that is decoding gets its one token (a new block when it crosses a
   block boundary; when the cache is full the most recently admitted running sequence is
   preempted: its blocks are released, cached where possible, and it waits at the head of
   the queue to be recomputed later, keeping the tokens and logprobs it already has); with
   speculative decoding, then up to `max_drafts` drafted tokens each to verify, from the
   budget and the blocks left (drafts never preempt);
2. running sequences part-way through their prefill get the next chunk of the token budget;
3. waiting sequences are admitted in order while there is budget, a free slot
   (`max_num_seqs`) and room in the cache for their whole known sequence (+ a watermark):
   first the prefix cache is consulted; a request whose prefix is being prefilled right now
   by another running sequence waits a step so it can share those blocks instead of
   recomputing them (this is how n samples of one prompt compute the prompt once).
A request that could never fit is refused when submitted (see `EngineCore.add_request`),
so a full cache means waiting or preemption, never a crash.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridrl.backends.native.kv_cache import BlockPool, PrefixHit, common_prefix_len
from hybridrl.rollout.protocol import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. `tokens` is prompt + generated; KV exists for tokens[:num_computed]."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    max_len: int                                     # finish with CONTEXT when len(tokens) reaches it
    on_finish: Callable[["Sequence"], Any] | None = None
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)   # chain hashes of the full blocks, in order
    hash_cache: list = field(default_factory=list)      # [salt, hashes] of tokens' full blocks (lookups)
    num_computed: int = 0
    high_water: int = 0                              # most tokens ever computed (recompute accounting)
    status: SeqStatus = SeqStatus.WAITING
    started: bool = False                            # admitted at least once (its version is fixed)
    version: int = -1
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    routed_experts: Any = None                       # [positions, moe_layers, top_k] ids, read at finish (MoE)
    version_starts: list[tuple[int, int]] = field(default_factory=list)   # (output index, version) after an update
    t_submit: float = field(default_factory=time.monotonic)
    t_scheduled: float | None = None
    t_first_token: float | None = None
    t_finish: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token was emitted (monotonic)
    lookup: Any = None                               # speculative.PromptLookup, built at its first draft

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def is_prefilling(self) -> bool:
        return len(self.tokens) - self.num_computed > 1


@dataclass
class StepPlan:
    """What one step computes: decode sequences (1 token each, + their drafts) first, then prefill chunks."""

    decodes: list[Sequence] = field(default_factory=list)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)         # decode -> tokens to verify after it
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)       # (sequence, tokens this step)
    copies: list[tuple[int, int, int]] = field(default_factory=list)         # (src block, dst block, rows)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(map(len, self.drafts.values())) + sum(n for _, n in self.prefills)


@dataclass
class SchedulerCounters:
    prefill_tokens: int = 0          # prompt tokens computed (the first time: recomputes are counted apart)
    prefix_hit_tokens: int = 0       # prompt tokens served from the prefix cache at first admission
    recomputed_tokens: int = 0       # tokens computed again after a preemption
    recompute_hit_tokens: int = 0    # tokens a preempted sequence found still cached when resumed
    decode_tokens: int = 0
    preemptions: int = 0
    deferred_admissions: int = 0     # waited a step to share a prefix being prefilled
    prefix_copied_tokens: int = 0    # rows copied from a partly matching block (copy on write)


class Scheduler:
    """`drafter(seq, k)` (speculative decoding, `speculative.py`) proposes up to k tokens for a decoding
    sequence to verify in the same step; `max_drafts` bounds k."""

    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int, watermark_blocks: int,
                 drafter: Callable[[Sequence, int], list[int]] | None = None, max_drafts: int = 0):
        self.pool = pool
        self.drafter = drafter
        self.max_drafts = max_drafts if drafter is not None else 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admit_new = True            # False while a weight update is pending: only started requests run
        self.version = 0                 # stamped on a request at its first admission
        self.counters = SchedulerCounters()

    # -- queue --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.hash_cache = [self.pool.salt, []]
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the engine (finished or aborted) and release its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        if self.running:
            return True
        return any(self.admit_new or s.started for s in self.waiting)

    def num_started(self) -> int:
        return len(self.running) + sum(1 for s in self.waiting if s.started)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # 1. decodes, in admission order; preempt from the back when blocks run out
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if not seq.is_prefilling:
                if not self._reserve(seq, seq.num_computed + 1):
                    break                              # seq itself was preempted (it was the last)
                plan.decodes.append(seq)
                budget -= 1
            i += 1
        # 1b. drafts to verify (speculative decoding), once every decode has its block: from the blocks free
        # now and the budget left, before prefill chunks
        for seq in plan.decodes if self.max_drafts else ():
            budget -= self._draft(seq, plan, budget)
        # 2. chunks of prefills already running
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.is_prefilling and seq.status == SeqStatus.RUNNING:
                n = min(len(seq.tokens) - seq.num_computed, budget)
                # no preemption here: the victim could be a decode already in the plan
                if self._reserve(seq, seq.num_computed + n, preempt=False):
                    plan.prefills.append((seq, n))
                    budget -= n
        # 3. admissions
        if budget > 0 and len(self.running) < self.max_num_seqs and self.waiting:
            budget = self._admit(plan, budget)
        for seq in plan.decodes:
            seq.t_scheduled = seq.t_scheduled or time.monotonic()
        return plan

    def _draft(self, seq: Sequence, plan: StepPlan, room: int) -> int:
        """Drafts for a decoding sequence, within `room` tokens of budget, the request's output budget and
        the blocks free now (drafts never preempt); returns how many were planned."""
        k = min(self.max_drafts, room, seq.params.max_new_tokens - seq.num_generated - 1,
                seq.max_len - len(seq.tokens) - 1)
        if k <= 0:
            return 0
        drafts = self.drafter(seq, k)
        if not drafts or not self._reserve(seq, seq.num_computed + 1 + len(drafts), preempt=False):
            return 0
        plan.drafts[seq] = drafts
        return len(drafts)

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past what seq's next step needs (those reserved for drafts it rejected)."""
        keep = self.pool.blocks_for(len(seq.tokens))
        if len(seq.blocks) > keep:
            self.pool.release(reversed(seq.blocks[keep:]))
            del seq.blocks[keep:]

    def _reserve(self, seq: Sequence, num_tokens: int, *, preempt: bool = True) -> bool:
        """Blocks for tokens[:num_tokens]. With `preempt`, the latest running sequences make room
        (False when `seq` itself had to go); without, False when the blocks are not there."""
        need = self.pool.blocks_for(num_tokens) - len(seq.blocks)
        while need > self.pool.num_available:
            if not preempt:
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += self.pool.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence's blocks; it waits at the head of the queue (recompute)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(seq)

    def requeue_running(self) -> None:
        """New weights: every running sequence releases its blocks (its KV is stale) and waits at the head of
        the queue, in running order, to be computed again; its tokens and logprobs are kept."""
        for seq in reversed(self.running):
            self._release(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        self.running = []

    def _release(self, seq: Sequence) -> None:
        self.pool.release(reversed(seq.blocks))
        seq.blocks = []
        seq.chain = []
        seq.num_computed = 0

    def _admit(self, plan: StepPlan, budget: int) -> int:
        pool, bs = self.pool, self.pool.block_size
        kept: deque[Sequence] = deque()
        scan = 4 * self.max_num_seqs            # bound the per-step work when many requests are held back
        while self.waiting:
            seq = self.waiting.popleft()
            scan -= 1
            if budget <= 0 or len(self.running) >= self.max_num_seqs or scan < 0:
                kept.append(seq)
                break
            if not (self.admit_new or seq.started):
                kept.append(seq)
                continue
            hit = pool.lookup(seq.tokens, len(seq.tokens) - 1, seq.hash_cache or None)
            hit_tokens = hit.num_tokens(bs)
            if self._prefix_pending(seq, hit_tokens):
                self.counters.deferred_admissions += 1
                kept.append(seq)
                continue
            pinned = [b for b in hit.blocks if pool.ref[b] == 0]
            if hit.copy_from is not None and pool.ref[hit.copy_from] == 0:
                pinned.append(hit.copy_from)
            need_all = pool.blocks_for(len(seq.tokens) + 1) - len(hit.blocks)
            reserve = self.watermark if self.running else 0
            if pool.num_available - len(pinned) < need_all + reserve:
                kept.append(seq)
                break                                  # in order: do not let later requests overtake
            n = min(len(seq.tokens) - hit_tokens, budget)
            self._start(seq, hit, n, plan)
            budget -= n
        kept.extend(self.waiting)
        self.waiting = kept
        return budget

    def _start(self, seq: Sequence, hit: PrefixHit, n: int, plan: StepPlan) -> None:
        pool, bs = self.pool, self.pool.block_size
        for b in hit.blocks:
            pool.pin(b)
        seq.blocks = list(hit.blocks)
        seq.chain = list(hit.chain)
        seq.num_computed = len(hit.blocks) * bs
        if hit.copy_from is not None:
            pool.pin(hit.copy_from)                   # keep the source while its copy is allocated
        seq.blocks += pool.allocate(pool.blocks_for(seq.num_computed + hit.copy_rows + n) - len(seq.blocks))
        if hit.copy_from is not None:
            dst = seq.blocks[len(hit.blocks)]
            plan.copies.append((hit.copy_from, dst, hit.copy_rows))
            parent = seq.chain[-1] if seq.chain else pool.salt
            start = seq.num_computed
            h = pool.record(dst, parent, seq.tokens[start:start + hit.copy_rows])
            if h is not None:
                seq.chain.append(h)
            seq.num_computed += hit.copy_rows
            self.counters.prefix_copied_tokens += hit.copy_rows
            pool.release([hit.copy_from])
        hit_tokens = seq.num_computed
        c = self.counters
        if seq.started:
            c.recompute_hit_tokens += hit_tokens
        else:
            seq.started = True
            seq.version = self.version
            seq.cached_prompt_tokens = hit_tokens
            c.prefix_hit_tokens += hit_tokens
        seq.status = SeqStatus.RUNNING
        seq.t_scheduled = seq.t_scheduled or time.monotonic()
        self.running.append(seq)
        plan.prefills.append((seq, n))

    def _prefix_pending(self, seq: Sequence, hit_tokens: int) -> bool:
        """Is more of seq's prefix being prefilled right now by a running sequence than the cache has?"""
        if not self.pool.caching:
            return False
        limit = len(seq.tokens) - 1
        for other in self.running:
            if other.is_prefilling and common_prefix_len(seq.tokens, other.tokens, limit) > hit_tokens:
                return True
        return False

    # -- after the forward --------------------------------------------------------------------

    def advance(self, seq: Sequence, n: int) -> None:
        """seq's next n tokens had their KV written: move `num_computed` and feed the prefix cache."""
        pool, bs = self.pool, self.pool.block_size
        c0 = seq.num_computed
        c1 = c0 + n
        c = self.counters
        fresh = max(c0, seq.high_water)                # below the high-water mark: computed before
        c.recomputed_tokens += max(0, min(c1, fresh) - c0)
        if c1 > fresh:
            prompt_part = max(0, min(c1, seq.prompt_len) - fresh)
            c.prefill_tokens += prompt_part
            c.decode_tokens += c1 - fresh - prompt_part
            seq.high_water = c1
        seq.num_computed = c1
        if not pool.caching:
            return
        for j in range(c0 // bs, (c1 - 1) // bs + 1):
            lo, hi = max(c0, j * bs), min(c1, (j + 1) * bs)
            parent = seq.chain[j - 1] if j > 0 else pool.salt
            h = pool.record(seq.blocks[j], parent, seq.tokens[lo:hi])
            if h is not None:
                seq.chain.append(h)
