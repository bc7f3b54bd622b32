"""What keeps a suite's instances and expected answers away from the policy and from training.

- Disjoint at load: the training split (every task of a mixture) and a suite share no instance id
  (`check_disjoint`, called when a run starts with `trainer.eval_suite` and when `hybridrl eval`
  evaluates a run's models): an overlap is refused, naming the instances.
- Never in the training data stream: the stream holds the training split only; asked for a suite's
  instance id it has none (`stream_lookup` raises KeyError).
- Never on the tools' side: a suite's instances live in the evaluating process (and its results
  in <run.dir>/eval/, which is not among the paths a tool sandbox sees); tool processes get a
  scrubbed environment and their own root (`hybridrl/agent/sandbox/`).
- Never in the training ledger: in-loop evaluation records one row of scores per (step, suite) in
  the ledger's `evaluations` table, never its episodes (no text, no token ids, no instance id).
- Its own seed space: episode seeds come from the suite's hash (`Suite.seed`) or, in the loop, from
  the evaluation's own group ids (`<id>@eval/<suite>/<sampling>/<step>`), never a training group's.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


class SuiteOverlap(ValueError):
    """A suite shares instances with a training split."""


def check_disjoint(train: Iterable[Any], suite_instances: Sequence[Any], *, suite: str, where: str) -> None:
    """Refuse a suite whose instances appear in the training split `train` (TaskInstances)."""
    train_ids = {inst.task_id for inst in train}
    overlap = [inst.task_id for inst in suite_instances if inst.task_id in train_ids]
    if overlap:
        shown = ", ".join(overlap[:5]) + (f" and {len(overlap) - 5} more" if len(overlap) > 5 else "")
        raise SuiteOverlap(f"suite {suite!r} shares {len(overlap)} of its {len(suite_instances)} instances with "
                           f"{where}: {shown}; evaluate on held-out instances (split: validation, or other seeds / "
                           "options)")


def stream_lookup(stream: Any, task_id: str) -> Any:
    """The instance of the training stream with this id (KeyError when it holds none)."""
    for inst in stream.items:            # a ShuffledStream's split, or every task's of a mixture
        if inst.task_id == task_id:
            return inst
    raise KeyError(f"the training stream holds no instance {task_id!r}")
