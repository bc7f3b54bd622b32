"""reasoning-gym's procedural datasets as a task (`task.name: reasoning_gym`; `pip install -e .[reasoning-gym]`).

    task:
      name: reasoning_gym
      options:
        datasets:                     # one or more of reasoning_gym's registered generators
          - {name: chain_sum, weight: 1, config: {min_terms: 2, max_terms: 3, min_digits: 2, max_digits: 3}}
        tools: [calculator]           # optional: tools the instances may call

Instances are the package's own items (`reasoning_gym.create_dataset(name, seed=s, size=CHUNK, **config)[i]`;
most generators draw item i from `Random(s + i)`). Splits by seed range: seeds are cut into blocks of
`SPAN`, validation takes the even blocks and train the odd ones (block pair `task.seed % PAIRS`), so the
generators' seeds of the two splits never meet, whatever their sizes; a train question that is also a
validation question (a small generator repeats itself) is dropped as well. An instance records
(dataset, chunk seed, index), and the entry is generated again to score it: the reward is exactly the
dataset's `score_answer(extract_answer(final turn), entry)` (the component `correct`, with the
package's own `extract_answer`: the last `<answer>`), plus `task.format_weight` x `format`.
Several datasets share `train_size` / `validation_size` by weight; in a `task.mixture` the whole
task is one entry (its share is the curriculum's), its datasets split it by their weights.
Demonstrations (SFT) answer directly; with the calculator allowed and an `expression` in the item's
metadata (chain_sum, basic_arithmetic, ...) a `sft_tool_use_fraction` of them call it first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hybridrl.config.fields import ConfigValueError
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task
from hybridrl.envs.tasks.registry import register_task
from hybridrl.reward import AnswerFormat, RewardResult

INSTALL = "pip install -e .[reasoning-gym]   (or pip install reasoning-gym)"
SPAN = 1 << 22          # generator seeds per split block
PAIRS = 1 << 9          # block pairs: seeds stay below 2**32 (some generators seed numpy with them)
CHUNK = 256             # items per generator object (a few generators build `size` items up front)


def package():
    """The reasoning_gym module, or a ConfigValueError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ConfigValueError("datasets", f"task reasoning_gym needs the reasoning-gym package ({err}): "
                                           f"{INSTALL}") from None
    return reasoning_gym


def split_base(seed: int, split: str) -> int:
    """The first generator seed of `split`'s block: validation even blocks, train odd ones."""
    return (2 * (seed % PAIRS) + (split == "train")) * SPAN


@dataclass(kw_only=True)
class DatasetEntry:
    """One generator of `task.options.datasets`."""

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)   # the generator's own config (not seed / size)


@dataclass(kw_only=True)
class ReasoningGymOptions:
    datasets: list[dict[str, Any]] = field(default_factory=list)   # [{name, weight, config}]
    tools: list[str] = field(default_factory=list)                 # tools the instances may call
    system_prompt: str = ""       # text, or a name of reasoning_gym.utils.SYSTEM_PROMPTS; empty: none

    def __post_init__(self) -> None:
        rg = package()
        if not self.datasets:
            raise ConfigValueError("datasets", "name at least one reasoning-gym dataset: "
                                               "datasets=[{name: chain_sum, weight: 1, config: {}}]")
        entries = [check_entry(i, d) for i, d in enumerate(self.datasets)]
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ConfigValueError("datasets", f"a dataset appears twice: {names} (one entry each)")
        self.datasets = [dataclasses.asdict(e) for e in entries]
        self.system_prompt = rg.utils.SYSTEM_PROMPTS.get(self.system_prompt, self.system_prompt)


def check_entry(i: int, item: Any) -> DatasetEntry:
    """`datasets[i]` as a DatasetEntry whose generator exists and accepts its config."""
    from reasoning_gym.factory import DATASETS

    key = f"datasets[{i}]"
    if not isinstance(item, dict) or set(item) - {"name", "weight", "config"} or "name" not in item:
        raise ConfigValueError(key, f"must be {{name, weight, config}}, got {item!r}")
    entry = DatasetEntry(name=str(item["name"]), weight=float(item.get("weight", 1.0)),
                         config=dict(item.get("config") or {}))
    if entry.name not in DATASETS:
        import difflib

        hint = difflib.get_close_matches(entry.name, DATASETS, n=1)
        raise ConfigValueError(f"{key}.name", f"no reasoning-gym dataset {entry.name!r}"
                                              + (f"; did you mean {hint[0]!r}?" if hint else "")
                                              + f" (it has {len(DATASETS)}: reasoning_gym.factory.DATASETS)")
    if entry.weight <= 0:
        raise ConfigValueError(f"{key}.weight", f"must be > 0, got {entry.weight}")
    if {"seed", "size"} & set(entry.config):
        raise ConfigValueError(f"{key}.config", "seed and size are the task's (task.seed, task.train_size / "
                                                "validation_size): leave them out")
    try:
        make_dataset(entry.name, _frozen(entry.config), 0, CHUNK)     # (validation's first chunk at task.seed 0)
    except Exception as err:  # noqa: BLE001 - the generator's config class / validate() says what is wrong
        raise ConfigValueError(f"{key}.config", f"reasoning-gym refused it: {type(err).__name__}: {err}") from None
    return entry


