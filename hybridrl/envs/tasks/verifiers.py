"""A verifiers environment as a task (`task.name: verifiers`; `pip install -e .[verifiers]`, verifiers 0.4).

    task:
      name: verifiers
      options:
        environment: my_env:load_environment    # module:function, path/to/file.py:function, or a taskset id
        kwargs: {num_tasks: 2000}               # passed to the function (or the taskset's config)
        validation_kwargs: {split: test}        # optional: the eval taskset (else a held-out fraction)
        tools: [calculator]                     # hybridrl tools the episodes may call

verifiers 0.4 (`verifiers.v1`) splits an environment into a `Taskset` (its rows: `vf.Task`s, each with
`vf.TaskData` and `@vf.reward` / `@vf.metric` methods) and a harness (the agent program that plays a task in
its own runtime). hybridrl takes the taskset and plays the episodes itself, with the one episode engine
(exact tokens, budgets, tools in the sandbox, the ledger): `load_environment(**kwargs)` may return a
`vf.Taskset` or a `vf.Env` (its taskset is used), and a bare id names a taskset package (a module
exporting its `Taskset` subclass via `__all__`, as `vf.load_taskset` loads it).

Instances are the taskset's tasks (its `system_prompt` and `prompt`, in order; the task's `key` is the
instance id). The validation split is the taskset loaded with `kwargs | validation_kwargs` (a train task
with the key of a validation task is dropped), or, without `validation_kwargs`, a fixed hash partition of
the keys (`validation_fraction`). The reward is exactly the task's own scoring: the episode's messages
become a `vf.Trace` (the prompt, then each assistant turn as sampled, each tool result, each environment
message) and `vf.Task.score(trace)` runs its rewards and metrics (those that need a runtime are skipped,
as verifiers does without one). Each reward is a component with its own weight, so the total is the
weighted sum `trace.reward`; metrics are components of weight 0. `accuracy` names the reward that counts
as `correct` (validation accuracy) when the environment calls it something else.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_range
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task
from hybridrl.envs.tasks.registry import register_task
from hybridrl.registry import load_function
from hybridrl.reward import RewardResult

INSTALL = "pip install -e .[verifiers]   (or pip install 'verifiers>=0.4,<0.5')"
MAX_TASKS = 1 << 20          # read at most this many tasks of a taskset (an infinite one is cut here)


def package():
    """`verifiers.v1`, or a ConfigValueError saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigValueError("environment", f"task verifiers needs the verifiers package ({err}): {INSTALL}") from None
    return vf


def load_taskset(spec: str, kwargs: dict[str, Any], key: str = "environment") -> Any:
    """The `vf.Taskset` of `spec` called with `kwargs` (see the module doc); ConfigValueError naming `key`."""
    vf = package()
    try:
        if ":" not in spec:
            config_type = vf.taskset_config_type(spec)
            return vf.load_taskset(config_type.model_validate({**kwargs, "id": spec}))
        made = load_function(spec, key=key, purpose="the verifiers environment")(**kwargs)
    except ConfigValueError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's environment: its error is theirs to see
        raise ConfigValueError(key, f"loading the verifiers environment {spec!r} failed: {type(err).__name__}: "
                                    f"{err}") from None
    if isinstance(made, vf.Env):
        made = made.taskset
    if not isinstance(made, vf.Taskset):
        raise ConfigValueError(key, f"{spec} returned {type(made).__name__}, not a verifiers Taskset or Env "
                                    "(verifiers.v1)")
    return made


def held_out(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


def prompt_messages(data: Any) -> tuple[dict[str, str], ...]:
    """A `vf.TaskData`'s system prompt and prompt as chat messages (text content)."""
    from verifiers.v1.types import content_text

    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        out += [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
    if not out:
        raise ValueError(f"verifiers task {data.id or data.idx}: no prompt (the user opens the conversation); "
                         "hybridrl's episodes start from a prompt")
    return tuple(out)


def to_trace(vf: Any, task: Any, messages: list[dict[str, str]], num_prompt: int) -> Any:
    """The episode as a `vf.Trace` on one branch: the prompt's messages, then the episode's, the assistant
    turns marked sampled (what verifiers' own rollout records)."""
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(), name="hybridrl"))
    calls = 0
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "assistant":
            message = vf.AssistantMessage(content=content)
        elif role == "tool":
            message, calls = vf.ToolMessage(tool_call_id=f"call_{calls}", content=content), calls + 1
        elif role == "system":
            message = vf.SystemMessage(content=content)
        else:
            message = vf.UserMessage(content=content)
        trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=message,
                                          sampled=role == "assistant" and i >= num_prompt))
    return trace


