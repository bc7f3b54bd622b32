"""Action parsing and authorization: model output never raises, it becomes errors."""

from __future__ import annotations

import pytest

from hybridrl.agent.actions import ActionParser, ToolAuthorizer, ToolCall, ToolSpec, validate_arguments
from tests.agent.helpers import json_call

CALC = ToolSpec("calculator", "math", {"type": "object", "properties": {"expression": {"type": "string",
                                                                                       "maxLength": 10}},
                                       "required": ["expression"]})
SEARCH = ToolSpec("search", "web", {"type": "object", "properties": {"q": {"type": "string"},
                                                                     "k": {"type": "integer", "minimum": 1,
                                                                           "maximum": 5},
                                                                     "mode": {"enum": ["a", "b"]}}})


def test_both_formats_and_the_answer_in_order():
    text = f"think <calc> 12*034 </calc> then {json_call('search', q='x', k=2)} <answer> 408 </answer><answer>1</answer>"
    turn = ActionParser().parse(text)
    assert [c.name for c in turn.calls] == ["calculator", "search"]
    assert turn.calls[0].arguments == {"expression": "12*034"} and turn.calls[0].format == "calc"
    assert turn.calls[1].arguments == {"q": "x", "k": 2} and turn.calls[1].raw.startswith("<tool_call>")
    assert turn.answer == "408" and turn.num_answers == 2 and not turn.errors


def test_formats_can_be_restricted():
    turn = ActionParser(["json"]).parse("<calc>1+1</calc>")
    assert not turn.calls and not turn.has_action
    with pytest.raises(ValueError, match="unknown action formats"):
        ActionParser(["xml"])


@pytest.mark.parametrize("text, words", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "c", "arguments": "{bad"}</tool_call>', "string that is not valid JSON"),
    ('<tool_call>{"name": "c", "arguments": {}, "x": 1}</tool_call>', "unexpected keys"),
    ("<calc>1+2", "never closed"),
    ('<tool_call>{"name": "c"', "never closed"),
])
def test_malformed_calls_are_errors_not_exceptions(text, words):
    turn = ActionParser().parse(text)
    assert not turn.calls and len(turn.errors) == 1
    assert turn.errors[0].kind == "malformed" and words in turn.errors[0].message, turn.errors[0].message
    assert turn.has_action


def test_arguments_as_a_json_string():
    turn = ActionParser().parse('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')
    assert turn.calls[0].arguments == {"expression": "1"}


def test_authorizer_checks_allow_list_and_schema():
    auth = ToolAuthorizer({"calculator": CALC, "search": SEARCH}, allowed=["calculator", "nonexistent"])
    assert auth.allowed == ("calculator",)
    ok = ToolCall("calculator", {"expression": "1+1"}, "", "calc")
    assert auth.check(ok) is None
    err = auth.check(ToolCall("search", {"q": "x"}, "raw", "json"))
    assert err.kind == "unauthorized" and "available here; available: calculator" in err.message
    err = auth.check(ToolCall("calculator", {"expression": "1" * 11}, "", "calc"))
    assert err.kind == "invalid_arguments" and "longer than 10" in err.message


@pytest.mark.parametrize("args, words", [
    ({}, None), ({"q": 1}, "must be of type string"), ({"k": True}, "must be of type integer"),
    ({"k": 0}, ">= 1"), ({"k": 9}, "<= 5"), ({"mode": "c"},
                                             "one of ['a', 'b']"), ({"z": 1}, "unknown argument 'z'"),
])
def test_schema_subset(args, words):
    problem = validate_arguments(SEARCH.parameters, args)
    assert (problem is None) if words is None else (words in problem), problem
    assert validate_arguments(CALC.parameters, {}) == "missing required argument 'expression'"


def test_hostile_json_is_a_malformed_call_never_an_exception():
    """What json.loads raises besides JSONDecodeError, and what no tokenizer can encode."""
    from hybridrl.agent.actions import MAX_JSON_DEPTH, nesting_depth

    parser = ActionParser()
    deep = parser.parse("<tool_call>" + "[" * 100_000 + "</tool_call>")            # RecursionError in json
    assert deep.errors[0].kind == "malformed" and f"more than {MAX_JSON_DEPTH}" in deep.errors[0].message
    nested_string = parser.parse('<tool_call>{"name": "calculator", "arguments": "' + "{" * 5000 + '"}</tool_call>')
    assert "not valid JSON" in nested_string.errors[0].message
    huge = parser.parse('<tool_call>{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>")
    assert "more than 1000 digits" in huge.errors[0].message                      # ValueError in json (int limit)
    surrogate = parser.parse('<tool_call>{"name": "echo\\ud800", "arguments": {"\\udfff": "a\\ud800"}}</tool_call>')
    [call] = surrogate.calls
    assert call.name == "echo\ufffd" and call.arguments == {"\ufffd": "a\ufffd"}
    (call.name + "".join(call.arguments) + "".join(call.arguments.values())).encode("utf-8")
    assert nesting_depth('{"a": "[[[[", "b": [{"c": "\\"]"}]}') == 3             # brackets in strings do not count
    ok = parser.parse('<tool_call>{"name": "calculator", "arguments": {"n": 12, "deep": [[[1]]]}}</tool_call>')
    assert ok.calls[0].arguments == {"n": 12, "deep": [[[1]]]}


def test_long_names_are_quoted_short():
    from hybridrl.agent.actions import ToolAuthorizer

    auth = ToolAuthorizer({"calculator": ToolSpec("calculator", "", {"type": "object", "properties": {}})},
                          ["calculator"])
    [call] = ActionParser().parse('<tool_call>{"name": "' + "x" * 10_000 + '"}</tool_call>').calls
    assert len(auth.check(call).message) < 300
    [call] = ActionParser().parse('<tool_call>{"name": "calculator", "arguments": {"' + "k" * 10_000
                                  + '": 1}}</tool_call>').calls
    assert len(auth.check(call).message) < 300
