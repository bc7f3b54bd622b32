"""The agent API: an agent is the user's own code, written with the OpenAI client.

    # mymodule.py                                   task.agent: mymodule:run
    async def run(client: openai.AsyncOpenAI, instance: TaskInstance) -> float | Outcome:
        reply = await client.chat.completions.create(model="policy", messages=list(instance.messages), ...)
        ...
        return Outcome(answer=...)          # scored by the task's verifier; or a float: the reward itself

or a class with the same method (`task.agent: mymodule:MyAgent`, made once per rollout rank with no
arguments, `async def run(self, client, instance)`). Each episode gets its own client, pointed at the
gateway with a key that expires with the episode. A request past the episode's budgets raises
`openai.BadRequestError` with `err.code` the budget's name (`max_turns`, `max_new_tokens`,
`max_response_tokens`, `context`, `wall_clock`; `is_budget_error(err)`): return what you have, the
episode is TRUNCATED either way.

Tools the agent runs are its own code. `call_tool(name, arguments)` runs one of hybridrl's tools (the
ones the instance names, authorized and sandboxed like the built-in agent loop's) and returns its text.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Outcome:
    """What an agent returns: a reward of its own, or what the task's verifier scores."""

    reward: float | None = None          # the episode's reward; None: `task.score` scores the fields below
    answer: str | None = None            # the final answer (the calculator task compares it with the reference)
    num_answers: int | None = None       # None: 1 when there is an answer, else 0
    final_text: str | None = None        # None: the content of the last completion
    metadata: dict[str, Any] = field(default_factory=dict)   # kept in the trajectory's metadata (small values)
    # Which completion the episode ended on, when that is not clear from the requests (the last request
    # asked for n > 1 choices, or a side conversation ran beside the main one): the response's `id` and the
    # choice's `index`. The trajectory trains that completion's chain; see capture.EpisodeCapture.final.
    completion: str | None = None
    choice: int = 0


def is_budget_error(err: BaseException) -> bool:
    """True for the error a request past the episode's budgets raises in the OpenAI client."""
    body = getattr(err, "body", None)
    kind = body.get("type") if isinstance(body, dict) else None
    return getattr(err, "status_code", None) == 400 and (kind == "budget_exceeded"
                                                          or getattr(err, "type", None) == "budget_exceeded")


# ---------------------------------------------------------------------------------------------------------
# hybridrl's tools from inside an agent


class EpisodeTools:
    """The tools an episode may call (its instance's), through the rank's ToolBox."""

    def __init__(self, box: Any, allowed: tuple[str, ...], episode_id: str, on_result: Callable[[Any, str], None], *,
                 instance: Any = None):
        from hybridrl.agent.actions import ToolAuthorizer

        self.box, self.episode_id, self.on_result, self.instance = box, episode_id, on_result, instance
        self.authorizer = ToolAuthorizer(box.specs, allowed)
        self.calls = 0

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        from hybridrl.agent.actions import ToolCall

        call = ToolCall(name, dict(arguments), "", "agent")
        problem = self.authorizer.check(call)
        if problem is not None:
            return f"error: {problem.message}"
        self.calls += 1
        result = await self.box.call(call, context={"episode": self.episode_id, "call": f"agent.{self.calls}",
                                                    "instance": self.instance})
        self.on_result(result, name)
        return result.text


CURRENT_TOOLS: contextvars.ContextVar[EpisodeTools | None] = contextvars.ContextVar("hybridrl_episode_tools",
                                                                                     default=None)


async def call_tool(name: str, arguments: dict[str, Any]) -> str:
    """Run one of hybridrl's tools for the episode this agent runs (see the module doc)."""
    tools = CURRENT_TOOLS.get()
    if tools is None:
        raise RuntimeError("call_tool() runs inside an episode of hybridrl's gateway runner only")
    return await tools.call(name, arguments)
