"""Run a suite on one model in this process: the agent loop on a native engine, resumable.

Every sampling of the suite runs `samples` episodes of every instance (group `task_id@sampling`,
attempts 0..samples-1), under the suite's episode budgets, with the task's tools in the sandbox and
a task's environment through the leased environment service (its own database beside the result).
The episodes' seeds come from the suite's own seed space (`Suite.seed`, run id `eval-<suite>`),
never from a training run's.

Resumable: each finished episode is appended to `<label>.episodes.jsonl` beside the result (a
header line first: the suite's, the instances' and the model's hashes). Run again, the episodes
already there are not run again; a header that differs (another suite version, other instances,
other weights) moves the old file aside and starts over. The episode records hold ids, scores and
counts only: never the instance's prompt or its expected answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hybridrl.evaluate.episodes import correct
from hybridrl.evaluate.metrics import suite_metrics
from hybridrl.evaluate.suite import Suite, instances_hash

log = logging.getLogger(__name__)


def episode_key(sampling: str, task_id: str, attempt: int) -> str:
    return f"{sampling}/{task_id}/{attempt}"


def record_of(trajectory: Any, *, task: str, sampling: str) -> dict[str, Any]:
    """What a result keeps of one episode: ids, scores and counts (no text, no expected answer)."""
    return {"key": episode_key(sampling, trajectory.task_id, trajectory.attempt), "sampling": sampling,
            "task": task, "task_id": trajectory.task_id, "attempt": trajectory.attempt,
            "correct": correct(trajectory), "reward": float(trajectory.reward), "status": trajectory.status.value,
            "tool_calls": len(trajectory.tool_calls), "response_tokens": len(trajectory.response_ids),
            "turns": trajectory.turns, "sampler_contract": int(trajectory.sampler_contract),
            "response_hash": response_hash(trajectory.response_ids)}


def response_hash(ids: Sequence[int]) -> str:
    """A short hash of an episode's response tokens: two evaluations of the same weights, greedy, agree on
    it episode by episode (the tokens themselves are not kept)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def digests(records: Sequence[dict]) -> dict[str, str]:
    """sampling -> one hash over its episodes' (key, response hash), in key order: equal digests of a greedy
    sampling are the same episodes token for token."""
    by_sampling: dict[str, list[str]] = {}
    for r in records:
        by_sampling.setdefault(r["sampling"], []).append(f"{r['key']}:{r.get('response_hash', '')}")
    return {s: hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()[:16] for s, rows in by_sampling.items()}


class EpisodeLog:
    """The finished episodes of one (suite, model) evaluation, appended as they end."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path, self.header = path, header
        self.records: dict[str, dict] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            lines = path.read_text().splitlines()
            first = _parse(lines[0]) if lines else None
            if first == {"header": header}:
                for line in lines[1:]:
                    record = _parse(line)          # a line cut by a kill is dropped (its episode runs again)
                    if record is not None and "key" in record:
                        self.records[record["key"]] = record
            else:
                aside = _aside(path)
                os.replace(path, aside)
                log.info("eval: %s was written for another suite, instance set or model: moved to %s", path, aside)
        self.resumed = len(self.records)
        self._file = path.open("a")
        if not self.records:
            self._file.seek(0)
            self._file.truncate()
            self._write({"header": header})

    def add(self, record: dict) -> None:
        self.records[record["key"]] = record
        self._write(record)

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _parse(line: str) -> dict | None:
    try:
        out = json.loads(line)
    except json.JSONDecodeError:
        return None
    return out if isinstance(out, dict) else None


def _aside(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.old-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.old-{n}")


def model_hash(model_dir: str | Path) -> str:
    """xxh3-128 over the model's safetensors files (names and bytes, in name order)."""
    import xxhash

    h = xxhash.xxh3_128()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (an HF model directory is needed)")
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def episodes_of(suite: Suite, instances: Sequence[tuple[int, Any]]) -> list[tuple[Any, int, Any, int]]:
    """(sampling, entry index, instance, attempt) for every episode of the suite, sampling-major."""
    return [(s, i, inst, a) for s in suite.spec.sampling for i, inst in instances for a in range(s.samples)]


def agent_config(cfg_agent: Any, suite: Suite, sampling: Any) -> Any:
    """The agent settings of one sampling: the base's, the suite's budgets, the sampling's top_p / top_k."""
    return dataclasses.replace(cfg_agent, **suite.spec.agent, top_p=sampling.top_p, top_k=sampling.top_k,
                               temperature=sampling.temperature)


