"""`Trajectory`: the one typed record that crosses from rollout to the trainer.

Sequences are token-in-token-out: `prompt_ids` is the rendered prompt exactly as the engine saw
it; `response_ids` is everything after it, in order: the engine's sampled ids (mask 1, with
their behaviour logprobs and the policy version that produced each) and the observation /
template ids appended between turns (mask 0, logprob 0.0, version -1).

`to_batch` lays trajectories out token-aligned for the trainer: for the full sequence
x = prompt + response, position t of every [B, T] tensor describes token x[t] (its logprob is
log p(x[t] | x[<t]); position 0 has none). So `loss_mask[b, t] = 1` exactly where x[t] is a
policy-sampled token.

Mixture-of-experts policies: `routed_experts` [positions, moe_layers, top_k] (int8, int16 above 128
experts) holds the experts the rollout engine routed each token x[t] to, for the tokens it computed
(all but the last), merged over the turns of an episode: a turn's record covers its whole context,
and the latest record of a position wins. A later turn that recomputed the context (a new policy
version after a weight update, or a prefix-cache miss) routed it anew, and its own tokens were
sampled on those routes; the trainer runs the whole sequence once, at the latest version, so the
latest routes are the ones that condition the most recent tokens under the weights nearest the
trainer's. Earlier turns' tokens then replay routes that may differ from those they were sampled
with: their behaviour logprobs still come from the engine, so the behaviour weight
(`algo/correction.py`) sees and corrects that difference. `to_batch` adds it as `routed_experts` [B, T, moe_layers, top_k], -1
where nothing was recorded; the trainer replays it (routing replay) or compares with it.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import torch

from hybridrl.data.batch import Batch


class TrajectoryStatus(str, enum.Enum):
    COMPLETED = "completed"          # the episode ended on its own (answer / env done)
    TRUNCATED = "truncated"          # a budget ended it; `truncation` says which
    ABORTED = "aborted"              # cancelled (e.g. deadline of the collection window)
    FAILED = "failed"                # the policy's fault (e.g. unparseable end state)
    INFRA_INVALID = "infra_invalid"  # not the policy's fault (tool crash, engine error): never trained on


class Truncation(str, enum.Enum):
    MAX_TURNS = "max_turns"
    MAX_NEW_TOKENS = "max_new_tokens"          # one turn hit its token budget
    MAX_RESPONSE_TOKENS = "max_response_tokens"
    WALL_CLOCK = "wall_clock"
    CONTEXT = "context"                        # the model's context length


@dataclass(kw_only=True)
class ToolCallRecord:
    turn: int
    name: str
    ok: bool
    error: str | None = None       # parse / authorization / execution error shown to the model
    latency_s: float = 0.0


def merge_routes(have: Any, new: Any) -> Any:
    """A routing record [positions, moe_layers, top_k] merged with a later request's `new` (which covers the
    whole context that request computed): the later record of a position wins (the module doc). Every front
    end merges with this."""
    if new is None:
        return have
    if have is None or len(have) <= len(new):
        return new
    return torch.cat([new, have[len(new):]])


# a trajectory's per-token lists
PER_TOKEN = ("prompt_ids", "response_ids", "response_mask", "behavior_logprobs", "policy_versions")


@dataclass(kw_only=True)
class Trajectory:
    run_id: str
    task_id: str
    group_id: str                  # samples of one prompt share it (GRPO/RLOO groups)
    attempt: int                   # index within the group
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED
    truncation: Truncation | None = None
    turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)           # component -> value
    reward_evaluators: dict[str, str] = field(default_factory=dict)   # component -> evaluator@version
    reward: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    sampler_contract: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None     # MoE: [positions, moe_layers, top_k] int tensor, see the module doc

    @property
    def trajectory_id(self) -> str:
        """Deterministic from run / task / group / attempt."""
        return f"{self.run_id}/{self.task_id}/{self.group_id}/{self.attempt}"

    @property
    def trace_id(self) -> str:
        return hashlib.sha256(self.trajectory_id.encode()).hexdigest()[:16]

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def versions(self) -> set[int]:
        return {v for v, m in zip(self.policy_versions, self.response_mask) if m}

    def append(self, ids: Sequence[int], *, policy: bool, logprobs: Sequence[float] | None = None,
               version: int = -1, routed_experts: Any = None) -> None:
        """Append a segment: policy tokens (with logprobs, version, and for MoE engines the turn's
        routing record, `GenerationOutput.routed_experts`) or observation tokens."""
        if routed_experts is not None:            # the latest record of a position wins (see the module doc)
            self.routed_experts = merge_routes(self.routed_experts, routed_experts)
        ids = list(ids)
        if policy:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(f"policy segment of {len(ids)} ids needs as many logprobs, got "
                                 f"{None if logprobs is None else len(logprobs)}")
            if version < 0:
                raise ValueError("policy segment needs the policy version that produced it")
        self.response_ids += ids
        self.response_mask += [1 if policy else 0] * len(ids)
        self.behavior_logprobs += [float(x) for x in logprobs] if policy else [0.0] * len(ids)
        self.policy_versions += [version if policy else -1] * len(ids)

    def validate(self) -> None:
        n = len(self.response_ids)
        for name in ("response_mask", "behavior_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.trajectory_id}: {name} has {len(getattr(self, name))} "
                                 f"entries for {n} response ids")
        if any(m not in (0, 1) for m in self.response_mask):
            raise ValueError(f"trajectory {self.trajectory_id}: response_mask must be 0/1")
        if any(v < 0 for v, m in zip(self.policy_versions, self.response_mask) if m):
            raise ValueError(f"trajectory {self.trajectory_id}: a policy token has no version")
        if self.routed_experts is not None and len(self.routed_experts) > len(self.prompt_ids) + n:
            raise ValueError(f"trajectory {self.trajectory_id}: routing recorded for {len(self.routed_experts)} "
                             f"positions of a {len(self.prompt_ids) + n}-token sequence")
        if self.status == TrajectoryStatus.TRUNCATED and self.truncation is None:
            raise ValueError(f"trajectory {self.trajectory_id}: TRUNCATED needs the budget that ended it")

    def record(self) -> dict[str, Any]:
        """Everything but the per-token lists (they travel as tensors): small, picklable."""
        # the lists emptied before asdict, which would copy them element by element only to drop them
        # (for a step's 128 trajectories that was most of T_prep)
        d = asdict(replace(self, **{name: [] for name in PER_TOKEN}, routed_experts=None))
        for name in (*PER_TOKEN, "routed_experts"):
            d.pop(name)
        d["status"] = self.status.value
        d["truncation"] = self.truncation.value if self.truncation else None
        return d

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, routed_experts=None))
        d["status"] = self.status.value
        d["truncation"] = self.truncation.value if self.truncation else None
        d["trajectory_id"] = self.trajectory_id
        d.pop("routed_experts")          # tensors stay out of JSON records (it travels in to_batch)
        return d


def to_batch(trajectories: Sequence[Trajectory], *, pad_id: int = 0, length: int | None = None,
             records: bool = True) -> Batch:
    """Token-aligned [B, T] tensors (right-padded) + per-sample metadata; see the module doc.
    `records=False`: without each row's `record` (what `from_batch` needs to rebuild the
    trajectories), for a batch that only trains."""
    if not trajectories:
        raise ValueError("to_batch needs at least one trajectory")
    for t in trajectories:
        t.validate()
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    width = max(lengths) if length is None else length
    if max(lengths) > width:
        raise ValueError(f"a trajectory has {max(lengths)} tokens, more than length={width}")
    b = len(trajectories)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.float32)
    behavior = torch.zeros(b, width, dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), lengths[i]
        input_ids[i, :n] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, p:n] = torch.tensor(t.response_mask, dtype=torch.float32)
        behavior[i, p:n] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
        versions[i, p:n] = torch.tensor(t.policy_versions, dtype=torch.long)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
               "behavior_logprobs": behavior, "policy_version": versions,
               "prompt_len": torch.tensor([len(t.prompt_ids) for t in trajectories]),
               "reward": torch.tensor([t.reward for t in trajectories], dtype=torch.float32)}
    routed = [t.routed_experts for t in trajectories]
    shape = next((r.shape[1:] for r in routed if r is not None and len(r)), None)
    if shape is not None:
        dtype = max((r.dtype for r in routed if r is not None), key=lambda d: torch.iinfo(d).bits)
        table = torch.full((b, width, *shape), -1, dtype=dtype)
        for i, r in enumerate(routed):
            if r is not None and len(r):
                table[i, : len(r)] = r
        tensors["routed_experts"] = table
    meta = {"trajectory_id": [t.trajectory_id for t in trajectories],
            "group_id": [t.group_id for t in trajectories],
            "status": [t.status.value for t in trajectories]}
    if records:
        meta["record"] = [t.record() for t in trajectories]
    return Batch(tensors, meta)


def from_batch(batch: Batch) -> list[Trajectory]:
    """The inverse of `to_batch` (its padding rows excluded): tokens from the tensors, the rest
    from the per-row `record` metadata."""
    out = []
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    for i in range(batch.num_valid):
        rec = dict(batch["record"][i])
        p, n = int(batch["prompt_len"][i]), int(lengths[i])
        ids = batch["input_ids"][i, :n].tolist()
        rec["tool_calls"] = [ToolCallRecord(**c) for c in rec.get("tool_calls", [])]
        rec["status"] = TrajectoryStatus(rec["status"])
        rec["truncation"] = Truncation(rec["truncation"]) if rec.get("truncation") else None
        t = Trajectory(**rec, prompt_ids=ids[:p], response_ids=ids[p:],
                       response_mask=[int(x) for x in batch["loss_mask"][i, p:n].tolist()],
                       behavior_logprobs=batch["behavior_logprobs"][i, p:n].tolist(),
                       policy_versions=batch["policy_version"][i, p:n].tolist())
        if "routed_experts" in batch.tensors:            # the recorded prefix of the row
            row = batch["routed_experts"][i, :n]
            t.routed_experts = row[: int((row[:, 0, 0] >= 0).sum())].clone()
        t.validate()
        out.append(t)
    return out
