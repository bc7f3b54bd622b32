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
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from hybridrl.config.fields import ConfigValueError


@dataclass
class Outcome:
    """What an agent returns: a reward of its own, or what the task's verifier scores."""

    reward: float | None = None          # the episode's reward; None: `task.score` scores the fields below
    answer: str | None = None            # the final answer (the calculator task compares it with the reference)
    num_answers: int | None = None       # None: 1 when there is an answer, else 0
    final_text: str | None = None        # None: the content of the last completion
    metadata: dict[str, Any] = field(default_factory=dict)   # kept in the trajectory's metadata (small values)


def is_budget_error(err: BaseException) -> bool:
    """True for the error a request past the episode's budgets raises in the OpenAI client."""
    body = getattr(err, "body", None)
    kind = body.get("type") if isinstance(body, dict) else None
    return getattr(err, "status_code", None) == 400 and (kind == "budget_exceeded"
                                                          or getattr(err, "type", None) == "budget_exceeded")


AgentFn = Callable[[Any, Any], Awaitable[Any]]


def load_agent(spec: str) -> AgentFn:
    """`module:function` (an async function of (client, instance)) or `module:Class` (its instances' async
    `run(client, instance)`, made here with no arguments), imported from the working directory or
    PYTHONPATH. Errors are `ConfigValueError`s naming `agent`."""
    obj = check_agent(spec)
    if inspect.isclass(obj):
        try:
            return obj().run
        except Exception as err:  # noqa: BLE001 - the user's constructor
            raise ConfigValueError("agent", f"{spec!r}() failed: {type(err).__name__}: {err}") from None
    return obj


def check_agent(spec: str) -> Any:
    """The function or class `spec` names, checked for the agent API's shape (nothing is called)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigValueError("agent", f"{spec!r} is not of the form 'module:function' (e.g. myagent:run)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module
        raise ConfigValueError("agent", f"cannot import {module_name!r} for task.agent={spec!r}: "
                                        f"{type(err).__name__}: {err}; run from the directory that holds it or "
                                        "add that directory to PYTHONPATH") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigValueError("agent", f"module {module_name!r} has no {attr!r}")
    fn = getattr(obj, "run", None) if inspect.isclass(obj) else obj
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ConfigValueError("agent", f"{spec!r} must be 'async def {attr}(client, instance)' or a class with "
                                        "'async def run(self, client, instance)'")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    need = 3 if inspect.isclass(obj) else 2
    if len(positional) < need and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigValueError("agent", f"{spec!r} takes (client, instance); it has {len(positional)} positional "
                                        "parameter(s)")
    return obj


# ---------------------------------------------------------------------------------------------------------
# hybridrl's tools from inside an agent


class EpisodeTools:
    """The tools an episode may call (its instance's), through the rank's ToolBox."""

    def __init__(self, box: Any, allowed: tuple[str, ...], episode_id: str, on_result: Callable[[Any], None]):
        from hybridrl.agent.actions import ToolAuthorizer

        self.box, self.episode_id, self.on_result = box, episode_id, on_result
        self.authorizer = ToolAuthorizer(box.specs, allowed)
        self.calls = 0

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        from hybridrl.agent.actions import ToolCall

        call = ToolCall(name, dict(arguments), "", "agent")
        problem = self.authorizer.check(call)
        if problem is not None:
            return f"error: {problem.message}"
        self.calls += 1
        result = await self.box.call(call, context={"episode": self.episode_id, "call": f"agent.{self.calls}"})
        self.on_result(result)
        return result.text


CURRENT_TOOLS: contextvars.ContextVar[EpisodeTools | None] = contextvars.ContextVar("hybridrl_episode_tools",
                                                                                     default=None)


async def call_tool(name: str, arguments: dict[str, Any]) -> str:
    """Run one of hybridrl's tools for the episode this agent runs (see the module doc)."""
    tools = CURRENT_TOOLS.get()
    if tools is None:
        raise RuntimeError("call_tool() runs inside an episode of hybridrl's gateway runner only")
    return await tools.call(name, arguments)
