"""A task from a data file and a score function (`task.name: data`), veRL-style.

    task:
      name: data
      options:
        path: data/train.jsonl             # JSONL, Parquet, or a `datasets` dataset saved to disk
        score: my_score:compute_score      # module:function or path/to/file.py:function
        validation_fraction: 0.1           # held out of `path` (or validation_path: a second file)

A row: the chat (`messages`, or veRL's `prompt`) and the ground truth (`answer`, or veRL's
`reward_model.ground_truth`), optionally extra info (`info`, or veRL's `extra_info`) and veRL's
`data_source`, handed to the score function. The prompt is the chat up to its first assistant
message; the assistant turns (and tool turns between them), when a row has them, are its
demonstration: `hybridrl sft` trains on them (`sft.data`, or with no `sft.data` this task's
demonstrations), on the assistant tokens only.

The score function has veRL's signature, `compute_score(solution_str, ground_truth, extra_info)`
(by keyword when it names those parameters, `data_source` too; else positionally), called with the
text of the episode's final assistant turn. A float is the reward (component `correct`); a dict
needs `score` (the reward) and each other numeric entry is recorded as a component of weight 0,
`correct` being the dict's `correct`, else its `acc`, else the score (what accuracy reports). No
`score`: 1 when the final `<answer>` equals the ground truth (both stripped).

Held-out rows are a fixed hash partition of the prompts (`validation_fraction`), so a split does
not depend on the file's order or on the split sizes; identical prompts are one instance.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hybridrl.config.fields import ConfigValueError, check_range
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task
from hybridrl.envs.tasks.registry import register_task
from hybridrl.reward import RewardResult

ROLES = ("system", "user", "assistant", "tool")
ANSWER = ("<answer>", "</answer>")     # the agent loop's answer tags


# ------------------------------------------------------------------ reading rows


def read_rows(path: str, *, key: str = "path") -> list[dict]:
    """The rows of a JSONL (.jsonl / .json lines), Parquet file, or a `datasets` dataset saved to disk
    (a DatasetDict: its `train` split). Raises ConfigValueError naming `key` when it cannot."""
    p = Path(path)
    if not path or not p.exists():
        raise ConfigValueError(key, f"no such file or directory: {path!r} (relative paths are from the "
                                    f"working directory, {Path.cwd()})")
    if p.is_dir():
        return _read_saved_dataset(p, key)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConfigValueError(key, f"{path}:{n} is not JSON ({err.msg}): one JSON object per line") from None
    return rows


def datasets_package(p: Path, key: str):
    """The `datasets` module, or a ConfigValueError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise ConfigValueError(key, f"{p} is a directory: reading a dataset saved with `datasets` needs that "
                                    "package: pip install -e .[data] (or pip install datasets), or give a JSONL / "
                                    "Parquet file") from None
    return datasets


def _read_saved_dataset(p: Path, key: str) -> list[dict]:
    datasets = datasets_package(p, key)

    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigValueError(key, f"{p} holds splits {list(loaded)}, none named train: save one split, or "
                                        "the train split as train")
        loaded = loaded["train"]
    return [dict(r) for r in loaded]