def run_suite(suite: Suite, cfg: Any, model_dir: str | Path, result_path: Path, *, label: str,
              model_info: dict[str, Any] | None = None, device: str = "cpu", progress: bool = True,
              on_episode: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Evaluate `model_dir` on `suite` (agent / tools / rollout / env settings from `cfg`); writes
    `result_path` (JSON) and the episode log beside it; returns the result."""
    from transformers import AutoTokenizer

    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.backends.native import NativeEngine
    from hybridrl.envs.tasks import Task, get_task

    started = time.perf_counter()
    instances = suite.instances()
    digest = model_hash(model_dir)
    header = {"suite": suite.hash, "instances": instances_hash([inst for _, inst in instances]), "model": digest}
    log_path = result_path.with_name(result_path.stem + ".episodes.jsonl")
    episodes = EpisodeLog(log_path, header)
    todo = [e for e in episodes_of(suite, instances) if episode_key(e[0].name, e[2].task_id, e[3]) not in episodes.records]
    tasks = {i: get_task(entry.task, entry.task_config(0)) for i, entry in enumerate(suite.spec.entries)}
    contracts: set[int] = {r["sampler_contract"] for r in episodes.records.values()}
    if todo:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        engine = NativeEngine.from_pretrained(model_dir, cfg.rollout.native, device=device)
        envs = None
        if any(type(t).make_env is not Task.make_env for t in tasks.values()):
            from hybridrl.envs.client import LeasedEnvProvider
            from hybridrl.envs.service import EnvService

            env_cfg = dataclasses.replace(cfg.env, db_path=str(result_path.with_name(result_path.stem + ".envs.sqlite")),
                                          audit_log="")
            envs = LeasedEnvProvider(EnvService.from_config(env_cfg), env_cfg)
        names = sorted({t for _, inst in instances for t in inst.tools})
        bar = _Progress(f"eval {suite.name} ({label})", len(episodes.records) + len(todo), len(episodes.records),
                        enabled=progress)

        async def go():
            async with ToolBox.from_config(cfg.tools, names=names) as tools:
                runners = {s.name: AgentRunner(engine, tokenizer, agent_cfg=agent_config(cfg.agent, suite, s),
                                               tools=tools, run_id=f"eval-{suite.name}", seed=suite.seed, envs=envs)
                           for s in suite.spec.sampling}

                async def one(sampling, entry, inst, attempt):
                    runner = runners[sampling.name]
                    t = await runner.admit(inst, tasks[entry], attempt, f"{inst.task_id}@{sampling.name}", None,
                                            sampling.temperature)
                    record = record_of(t, task=inst.task, sampling=sampling.name)
                    episodes.add(record)
                    contracts.add(record["sampler_contract"])
                    bar.update()
                    if on_episode is not None:
                        on_episode(record)

                await asyncio.gather(*(one(*e) for e in todo))

        try:
            asyncio.run(go())
        finally:
            bar.close()
            engine.close()
            episodes.close()
    else:
        episodes.close()
    records = list(episodes.records.values())
    result = {
        "suite": suite.summary(), "instances_hash": header["instances"], "instances": len(instances),
        "tasks": suite.tasks(), "label": label,
        "model": {"path": str(model_dir), "hash": digest, **(model_info or {})},
        "sampler": {"engine": "native", "contracts": sorted(contracts), "seed": suite.seed,
                    "sampling": [dataclasses.asdict(s) for s in suite.spec.sampling],
                    "agent": {k: getattr(agent_config(cfg.agent, suite, suite.spec.sampling[0]), k)
                              for k in ("max_turns", "max_new_tokens_per_turn", "max_response_tokens", "max_episode_s",
                                        "on_turn_limit")}},
        "metrics": suite_metrics(suite, records), "digests": digests(records),
        "episodes": len(records), "episodes_resumed": episodes.resumed, "episodes_run": len(todo),
        "seconds": time.perf_counter() - started, "written_at": time.time(), "source": "cli",
    }
    write_result(result_path, result)
    return result


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
    os.replace(tmp, path)


class _Progress:
    """A tqdm bar on a terminal; a line per 10% of the episodes otherwise."""

    def __init__(self, name: str, total: int, done: int, *, enabled: bool):
        from tqdm import tqdm

        from hybridrl.telemetry.progress import LineProgress

        self.bar = tqdm(total=total, initial=done, desc=name, unit="episode", dynamic_ncols=True,
                        disable=None if enabled else True)
        self.lines = LineProgress(name, total, start=done, enabled=enabled and bool(self.bar.disable), unit="episode")
        self.done = done

    def update(self) -> None:
        self.done += 1
        self.bar.update(1)
        self.lines.update(self.done)

    def close(self) -> None:
        self.bar.close()
        sys.stderr.flush()
