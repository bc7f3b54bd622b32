"""Shared pieces of the agent-layer tests: scripted responders and small tools."""

from __future__ import annotations

import json

from hybridrl.agent.actions import ToolSpec
from hybridrl.agent.tools.base import ToolResult


def conversation(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def calculator_oracle(tokenizer, *, calls: int = 1):
    from hybridrl.agent.testing import calculator_oracle as oracle

    return oracle(tokenizer, calls=calls)


def script(*turns):
    """Respond with the given turns in order (the last one repeats)."""

    def respond(ids, turn):
        return turns[min(turn, len(turns) - 1)]

    return respond


def json_call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class FailingTool:
    """A tool whose implementation raises (an infrastructure fault, not the policy's)."""

    def __init__(self, name: str = "broken"):
        self.spec = ToolSpec(name, "always raises", {"type": "object", "properties": {}})

    async def __call__(self, arguments):
        raise RuntimeError("tool backend is down")


class EchoTool:
    def __init__(self, name: str = "echo"):
        self.spec = ToolSpec(name, "echo text", {"type": "object", "properties": {"text": {"type": "string"}},
                                                 "required": ["text"]})

    async def __call__(self, arguments):
        return ToolResult(arguments["text"], True)
