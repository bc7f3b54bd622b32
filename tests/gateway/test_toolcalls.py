"""Turns into OpenAI messages, per model family."""

from __future__ import annotations

import json

from hybridrl.gateway.toolcalls import TurnParser, choose_parsers, split_reasoning
from tests.gateway.templates import LLAMA3, QWEN3, QWEN25


def args(turn):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls]


def test_auto_picks_the_family_from_the_template():
    from hybridrl.assets.tokenizer import CHAT_TEMPLATE

    assert choose_parsers("auto", "auto", QWEN25) == ("hermes", "none")
    assert choose_parsers("auto", "auto", QWEN3) == ("hermes", "think")
    assert choose_parsers("auto", "auto", LLAMA3) == ("llama3", "none")
    assert choose_parsers("auto", "auto", CHAT_TEMPLATE) == ("actions", "none")
    assert choose_parsers("none", "think", QWEN25) == ("none", "think")


def test_hermes_calls_content_and_malformed_blocks():
    p = TurnParser("hermes", "none")
    turn = p.parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n'
                   '</tool_call>\n<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>',
                   ["calculator", "search"], call_prefix="e/t0")
    assert args(turn) == [("calculator", {"expression": "1+2"}), ("search", {"q": "x"})]
    assert turn.content == "Let me compute." and turn.malformed == 0
    assert len({c["id"] for c in turn.tool_calls}) == 2 and all(c["type"] == "function" for c in turn.tool_calls)
    bad = p.parse("<tool_call>{not json}</tool_call>", ["calculator"], call_prefix="x")
    assert bad.tool_calls == [] and bad.malformed == 1 and "<tool_call>" in bad.content
    unknown = p.parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', ["calculator"], call_prefix="x")
    assert unknown.tool_calls == [] and "rm" in unknown.content
    assert p.parse('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', None, call_prefix="x").tool_calls == []


def test_llama3_json_calls():
    p = TurnParser("llama3", "none")
    one = p.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}', ["calculator"],
                  call_prefix="x")
    assert args(one) == [("calculator", {"expression": "2*3"})] and one.content is None
    two = p.parse('{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}}', ["a", "b"],
                  call_prefix="x")
    assert args(two) == [("a", {"s": "x;y"}), ("b", {})]
    prose = p.parse("The answer is 6.", ["calculator"], call_prefix="x")
    assert prose.tool_calls == [] and prose.content == "The answer is 6."


def test_actions_read_the_tasks_formats():
    p = TurnParser("actions", "none", action_formats=("calc", "json"))
    turn = p.parse("<calc>4821 * 37</calc>", ["calculator"], call_prefix="x")
    assert args(turn) == [("calculator", {"expression": "4821 * 37"})] and turn.content is None
    answer = p.parse("<answer>7</answer>", ["calculator"], call_prefix="x")
    assert answer.tool_calls == [] and answer.content == "<answer>7</answer>"


def test_reasoning_is_split_from_the_content():
    p = TurnParser("hermes", "think")
    turn = p.parse('<think>\nadd them\n</think>\n\n<tool_call>{"name": "calculator", "arguments": {"expression": '
                   '"1+1"}}</tool_call>', ["calculator"], call_prefix="x")
    assert turn.reasoning == "add them" and turn.content is None and len(turn.tool_calls) == 1
    assert turn.message()["reasoning_content"] == "add them"
    assert split_reasoning("<think>\nunfinished") == ("unfinished", "")
    assert split_reasoning("no thinking") == (None, "no thinking")
