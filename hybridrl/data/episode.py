"""The records an episode is made of, shared by tasks, environments and the agent loop.

`TaskInstance` is one prompt of a task (what the agent is asked, and the reference it is scored
against), `Transition` is one step of a stateful environment, `EpisodeOutcome` is what the agent
loop hands a task's verifier at the end. They import nothing of hybridrl, so the config loader,
the tasks, the environment service and the agent loop can all use them without importing one
another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True, kw_only=True)
class TaskInstance:
    """One prompt of a task: immutable, serialisable (`to_dict`/`from_dict`)."""

    task: str                                   # registry name of the task that made it
    task_id: str                                # stable id (a hash of the content)
    messages: tuple[Mapping[str, str], ...]     # the prompt: system / user messages
    reference: str                              # the expected answer (never shown to tools)
    tools: tuple[str, ...] = ()                 # tools this instance may call
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["messages"] = [dict(m) for m in self.messages]
        d["tools"] = list(self.tools)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TaskInstance":
        return cls(task=d["task"], task_id=d["task_id"], messages=tuple(dict(m) for m in d["messages"]),
                   reference=d["reference"], tools=tuple(d.get("tools", ())),
                   metadata=dict(d.get("metadata", {})))


@dataclass
class EpisodeOutcome:
    """What the agent loop hands to `Task.score` at the end of an episode."""

    answer: str | None              # content of the first <answer> of the final turn
    num_answers: int                # <answer> tags in the final turn
    final_text: str                 # decoded final assistant turn
    completed: bool                 # ended on its own (not by a budget / failure)
    env_return: float = 0.0         # sum of environment rewards (stateful tasks)
    num_turns: int = 0
    num_tool_calls: int = 0
    messages: tuple[Mapping[str, str], ...] = ()   # the whole episode as chat messages (prompt first), where kept


@dataclass
class Transition:
    """One step of a stateful environment: what the agent sees next, the reward, whether it ended."""

    observation: str | None = None   # shown to the model (untrusted text) unless None
    reward: float = 0.0
    done: bool = False
    role: str = "user"               # chat role of the observation message
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"observation": self.observation, "reward": self.reward, "done": self.done, "role": self.role,
                "info": self.info}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Transition":
        return cls(d.get("observation"), float(d.get("reward", 0.0)), bool(d.get("done", False)),
                   d.get("role", "user"), dict(d.get("info", {})))
