"""Actions: parse an assistant turn into tool calls / a final answer, and authorize calls.

Formats (a task picks the ones it accepts):
- `json`: `<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>`
  (`arguments` may also be a JSON-encoded string, as some chat models emit it);
- `calc`: `<calc>12*34</calc>`, shorthand for the calculator tool;
- the final answer: `<answer>...</answer>`.

Nothing here raises on model output: a malformed or unauthorized call becomes an
`ActionError` whose message is shown to the model as an observation and counted. That covers
what would otherwise escape as an exception and make the episode INFRA_INVALID (a reward dodge):
JSON nested deeper than `MAX_JSON_DEPTH` (checked before parsing, so no RecursionError), integers
longer than `MAX_JSON_DIGITS` (Python's int-string limit), and lone surrogates (`"\\ud800"`, which no
tokenizer can encode: replaced by U+FFFD in every parsed string). Names and keys quoted back to
the model are shortened.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

FORMATS = ("json", "calc")
_TAGS = {"json": ("<tool_call>", "</tool_call>"), "calc": ("<calc>", "</calc>")}
ANSWER_TAGS = ("<answer>", "</answer>")
MAX_JSON_DEPTH = 64         # nesting of a tool call's JSON ([ and {)
MAX_JSON_DIGITS = 1000      # digits of an integer in a tool call's JSON
_QUOTE = 64                 # characters of a name quoted back in an error message
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str            # the tagged text it came from
    format: str


@dataclass(frozen=True)
class ActionError:
    message: str        # shown to the model, prefixed with "error: "
    raw: str
    kind: str           # "malformed" | "unauthorized" | "invalid_arguments" | "too_many_calls"
    tool: str = "?"     # the tool it named, when it named one


@dataclass(frozen=True)
class ParsedTurn:
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ActionError, ...] = ()
    answer: str | None = None
    num_answers: int = 0

    @property
    def has_action(self) -> bool:
        return bool(self.calls or self.errors)


class ActionParser:
    """Scan a turn left to right for the tags of the accepted formats and the answer tag."""

    def __init__(self, formats: Iterable[str] = FORMATS, *, calc_tool: str = "calculator"):
        self.formats = tuple(formats)
        unknown = set(self.formats) - set(FORMATS)
        if unknown:
            raise ValueError(f"unknown action formats {sorted(unknown)}; known: {list(FORMATS)}")
        self.calc_tool = calc_tool
        self._open = {_TAGS[f][0]: f for f in self.formats}
        self._open[ANSWER_TAGS[0]] = "answer"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[ActionError] = []
        answers: list[str] = []
        pos = 0
        while True:
            found = [(text.find(tag, pos), tag) for tag in self._open]
            found = [(i, tag) for i, tag in found if i >= 0]
            if not found:
                break
            start, tag = min(found)
            kind = self._open[tag]
            close = ANSWER_TAGS[1] if kind == "answer" else _TAGS[kind][1]
            end = text.find(close, start + len(tag))
            if end < 0:
                raw = text[start:]
                errors.append(ActionError(f"{tag} is never closed with {close}", raw, "malformed"))
                break
            body = text[start + len(tag):end]
            raw = text[start:end + len(close)]
            pos = end + len(close)
            if kind == "answer":
                answers.append(body.strip())
            elif kind == "calc":
                calls.append(ToolCall(self.calc_tool, {"expression": body.strip()}, raw, "calc"))
            else:
                call = _parse_json_call(body, raw)
                (calls if isinstance(call, ToolCall) else errors).append(call)  # type: ignore[arg-type]
        return ParsedTurn(tuple(calls), tuple(errors), answers[0] if answers else None, len(answers))


def _parse_json_call(body: str, raw: str) -> ToolCall | ActionError:
    obj, problem = _loads(body)
    if problem:
        return ActionError(f"tool call is not valid JSON ({problem})", raw, "malformed")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ActionError('tool call must be a JSON object with a string "name"', raw, "malformed")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        args, problem = _loads(args) if args.strip() else ({}, None)
        if problem:
            return ActionError(f'"arguments" is a string that is not valid JSON ({problem})', raw, "malformed")
    if not isinstance(args, dict):
        return ActionError('"arguments" must be a JSON object', raw, "malformed")
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return ActionError(f"unexpected keys in tool call: {sorted(quote(k) for k in extra)}", raw, "malformed")
    return ToolCall(obj["name"], args, raw, "json")


class _TooManyDigits(ValueError):
    pass


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_DIGITS:
        raise _TooManyDigits(f"an integer has more than {MAX_JSON_DIGITS} digits")
    return int(text)


def _loads(text: str) -> tuple[Any, str | None]:
    """(the JSON value of `text`, its strings made encodable; None) or (None, why it has none)."""
    depth = nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        return None, f"nested {depth} deep, more than {MAX_JSON_DEPTH}"
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as err:
        return None, f"{err.msg} at character {err.pos}"
    except _TooManyDigits as err:
        return None, str(err)
    except (ValueError, RecursionError) as err:       # whatever else the decoder refuses
        return None, type(err).__name__
    return _encodable(value), None


def nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, outside strings (no parsing, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _encodable(value: Any) -> Any:
    """`value` with lone surrogates in its strings (and keys) replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    return value


