"""The tool set is a registry: shipped tools by name, a tool of one's own by decorating its factory."""

from __future__ import annotations

import asyncio

import pytest

from hybridrl.agent.actions import ToolCall, ToolSpec
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.tools import ToolBox, ToolResult, register_tool, tool_names


class EchoTool:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.spec = ToolSpec("echo", "Repeat the text.", {"type": "object", "properties": {"text": {"type": "string"}},
                                                           "required": ["text"]})

    async def __call__(self, arguments):
        return ToolResult(self.prefix + arguments["text"], True)


@register_tool("echo")
def make_echo(cfg, box):
    return EchoTool(prefix=f"[{cfg.calculator_max_chars}] ")


def test_shipped_tools_are_listed_without_building_them():
    assert {"calculator", "python"} <= set(tool_names())
    box = ToolBox.from_config(ToolsConfig(), names=["calculator"])
    assert list(box.tools) == ["calculator"] and box.pool is None      # no sandbox unless a tool asks


def test_a_registered_tool_is_built_from_the_config_and_called():
    box = ToolBox.from_config(ToolsConfig(calculator_max_chars=7), names=["echo", "calculator"])
    result = asyncio.run(box.call(ToolCall("echo", {"text": "hi"}, raw="", format="json")))
    assert (result.text, result.ok) == ("[7] hi", True)


def test_an_unknown_tool_names_the_known_ones_and_how_to_add_one():
    with pytest.raises(ValueError, match=r"unknown tool 'weather'; known: .*'calculator'.*register_tool"):
        ToolBox.from_config(ToolsConfig(), names=["weather"])


def test_a_factory_must_make_the_tool_it_is_registered_as():
    @register_tool("misnamed")
    def make(cfg, box):
        return EchoTool("")

    with pytest.raises(ValueError, match="registered as tool 'misnamed' made a tool named 'echo'"):
        ToolBox.from_config(ToolsConfig(), names=["misnamed"])
