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

from functools import lru_cache
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


@lru_cache(maxsize=4)
def loaded_suite(name: str) -> Any:
    from hybridrl.evaluate.suite import load_suite

    return load_suite(name)


def check_run(cfg: Any) -> str | None:
    """What would make `trainer.eval_suite` wrong for this run, in one line (None when it is right): an
    unknown suite, a task the run does not hold, budgets or top_p / top_k other than the run's, or
    instances shared with the training split."""
    from hybridrl.envs.tasks import get_task
    from hybridrl.envs.tasks.registry import task_class
    from hybridrl.evaluate.suite import SuiteError

    tc = cfg.trainer
    if not tc.eval_suite:
        return None
    try:
        suite = loaded_suite(tc.eval_suite)
    except SuiteError as err:
        return f"trainer.eval_suite: {err}"
    task = get_task(cfg.task.name, cfg.task)
    held = set(task.task_names())
    for name in suite.tasks():
        if task_class(name).name not in held:
            return (f"trainer.eval_suite={tc.eval_suite}: the suite evaluates task {name!r}, which this run does not "
                    f"hold ({', '.join(sorted(held))}): add it to task.mixture, or evaluate with `hybridrl eval`")
    for key, value in suite.spec.agent.items():
        if getattr(cfg.agent, key) != value:
            return (f"trainer.eval_suite={tc.eval_suite}: the suite runs with agent.{key}={value}, this run with "
                    f"{getattr(cfg.agent, key)}: in-loop results would not be the suite's (set agent.{key}={value}, "
                    "or evaluate checkpoints with `hybridrl eval --run`)")
    for s in suite.spec.sampling:
        if (s.top_p, s.top_k) != (cfg.agent.top_p, cfg.agent.top_k):
            return (f"trainer.eval_suite={tc.eval_suite}: sampling {s.name!r} uses top_p={s.top_p}, top_k={s.top_k}, "
                    f"the run's engines agent.top_p={cfg.agent.top_p}, agent.top_k={cfg.agent.top_k}")
    try:
        check_disjoint(task.train_split(), [inst for _, inst in suite.instances()], suite=suite.name,
                       where="this run's training split (task.train_size instances)")
    except SuiteOverlap as err:
        return f"trainer.eval_suite: {err}"
    return None