class Scorer:
    """Runs the tasks' async scoring on a loop of its own (a daemon thread): `Task.score` is called from the
    episode engine's running loop, which must not block on a nested one."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, coro: Any, timeout_s: float) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="verifiers-scoring", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)


@dataclass(kw_only=True)
class VerifiersOptions:
    environment: str = ""             # module:function | path/file.py:function | taskset id
    kwargs: dict[str, Any] = field(default_factory=dict)
    validation_kwargs: dict[str, Any] = field(default_factory=dict)   # empty: hold out validation_fraction
    validation_fraction: float = 0.1
    tools: list[str] = field(default_factory=list)                    # hybridrl tools the instances may call
    accuracy: str = "correct"         # the reward that is validation accuracy
    score_timeout_s: float = 60.0     # one task's scoring

    def __post_init__(self) -> None:
        if not self.environment:
            raise ConfigValueError("environment", "task verifiers needs its environment: task.options.environment="
                                                  "module:load_environment (or file.py:function, or a taskset id)")
        check_range("validation_fraction", self.validation_fraction, 0.0, 0.9)
        if not self.validation_kwargs and self.validation_fraction == 0:
            raise ConfigValueError("validation_fraction", "no validation: set validation_kwargs (the eval "
                                                          "taskset), or hold out a fraction (validation_fraction > 0)")
        if self.score_timeout_s <= 0:
            raise ConfigValueError("score_timeout_s", f"must be > 0, got {self.score_timeout_s}")
        load_taskset(self.environment, dict(self.kwargs))


@register_task
class VerifiersTask(Task):
    name = "verifiers"
    version = 1
    Options = VerifiersOptions
    action_formats = ("calc", "json")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.vf = package()
        self.evaluator = f"verifiers:{self.options.environment}@{_version()}"
        self._splits: dict[str, list[TaskInstance]] = {}
        self._tasks: dict[str, Any] = {}            # instance id -> its vf.Task
        self._scorer = Scorer()

    # ------------------------------------------------------------------ instances

    def _read(self, kwargs: dict[str, Any]) -> list[Any]:
        taskset = load_taskset(self.options.environment, kwargs)
        return list(taskset if taskset.bounded else taskset.take(MAX_TASKS))

    def rows(self, split: str) -> list[TaskInstance]:
        """Every instance of `split`, in the taskset's order."""
        if not self._splits:
            o = self.options
            train = self._read(dict(o.kwargs))
            if o.validation_kwargs:
                val = self._read({**o.kwargs, **o.validation_kwargs})
                keys = {t.key for t in val}
                train = [t for t in train if t.key not in keys]
            else:
                val = [t for t in train if held_out(t.key, o.validation_fraction)]
                train = [t for t in train if not held_out(t.key, o.validation_fraction)]
            for name, tasks in (("train", train), ("validation", val)):
                if not tasks:
                    raise ValueError(f"task verifiers: the {name} split of {o.environment} is empty")
                self._splits[name] = [self._instance(t) for t in tasks]
        return self._splits[split]

    def _instance(self, task: Any) -> TaskInstance:
        task_id = "vf-" + task.key[:16]
        self._tasks[task_id] = task
        answer = task.data.model_dump().get("answer")    # a verifiers TaskData may carry one (or not)
        return TaskInstance(task=self.name, task_id=task_id, messages=prompt_messages(task.data),
                            reference="" if answer is None else str(answer), tools=tuple(self.options.tools),
                            metadata={"key": task.key, "idx": task.data.idx})

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        rows = list(self.rows(split))
        rng.shuffle(rows)
        return rows[: min(n, len(rows))]

    def sft_demonstrations(self, n: int, seed: int | None = None, **_: Any) -> list[list[dict[str, str]]]:
        """None: a verifiers taskset has prompts and rewards, no solutions (warm-start on another task)."""
        return []

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        raise ValueError("a verifiers taskset has no demonstrations")

    # ------------------------------------------------------------------ the reward

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        if instance.task_id not in self._tasks:
            self.rows("train")
        task = self._tasks[instance.task_id]
        messages = [dict(m) for m in outcome.messages] or \
            [*instance.messages, {"role": "assistant", "content": outcome.final_text}]
        trace = to_trace(self.vf, task, messages, len(instance.messages))
        self._scorer.run(task.score(trace), self.options.score_timeout_s)
        return reward_of(trace, self.options.accuracy, self.evaluator)


def reward_of(trace: Any, accuracy: str, evaluator: str) -> RewardResult:
    """The trace's rewards (each with its weight: the total is `trace.reward`) and metrics (weight 0). A reward
    that did not run (None) raises: the engine makes that an evaluator error, never trained on."""
    result = RewardResult()
    missing = [name for name, r in trace.rewards.items() if r is None]
    if missing:
        raise ValueError(f"the verifiers rewards {missing} did not score")
    for name, r in trace.rewards.items():
        result.add(name, r.score, evaluator, weight=r.weight)
    for name, value in trace.metrics.items():
        if value is not None and name not in result.rewards:
            result.add(name, value, evaluator, weight=0.0)
    if accuracy != "correct" and accuracy in result.rewards:
        result.add("correct", result.rewards[accuracy], evaluator, weight=0.0)
    return result


def _version() -> str:
    from importlib.metadata import version

    return version("verifiers")
