"""In-loop evaluation on a suite (`trainer.eval_suite`, every `trainer.eval_every` steps), beside validation.

At step 0, every `eval_every` steps and the last step, the current policy runs every sampling of
the suite on the rollout side (the run's engines and agent loop, `RolloutSide.rollout`), exactly as
validation does. The scores go to metrics.jsonl and TensorBoard (`eval/<suite>/<sampling>/accuracy`,
`.../pass@k`, `reward`, `tool_calls`, `tool_call_rate`, `length`, per task of a mixture
`eval/<suite>/<task>/<sampling>/accuracy`), to `<run.dir>/eval/<suite>/step_NNNNNN.in_loop.json`
(the same result format as `hybridrl eval`), and to the ledger's lineage: the step, policy version,
the checkpoint the step writes (when it writes one) and the published weights' hash -> the scores.
The episodes themselves are recorded nowhere (not in the ledger, not in samples.jsonl); the result
holds one digest per sampling of the episodes' response tokens (`hybridrl.evaluate.runner.digests`),
which a greedy `hybridrl eval` of the step's checkpoint reproduces.

The suite must evaluate tasks the run holds (a mixture's tasks, or the run's task) under the run's
own episode budgets and top_p / top_k (they are the rollout side's): checked before the run starts
(`hybridrl.evaluate.protect.check_run`). Its episode seeds come from its own group ids (`<id>@eval/<suite>/<sampling>/<step>`),
never a training group's, so sampled scores differ from `hybridrl eval`'s (the suite's seed space);
greedy scores are the same.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hybridrl.controller import metrics as M
from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import from_batch
from hybridrl.workers.rollout_side import RolloutSide

log = logging.getLogger(__name__)


def due(tc: Any, step: int) -> bool:
    if not tc.eval_suite:
        return False
    return step == 0 or step == tc.total_steps or bool(tc.eval_every and step % tc.eval_every == 0)


def episode_rows(suite: Any, instances: list, sampling: Any, step: int) -> Batch:
    rows = [(inst, a) for _, inst in instances for a in range(sampling.samples)]
    return Batch(meta={"instance": [inst.to_dict() for inst, _ in rows], "attempt": [a for _, a in rows],
                       "group_id": [f"{inst.task_id}@eval/{suite.name}/{sampling.name}/{step}" for inst, _ in rows]})


def evaluate_in_loop(cfg: Any, wg: Any, run: Any, link: Any, step: int) -> dict[str, float]:
    """The suite's scores of the current policy when an evaluation is due at `step` (else {})."""
    from hybridrl.evaluate.metrics import flat, suite_metrics
    from hybridrl.evaluate.protect import loaded_suite
    from hybridrl.evaluate.runner import digests, record_of, write_result
    from hybridrl.evaluate.suite import instances_hash

    tc = cfg.trainer
    if not due(tc, step):
        return {}
    started = time.perf_counter()
    suite = loaded_suite(tc.eval_suite)
    switch = link.ensure_rollout(run.version, run.trained_at)     # (the step whose update made the version)
    if switch is not None:
        run.ledger.record_switch(step, switch, purpose="evaluation")
    instances = suite.instances()
    task_of = {inst.task_id: inst.task for _, inst in instances}
    records, contracts = [], set()
    for sampling in suite.spec.sampling:
        rows = episode_rows(suite, instances, sampling, step)
        for t in from_batch(wg.call(RolloutSide.rollout, rows, temperature=sampling.temperature)):
            records.append(record_of(t, task=task_of[t.task_id], sampling=sampling.name))
            contracts.add(int(t.sampler_contract))
    M.engine_metrics(wg.call(RolloutSide.rollout_stats), run)       # the evaluation's counters: not the next step's
    writes_checkpoint = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0 and step > 0)
    result = {
        "suite": suite.summary(), "instances_hash": instances_hash([inst for _, inst in instances]),
        "instances": len(instances), "tasks": suite.tasks(), "label": f"step_{step:06d}",
        "model": {"path": None, "hash": _release_hash(run, switch), "step": step, "policy_version": run.version,
                  "run": str(cfg.run.dir), "what": "in-loop evaluation",
                  "checkpoint": str(run.checkpoints.path(step)) if writes_checkpoint else None},
        "sampler": {"engine": cfg.rollout.engine, "contracts": sorted(contracts), "seed": cfg.run.seed,
                    "sampling": [vars(s) for s in suite.spec.sampling]},
        "metrics": suite_metrics(suite, records), "digests": digests(records),
        "episodes": len(records), "episodes_resumed": 0,
        "episodes_run": len(records), "seconds": time.perf_counter() - started, "written_at": time.time(),
        "source": "train",
    }
    path = Path(cfg.run.dir) / "eval" / suite.name / f"step_{step:06d}.in_loop.json"
    write_result(path, result)
    run.ledger.record_evaluation(step, result, result_path=str(path))
    out = flat(result["metrics"], f"eval/{suite.name}")
    out[f"eval/{suite.name}/seconds"] = result["seconds"]
    log.info("evaluation on %s at step %d (policy v%d): %s", suite.name, step, run.version,
             ", ".join(f"{s} {100 * v.get('accuracy', 0):.1f}%" for s, v in result["metrics"]["sampling"].items()))
    return out


def _release_hash(run: Any, switch: dict | None) -> str | None:
    """The hash of the weights being evaluated: the publication's (this switch's, or the one recorded for
    the current version)."""
    release = (switch or {}).get("release")
    if release:
        return release.get("checkpoint_hash")
    return run.ledger.release_hash(run.version)
