"""Evaluation suites: a named, versioned, hashed list of what to evaluate and how.

    configs/eval/calc_demo.yaml
        suite: calc_demo
        version: 1
        description: ...
        entries:                       # each: a task, a split, a seed range, a size, the task's options
          - {task: calculator, split: validation, seeds: "0", size: 128}
        sampling:                      # every entry runs under every sampling
          - {name: greedy, temperature: 0.0, samples: 1}
          - {name: sampled, temperature: 1.0, samples: 8}
        pass_k: [1, 4, 8]
        metrics: [accuracy, pass@k, reward, tool_calls, length]
        agent: {max_turns: 3, max_new_tokens_per_turn: 32, max_response_tokens: 96}   # the episode budgets

An entry's instances are the task's own split, drawn with each seed of `seeds` ("0", "0-3" or
"0,5,7") from the task built with the entry's options, deduplicated by instance id. The suite's
hash covers its whole definition; the instances' hash covers every instance id and expected answer
(so a task whose generator changed gives another hash even under the same suite file). Results
record both, the model's hash and the sampler contract: two results are comparable when their
suite and instance hashes agree.

A suite is found by name in `configs/eval/` or given as a path to its YAML file.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, items_of

SUITES_DIR = Path(__file__).resolve().parents[2] / "configs" / "eval"
METRICS = ("accuracy", "pass@k", "reward", "tool_calls", "length")
SPLITS = ("validation", "train")


class SuiteError(ValueError):
    """A suite that cannot be loaded or run: one line naming the file and the key."""


@dataclass(kw_only=True)
class Sampling:
    """How one pass over the suite samples: `samples` episodes per instance at `temperature`."""

    name: str
    temperature: float = 0.0
    samples: int = 1
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigValueError("name", f"a sampling needs a name without '/', got {self.name!r}")
        check_positive("temperature", self.temperature, allow_zero=True)
        check_positive("samples", self.samples)
        if self.temperature == 0 and self.samples > 1:
            raise ConfigValueError("samples", f"{self.samples} greedy samples of one instance are the same episode: "
                                              "use temperature > 0 for pass@k")


@dataclass(kw_only=True)
class SuiteEntry:
    """One task's share of a suite."""

    task: str
    split: str = "validation"
    seeds: str = "0"
    size: int = 64
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("split", self.split, SPLITS)
        check_positive("size", self.size)
        seed_list(self.seeds)

    def task_config(self, seed: int) -> Any:
        from hybridrl.envs.config import TaskConfig

        return TaskConfig(name=self.task, seed=seed, options=dict(self.options), validation_size=self.size,
                          train_size=self.size)


@dataclass(kw_only=True)
class SuiteSpec:
    suite: str
    version: int = 1
    description: str = ""
    entries: list[SuiteEntry] = field(default_factory=list)
    sampling: list[Sampling] = field(default_factory=list)
    pass_k: list[int] = field(default_factory=lambda: [1])
    metrics: list[str] = field(default_factory=lambda: list(METRICS))
    agent: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.entries = items_of(SuiteEntry, "entries", self.entries)
        self.sampling = items_of(Sampling, "sampling", self.sampling)
        if not self.suite or "/" in self.suite:
            raise ConfigValueError("suite", f"a suite needs a name without '/', got {self.suite!r}")
        if not self.entries:
            raise ConfigValueError("entries", "a suite needs at least one entry (task, split, seeds, size)")
        if not self.sampling:
            raise ConfigValueError("sampling", "a suite needs at least one sampling (name, temperature, samples)")
        names = [s.name for s in self.sampling]
        if len(set(names)) != len(names):
            raise ConfigValueError("sampling", f"sampling names must differ, got {names}")
        for k in self.pass_k:
            check_positive("pass_k", k)
        for m in self.metrics:
            if m not in METRICS:
                raise ConfigValueError("metrics", f"unknown metric {m!r}; known: {', '.join(METRICS)}")
        from hybridrl.agent.config import AgentConfig

        known = {f.name for f in dataclasses.fields(AgentConfig)}
        for key in self.agent:
            if key not in known or key == "temperature":
                hint = difflib.get_close_matches(key, sorted(known), n=1)
                why = ("the temperature is the sampling's" if key == "temperature"
                       else f"not an agent key{f'; did you mean {hint[0]!r}?' if hint else ''}")
                raise ConfigValueError(f"agent.{key}", why)


def seed_list(text: str | int) -> list[int]:
    """'0' -> [0]; '0-3' -> [0, 1, 2, 3]; '0,5,7' -> [0, 5, 7]."""
    out: list[int] = []
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise ConfigValueError("seeds", f"{text!r} is not a seed range: write '0', '0-3' or '0,5,7'") from None
    if not out:
        raise ConfigValueError("seeds", f"{text!r} names no seed")
    return out


