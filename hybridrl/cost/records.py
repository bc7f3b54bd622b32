"""What a run directory recorded, read once for the cost books and the planner.

    metrics.jsonl   one row per step (stage times, engine and agent counters, val/* of validations)
    clock.jsonl     the controller's marks (hybridrl/cost/clock.py): launch, start, steps, checkpoints
    config.json     the resolved config (placement, ranks, device, trainer knobs)
    ledger/         every trajectory: status, filter reason, tokens, timings, trace, tool calls

A run without a ledger (store.enabled=false) still has its metrics and clock: the books then lack
the per-trajectory figures (never-trained shares by reason, tool seconds, successes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.cost.clock import read_clock

# a tool call that named no tool (its text did not parse as a call): the agent loop and the gateway record it
# as "?"; the books count it under this name, and it runs (and costs) nothing
MALFORMED = "malformed tool calls"


def tool_name(call: dict) -> str:
    name = call.get("name")
    return MALFORMED if name in (None, "", "?") else str(name)


@dataclass
class EpisodeRecord:
    """One training trajectory as the books and the planner need it."""

    step: int
    group_id: str
    task_id: str
    status: str
    filter_reason: str | None      # None: consumed by an update
    reward: float
    success: bool                  # the verifier's `correct` component is 1 (else reward >= 1)
    prompt_tokens: int
    policy_tokens: int
    response_tokens: int
    turns: int
    lag: int
    tool_calls: list[str] = field(default_factory=list)       # the tool of every call
    timings: dict[str, float] = field(default_factory=dict)   # generate_s, tool_s, env_s, reward_s, total_s
    turn_events: list[dict] = field(default_factory=list)     # per turn: new prompt tokens, generated, tool/env s
    prefill_s: float = 0.0         # the requests' own prefill / decode seconds (they overlap in a batch)
    decode_s: float = 0.0


@dataclass
class RunRecords:
    run_dir: Path
    config: dict
    rows: list[dict]                # metrics.jsonl
    marks: list[dict]               # clock.jsonl
    episodes: list[EpisodeRecord]   # the ledger's trajectories (empty without a ledger)
    has_ledger: bool
    pruned_steps: list[int]         # steps whose ledger shard retention deleted (no timings for them)

    @property
    def world_size(self) -> int:
        starts = [m for m in self.marks if m["mark"] == "start" and m.get("world_size")]
        if starts:
            return int(starts[-1]["world_size"])
        return int(self.config.get("distributed", {}).get("nproc_per_node", 1))

    @property
    def placement(self) -> dict:
        p = self.config.get("placement", {})
        return {"mode": p.get("mode", "colocated"), "rollout_ranks": int(p.get("rollout_ranks", 1))}

    def step_rows(self) -> list[dict]:
        return [r for r in self.rows if r["step"] > 0]

    def row(self, step: int) -> dict | None:
        return next((r for r in self.rows if r["step"] == step), None)


def _success(rewards: dict, reward: float) -> bool:
    if "correct" in rewards:
        return float(rewards["correct"]) >= 1.0 - 1e-9
    return reward >= 1.0 - 1e-9


def _episodes(run_dir: Path) -> tuple[list[EpisodeRecord], list[int]]:
    from hybridrl.store.ledger import connect, ledger_dir

    db = connect(run_dir)
    index = {r["id"]: dict(r) for r in db.execute("SELECT * FROM trajectories ORDER BY step, shard_row")}
    steps = [dict(r) for r in db.execute("SELECT step, shard, pruned FROM steps ORDER BY step")]
    db.close()
    detail: dict[str, dict] = {}
    pruned = []
    import pyarrow.parquet as pq

    for s in steps:
        path = ledger_dir(run_dir) / "data" / (s["shard"] or "")
        if s["pruned"] or not s["shard"] or not path.exists():
            pruned.append(s["step"])
            continue
        table = pq.read_table(path, columns=["id", "timings", "tool_calls", "trace"]).to_pydict()
        for i, tid in enumerate(table["id"]):
            detail[tid] = {"timings": json.loads(table["timings"][i] or "{}"),
                           "tool_calls": json.loads(table["tool_calls"][i] or "[]"),
                           "trace": json.loads(table["trace"][i] or "[]")}
    out = []
    for tid, r in index.items():
        d = detail.get(tid, {})
        trace = d.get("trace", [])
        generates = [e for e in trace if e.get("span") == "generate"]
        turn_events = turn_events_of(trace)
        rewards = json.loads(r["rewards"] or "{}")
        out.append(EpisodeRecord(
            step=r["step"], group_id=r["group_id"], task_id=r["task_id"], status=r["status"],
            filter_reason=None if r["consumed_step"] is not None else (r["filter_reason"] or "not admitted"),
            reward=float(r["reward"]), success=_success(rewards, float(r["reward"])),
            prompt_tokens=int(r["prompt_tokens"] or 0), policy_tokens=int(r["policy_tokens"] or 0),
            response_tokens=int(r["response_tokens"] or 0), turns=int(r["turns"] or 0), lag=int(r["lag"] or 0),
            tool_calls=[tool_name(c) for c in d.get("tool_calls", [])],
            timings={k: float(v) for k, v in d.get("timings", {}).items() if isinstance(v, (int, float))},
            turn_events=turn_events,
            prefill_s=sum(float(g.get("prefill_s", 0.0)) for g in generates),
            decode_s=sum(float(g.get("decode_s", 0.0)) for g in generates)))
    return out, pruned


def turn_events_of(trace: list[dict]) -> list[dict]:
    """Per turn of an episode's trace: the prompt tokens the engine computed (not served from the prefix
    cache), the tokens it generated, the tool / environment / generate seconds."""
    generates = [e for e in trace if e.get("span") == "generate"]
    out = []
    for e in (e for e in trace if e.get("span") == "turn"):
        gen = [g for g in generates if g.get("turn") == e.get("turn")]
        out.append({"turn": e.get("turn"),
                    "new_prompt_tokens": sum(int(g.get("prompt_tokens", 0)) - int(g.get("cached_tokens", 0) or 0)
                                             for g in gen),
                    "generated": sum(int(g.get("tokens", 0)) for g in gen),
                    "tool_s": float(e.get("tool_s", 0.0)), "env_s": float(e.get("env_s", 0.0)),
                    "generate_s": float(e.get("generate_s", 0.0))})
    return out


def read_run(run_dir: str | Path) -> RunRecords:
    from hybridrl.telemetry.metrics import read_metrics
    from hybridrl.store.ledger import ledger_dir

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: pass the run.dir of an RL run")
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    has_ledger = (ledger_dir(run_dir) / "index.sqlite").exists()
    episodes, pruned = _episodes(run_dir) if has_ledger else ([], [])
    return RunRecords(run_dir=run_dir, config=config, rows=read_metrics(run_dir), marks=read_clock(run_dir),
                      episodes=episodes, has_ledger=has_ledger, pruned_steps=pruned)