def _frozen(config: dict) -> tuple:
    return tuple(sorted((k, _hashable(v)) for k, v in config.items()))


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return ("__dict__", _frozen(value))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__dict__":
        return {k: _thawed(v) for k, v in value[1]}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@lru_cache(maxsize=64)
def make_dataset(name: str, config: tuple, seed: int, size: int):
    """The package's dataset object (cached: scoring regenerates an item from the same object)."""
    return package().create_dataset(name, seed=seed, size=size, **{k: _thawed(v) for k, v in config})


@register_task
class ReasoningGymTask(Task):
    name = "reasoning_gym"
    version = 1
    Options = ReasoningGymOptions
    action_formats = ("calc", "json")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.format = AnswerFormat()
        self.entries = {d["name"]: DatasetEntry(**d) for d in self.options.datasets}
        self._validation: dict[int, set[str]] = {}

    # ------------------------------------------------------------------ instances

    def _split(self, split: str, n: int, seed: int) -> list[TaskInstance]:
        from hybridrl.envs.tasks.mixture import shares

        counts = shares({k: e.weight for k, e in self.entries.items()}, n)
        exclude = self.validation_questions(self.cfg.seed) if split == "train" else set()
        out = [inst for name, k in counts.items() if k for inst in self.draw(name, k, split, seed, exclude)]
        random.Random(f"{self.name}/{split}/{seed}").shuffle(out)
        return out

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        return self._split(split, n, rng.randrange(PAIRS))

    def validation_questions(self, seed: int) -> set[str]:
        """The questions of the validation split of `seed` (train leaves task.seed's out, whatever its seed)."""
        if seed not in self._validation:
            n = self.cfg.validation_size
            self._validation[seed] = {i.messages[-1]["content"] for i in self._split("validation", n, seed)}
        return self._validation[seed]

    def draw(self, name: str, n: int, split: str, seed: int, exclude: set[str]) -> list[TaskInstance]:
        """`n` distinct questions of dataset `name` from `split`'s seed block, none in `exclude`."""
        entry = self.entries[name]
        config = _frozen(entry.config)
        base, out, seen, tried = split_base(seed, split), [], set(exclude), 0
        while len(out) < n:
            if tried >= 50 * n + 1000 or tried >= SPAN:
                raise ValueError(f"reasoning-gym dataset {name!r} gave {len(out)} distinct questions of the {n} "
                                 f"asked in {tried} draws: its config allows too few; widen it or ask fewer")
            chunk_seed, index = base + tried // CHUNK * CHUNK, tried % CHUNK
            tried += 1
            item = make_dataset(name, config, chunk_seed, CHUNK)[index]
            if item["question"] in seen:
                continue
            seen.add(item["question"])
            out.append(self.instance(name, item, chunk_seed, index))
        return out

    def instance(self, name: str, item: dict, chunk_seed: int, index: int) -> TaskInstance:
        system = self.options.system_prompt
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": item["question"]})
        digest = hashlib.sha1(f"{name}\n{item['question']}".encode()).hexdigest()[:12]
        expression = (item.get("metadata") or {}).get("expression")
        return TaskInstance(task=self.name, task_id=f"rg-{name}-{digest}", messages=tuple(messages),
                            reference=str(item["answer"]), tools=tuple(self.options.tools),
                            metadata={"dataset": name, "seed": chunk_seed, "size": CHUNK, "index": index,
                                      "expression": expression if isinstance(expression, str) else None})

    def entry(self, instance: TaskInstance) -> tuple[Any, dict]:
        """(the package's dataset object, the item) that `instance` was made from."""
        m = instance.metadata
        dataset = make_dataset(m["dataset"], _frozen(self.entries[m["dataset"]].config), int(m["seed"]),
                               int(m["size"]))
        return dataset, dataset[int(m["index"])]

    # ------------------------------------------------------------------ SFT and reward

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        from hybridrl.envs.arithmetic import calculate
        from hybridrl.envs.tasks.calculator import near_miss

        chat = [dict(m) for m in instance.messages]
        expr, answer = instance.metadata.get("expression"), instance.reference
        if use_tool and expr and "calculator" in instance.tools:
            value, ok = calculate(expr)
            if ok:
                return chat + [{"role": "assistant", "content": f"<calc>{expr}</calc>"},
                               {"role": "tool", "content": value},
                               {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
        guess = answer
        if not guess_correct and answer.lstrip("-").isdigit():
            guess = near_miss(int(answer), rng)
        return chat + [{"role": "assistant", "content": f"<answer>{guess}</answer>"}]

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        from importlib.metadata import version

        from reasoning_gym.utils import extract_answer

        dataset, item = self.entry(instance)
        if item["question"] != instance.messages[-1]["content"]:      # scored against another entry: refuse
            raise ValueError(f"reasoning-gym dataset {instance.metadata['dataset']!r} gave another item for the same "
                             "seed and index: its generator is not deterministic, so its answers cannot be scored")
        value = dataset.score_answer(extract_answer(outcome.final_text), item)
        result = RewardResult()
        result.add("correct", float(value),
                   f"reasoning_gym.{instance.metadata['dataset']}@{version('reasoning-gym')}")
        result.add("format", self.format(outcome.answer, outcome.num_answers, outcome.completed), self.format.id,
                   weight=self.cfg.format_weight)
        return result