def row_messages(row: dict, where: str) -> list[dict[str, str]]:
    messages = row.get("messages", row.get("prompt"))
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: no chat: a row needs `messages` (or veRL's `prompt`), a list of "
                         "{role, content}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {m!r} is not {{role: {'|'.join(ROLES)}, content: text}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def row_answer(row: dict) -> Any:
    if "answer" in row:
        return row["answer"]
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return None


def prompt_of(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    roles = [m["role"] for m in messages]
    return messages[: roles.index("assistant")] if "assistant" in roles else messages


def held_out(prompt: list[dict[str, str]], fraction: float) -> bool:
    """The fixed partition: a prompt is validation when its hash falls below `fraction`."""
    digest = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


def demonstrations(path: str, validation_fraction: float = 0.0, *, key: str = "data") -> list[list[dict]]:
    """The chats of `path` that have an assistant turn and are not held out (SFT's rows)."""
    out = []
    for n, row in enumerate(read_rows(path, key=key)):
        messages = row_messages(row, f"{path} row {n}")
        if any(m["role"] == "assistant" for m in messages) and not held_out(prompt_of(messages),
                                                                             validation_fraction):
            out.append(messages)
    if not out:
        raise ConfigValueError(key, f"no row of {path} has an assistant message outside the held-out rows: SFT "
                                    "trains on the rows' assistant turns (messages with role assistant)")
    return out


# ------------------------------------------------------------------ the score function


def load_score(spec: str, key: str = "score") -> Callable[..., Any]:
    """`module:function` (importable from the working directory or PYTHONPATH) or `file.py:function`."""
    from hybridrl.registry import load_function

    return load_function(spec, key=key, purpose="the score function")


def call_score(fn: Callable[..., Any], solution: str, ground_truth: Any, info: dict, data_source: str) -> Any:
    """veRL's call: by keyword when the function names solution_str (data_source too), else positionally."""
    params = inspect.signature(fn).parameters
    if "solution_str" in params:
        kwargs = {"solution_str": solution, "ground_truth": ground_truth, "extra_info": info,
                  "data_source": data_source}
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        return fn(**{k: v for k, v in kwargs.items() if takes_all or k in params})
    return fn(solution, ground_truth, info)


def reward_of(value: Any, evaluator: str) -> RewardResult:
    """A score function's return value as reward components (see the module doc). A value that is not a
    finite number raises: the agent loop makes that an evaluator error (never trained on)."""
    result = RewardResult()
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"the score function returned a dict without 'score': {sorted(value)}")
        result.add("score", finite("score", value["score"]), evaluator)
        correct = value.get("correct", value.get("acc", value["score"]))
        result.add("correct", finite("correct", correct), evaluator, weight=0.0)
        for k, v in value.items():
            if k not in ("score", "correct") and isinstance(v, (int, float)):
                result.add(k, finite(k, v), evaluator, weight=0.0)
        return result
    return result.add("correct", finite("score", value), evaluator)


def finite(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"the score function's {name} is {value!r}, not a number") from None
    if not math.isfinite(out):
        raise ValueError(f"the score function's {name} is {out}: a reward must be finite")
    return out


def exact_answer(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The default score: 1 when the final <answer>...</answer> equals the ground truth (both stripped)."""
    start = solution_str.rfind(ANSWER[0])
    end = solution_str.find(ANSWER[1], start)
    if start < 0 or end < 0:
        return 0.0
    return float(solution_str[start + len(ANSWER[0]): end].strip() == str(ground_truth).strip())


# ------------------------------------------------------------------ the task


@dataclass(kw_only=True)
class DataOptions:
    path: str = ""                    # JSONL / Parquet / a saved `datasets` dataset
    score: str = ""                   # module:function or file.py:function; empty: exact <answer> match
    validation_path: str = ""         # a second file for validation; empty: held out of `path`
    validation_fraction: float = 0.1  # of `path`'s prompts held out (a fixed hash partition)
    tools: list[str] = field(default_factory=list)   # tools the instances may call
    data_source: str = ""             # for a score function taking data_source, where a row has none; empty: the file name

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigValueError("path", "task data needs its file: task.options.path=FILE.jsonl (rows of "
                                           "messages + answer)")
        check_range("validation_fraction", self.validation_fraction, 0.0, 0.9)
        for key in ("path", "validation_path"):
            if getattr(self, key) and not Path(getattr(self, key)).exists():
                raise ConfigValueError(key, f"no such file or directory: {getattr(self, key)!r} (relative paths "
                                            f"are from the working directory, {Path.cwd()})")
            if getattr(self, key) and Path(getattr(self, key)).is_dir():
                datasets_package(Path(getattr(self, key)), key)
        if not self.validation_path and self.validation_fraction == 0:
            raise ConfigValueError("validation_fraction", "no validation: set validation_path, or hold out a "
                                                          "fraction of path (validation_fraction > 0)")
        if self.score:
            load_score(self.score)


@register_task
class DataTask(Task):
    name = "data"
    version = 1
    Options = DataOptions
    action_formats = ("calc", "json")

    def __init__(self, cfg):
        super().__init__(cfg)
        o = self.options
        self.fn = load_score(o.score) if o.score else exact_answer
        self.evaluator = f"{o.score or 'exact_answer'}@{self.version}"
        self.data_source = o.data_source or Path(o.path).name
        self._rows: dict[str, list[TaskInstance]] = {}

    def rows(self, split: str) -> list[TaskInstance]:
        """Every instance of `split` (distinct prompts, in file order)."""
        if split not in self._rows:
            o = self.options
            path, key = (o.validation_path, "validation_path") if split == "validation" and o.validation_path \
                else (o.path, "path")
            fraction = 0.0 if o.validation_path else o.validation_fraction
            want_held = split == "validation" and not o.validation_path
            out: dict[str, TaskInstance] = {}
            for n, row in enumerate(read_rows(path, key=key)):
                inst = self.instance(row, f"{path} row {n}")
                if held_out(list(inst.messages), fraction) == want_held:
                    out.setdefault(inst.task_id, inst)
            if not out:
                raise ValueError(f"task data: the {split} split of {path} is empty (validation_fraction="
                                 f"{o.validation_fraction})")
            self._rows[split] = list(out.values())
        return self._rows[split]

    def instance(self, row: dict, where: str) -> TaskInstance:
        messages = row_messages(row, where)
        answer = row_answer(row)
        if answer is None:
            raise ValueError(f"{where}: no ground truth: a row needs `answer` (or veRL's reward_model.ground_truth)")
        info = row.get("info", row.get("extra_info")) or {}
        prompt = prompt_of(messages)
        key = json.dumps([prompt, answer], sort_keys=True, default=str)
        return TaskInstance(task=self.name, task_id="data-" + hashlib.sha1(key.encode()).hexdigest()[:12],
                            messages=tuple(prompt), reference=answer if isinstance(answer, str) else json.dumps(answer),
                            tools=tuple(self.options.tools),
                            metadata={"ground_truth": answer, "info": info, "demonstration": messages[len(prompt):],
                                      "data_source": row.get("data_source") or self.data_source})

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        rows = list(self.rows(split))
        rng.shuffle(rows)
        return rows[: min(n, len(rows))]

    def sft_demonstrations(self, n: int, seed: int | None = None, **_: Any) -> list[list[dict[str, str]]]:
        """The train rows that have assistant turns, as they are in the file (`n` of them, cycled); none
        when no row has one (a file of prompts and answers is for RL only: `hybridrl sft` says so)."""
        rows = [i for i in self.make_instances(len(self.rows("train")), random.Random(f"data/sft/{seed}"), "train")
                if i.metadata["demonstration"]]
        return [self.demonstration(rows[k % len(rows)], None, use_tool=True, guess_correct=True)
                for k in range(n if rows else 0)]

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        return [dict(m) for m in instance.messages] + [dict(m) for m in instance.metadata["demonstration"]]

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        value = call_score(self.fn, outcome.final_text, instance.metadata["ground_truth"],
                           dict(instance.metadata["info"]), instance.metadata["data_source"])
        return reward_of(value, self.evaluator)


