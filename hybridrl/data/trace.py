"""Trace events of one episode: what happened inside it, in order, with timings.

Every trajectory carries its events in `metadata["trace"]` (a list of small JSON-able dicts),
filled by the agent loop and read back by the run ledger (`hybridrl.store.ledger`) and
`hybridrl inspect`. Together with the trajectory's trace id (`Trajectory.trace_id`) they span
task -> inference requests -> agent turns -> tool calls -> environment steps -> reward; the
ledger adds packing (the update batch row), the update and the checkpoint.

Events (`span` names the kind; `turn` the assistant turn it belongs to):
  generate     one inference request: request id, sampler settings and seed, the policy version,
               tokens, prompt / cached tokens, queued / prefill / decode seconds, finish reason,
               and the response positions [start, end) of its tokens
  parse        what the action parser read in the turn: an answer, tool calls, malformed calls
  action       the authorizer's decision on one call (authorized | malformed | unauthorized |
               invalid_arguments | too_many_calls) and, when it ran, the tool's outcome and latency
  env_step     one environment transition: reward, done, seconds, scalar info fields
  observation  the observation appended after the turn: response positions [start, end), roles
  turn         the turn's seconds split into generate / tool / env, and its response positions
  reward       the verifier's components, their evaluators, the total and its seconds
Every event has `at`, the wall-clock time (time.time()) it was recorded: the end of what it times, so a
timed event spans [at - seconds, at] (`hybridrl inspect RUN --timeline` draws them so).
Text (prompts, tool arguments, observations) never goes in an event: the ledger keeps decoded
text apart from metrics.
"""

from __future__ import annotations

import time
from typing import Any

TRACE_KEY = "trace"


def trace(traj: Any, span: str, **fields: Any) -> None:
    """Append one event to the trajectory's trace."""
    traj.metadata.setdefault(TRACE_KEY, []).append({"span": span, "at": time.time(), **fields})


def events(traj: Any, span: str | None = None) -> list[dict[str, Any]]:
    out = traj.get(TRACE_KEY, []) if isinstance(traj, dict) else traj.metadata.get(TRACE_KEY, [])
    return [e for e in out if span is None or e["span"] == span]


def generate_event(traj: Any, turn: int, request_id: str, sampling: Any, out: Any, *, start: int) -> None:
    t = out.timings
    first = t.first_token_s if t.first_token_s > 0 else t.total_s
    trace(traj, "generate", turn=turn, request_id=request_id, version=out.policy_version,
          sampler_contract=out.sampler_contract, temperature=sampling.temperature, top_p=sampling.top_p,
          top_k=sampling.top_k, seed=sampling.seed, tokens=len(out.token_ids), prompt_tokens=out.prompt_tokens,
          cached_tokens=out.cached_prompt_tokens, queued_s=t.queued_s, prefill_s=max(0.0, first - t.queued_s),
          decode_s=max(0.0, t.total_s - first), total_s=t.total_s, finish=out.finish_reason.value,
          start=start, end=start + len(out.token_ids))


def close_turn(ep: Any) -> None:
    """The `turn` event of the episode's open turn (its share of the episode's timings), if one is open."""
    if ep.open_turn is None:
        return
    turn, before, first = ep.open_turn
    ep.open_turn = None
    seconds = {k: ep.timings.get(k, 0.0) - before.get(k, 0.0) for k in ("generate_s", "tool_s", "env_s")}
    trace(ep.traj, "turn", turn=turn, start=first, end=len(ep.traj.response_ids), **seconds)