@dataclass
class Suite:
    """A loaded suite: its definition, where it came from and its hash."""

    spec: SuiteSpec
    source: str

    @property
    def name(self) -> str:
        return self.spec.suite

    @property
    def definition(self) -> dict[str, Any]:
        return dataclasses.asdict(self.spec)

    @property
    def hash(self) -> str:
        blob = json.dumps(self.definition, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def seed(self) -> int:
        """The seed of the suite's episodes: its own space, derived from the suite and never a run's seed."""
        return int.from_bytes(hashlib.sha256(f"hybridrl-eval/{self.hash}".encode()).digest()[:4], "little") >> 1

    def instances(self) -> list[tuple[int, Any]]:
        """(entry index, TaskInstance) for every instance of the suite, in entry order; an id that two
        entries both draw is refused (it would count twice)."""
        from hybridrl.envs.tasks import get_task

        out: list[tuple[int, Any]] = []
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.spec.entries):
            for seed in seed_list(entry.seeds):
                task = get_task(entry.task, entry.task_config(seed))
                split = task.validation_split if entry.split == "validation" else task.train_split
                for inst in split(entry.size, seed):
                    if inst.task_id in seen:
                        if seen[inst.task_id] != i:
                            raise SuiteError(f"{self.source}: entries {seen[inst.task_id]} and {i} both hold "
                                             f"instance {inst.task_id}: make their seeds or options differ")
                        continue
                    seen[inst.task_id] = i
                    out.append((i, inst))
        return out

    def tasks(self) -> list[str]:
        return list(dict.fromkeys(e.task for e in self.spec.entries))

    def summary(self) -> dict[str, Any]:
        """What a result records of its suite."""
        return {"name": self.name, "version": self.spec.version, "hash": self.hash, "source": self.source}


def instances_hash(instances: Sequence[Any]) -> str:
    """A hash of every instance's id and expected answer (sorted): the same suite file over a task whose
    generator changed hashes differently. The answers themselves are not recoverable from it."""
    h = hashlib.sha256()
    for inst in sorted(instances, key=lambda x: x.task_id):
        h.update(f"{inst.task}\t{inst.task_id}\t{inst.reference}\n".encode())
    return h.hexdigest()[:16]


def suite_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise SuiteError(f"no suite file {path}")
        return path
    candidate = SUITES_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = suite_names()
    close = difflib.get_close_matches(str(name_or_path), names, n=1)
    raise SuiteError(f"no suite {str(name_or_path)!r}: {f'did you mean {close[0]!r}? ' if close else ''}the suites in "
                     f"{SUITES_DIR} are {', '.join(names) or 'none'} (or give a path to a suite's YAML file)")


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.yaml")) if SUITES_DIR.is_dir() else []


def is_suite(name_or_path: str) -> bool:
    """Whether `name_or_path` names a suite (a name in configs/eval/, or a YAML file whose top key is `suite`)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(path.read_text()) if path.is_file() else None
        except yaml.YAMLError:
            return False
        return isinstance(data, dict) and "suite" in data
    return (SUITES_DIR / f"{name_or_path}.yaml").is_file()


def load_suite(name_or_path: str | Path) -> Suite:
    """The suite named (configs/eval/NAME.yaml) or at a path; every key typed and checked."""
    from hybridrl.config.loader import structured

    path = suite_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SuiteError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise SuiteError(f"{path}: a suite is a mapping with keys suite, entries, sampling, ...")
    known = [f.name for f in dataclasses.fields(SuiteSpec)]
    for key in data:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise SuiteError(f"{path}: unknown key {key!r}{f'; did you mean {hint[0]!r}?' if hint else ''} "
                             f"(a suite's keys: {', '.join(known)})")
    for list_key, cls in (("entries", SuiteEntry), ("sampling", Sampling)):
        for i, item in enumerate(data.get(list_key) or []):
            fields = [f.name for f in dataclasses.fields(cls)]
            for key in item if isinstance(item, dict) else ():
                if key not in fields:
                    raise SuiteError(f"{path}: {list_key}[{i}].{key}: unknown key (an item's keys: {', '.join(fields)})")
    try:
        spec = structured(SuiteSpec, data)
        for entry in spec.entries:                   # the task exists and takes these options
            entry.task_config(seed_list(entry.seeds)[0])
    except ConfigValueError as err:
        raise SuiteError(f"{path}: {err.field + ': ' if err.field else ''}{err}") from None
    return Suite(spec, str(path))