def quote(name: str) -> str:
    """A name as an error message quotes it: at most `_QUOTE` characters."""
    return name if len(name) <= _QUOTE else name[:_QUOTE] + f"... ({len(name)} characters)"


# ---------------------------------------------------------------------------------------------
# authorization


@dataclass(frozen=True)
class ToolSpec:
    """A tool's public description; `parameters` is a JSON-schema object (the subset below)."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_json(self) -> dict[str, Any]:
        """The entry rendered into the chat template's `tools` list."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


def validate_arguments(schema: Mapping[str, Any], args: Mapping[str, Any]) -> str | None:
    """Check `args` against an object schema (properties, required, types, maxLength, enum,
    minimum/maximum; additional properties are refused). Returns an error message or None."""
    props: Mapping[str, Any] = schema.get("properties", {})
    for name in schema.get("required", ()):
        if name not in args:
            return f"missing required argument '{name}'"
    for name, value in args.items():
        if name not in props:
            return f"unknown argument '{quote(name)}'; expected {sorted(props)}"
        rule = props[name]
        want = rule.get("type")
        py = _JSON_TYPES.get(want) if want else None
        if py is not None and (not isinstance(value, py) or (want in ("integer", "number")
                                                             and isinstance(value, bool))):
            return f"argument '{name}' must be of type {want}, got {type(value).__name__}"
        if "maxLength" in rule and isinstance(value, str) and len(value) > rule["maxLength"]:
            return f"argument '{name}' is longer than {rule['maxLength']} characters"
        if "enum" in rule and value not in rule["enum"]:
            return f"argument '{name}' must be one of {list(rule['enum'])}"
        if "minimum" in rule and isinstance(value, (int, float)) and value < rule["minimum"]:
            return f"argument '{name}' must be >= {rule['minimum']}"
        if "maximum" in rule and isinstance(value, (int, float)) and value > rule["maximum"]:
            return f"argument '{name}' must be <= {rule['maximum']}"
    return None


class ToolAuthorizer:
    """Which tools an episode may call (the task's allow-list among the registered tools),
    and whether a call's arguments fit the tool's schema."""

    def __init__(self, specs: Mapping[str, ToolSpec], allowed: Iterable[str]):
        self.specs = dict(specs)
        self.allowed = tuple(name for name in allowed if name in self.specs)

    def check(self, call: ToolCall) -> ActionError | None:
        if call.name not in self.allowed:
            offer = ", ".join(self.allowed) or "none"
            return ActionError(f"tool '{quote(call.name)}' is not available here; available: {offer}", call.raw,
                               "unauthorized", call.name)
        problem = validate_arguments(self.specs[call.name].parameters, call.arguments)
        if problem:
            return ActionError(f"{call.name}: {problem}", call.raw, "invalid_arguments", call.name)
        return None
