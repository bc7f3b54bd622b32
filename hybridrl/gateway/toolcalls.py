"""A generated turn as an OpenAI assistant message: reasoning, content and `tool_calls`, per model family.

Parsers (`gateway.tool_parser`):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes and
  the hybridrl tiny model's `json` action format); the text outside them is the content.
- `llama3`: the turn (after an optional `<|python_tag|>`) is a JSON object `{"name": ..., "parameters":
  {...}}` (or `arguments`), or several separated by `;`.
- `actions`: the task's action formats, read by hybridrl's own action parser (`<calc>expr</calc>` is a
  call of the calculator with {"expression": expr}; `<tool_call>` JSON as above).
- `none`: no tool calls.
Reasoning (`gateway.reasoning_parser=think`): text up to `</think>` (without a leading `<think>`) is
`reasoning_content`, the rest the content; a turn that opened `<think>` and never closed it is all
reasoning.

Only calls of tools the request lists become `tool_calls` (a request without `tools` gets none); a
block that does not parse stays in the content and is counted as malformed. The text parsed is the model's; what the agent sends back is
matched to it by the capture (`capture.py`), so nothing here has to round-trip.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ParsedTurn:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out


def choose_parsers(tool_parser: str, reasoning_parser: str, template_source: str) -> tuple[str, str]:
    """`auto` resolved from the chat template's source."""
    if tool_parser == "auto":
        if "<tool_call>" in template_source:
            tool_parser = "hermes"
        elif "<|python_tag|>" in template_source or "ipython" in template_source:
            tool_parser = "llama3"
        else:
            tool_parser = "actions"
    if reasoning_parser == "auto":
        reasoning_parser = "think" if "<think>" in template_source else "none"
    return tool_parser, reasoning_parser


class TurnParser:
    def __init__(self, tool_parser: str, reasoning_parser: str, *, action_formats: Sequence[str] = ("json",)):
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.action_formats = tuple(action_formats)

    def parse(self, text: str, tool_names: Iterable[str] | None, *, call_prefix: str,
              action_formats: Sequence[str] | None = None) -> ParsedTurn:
        """`tool_names`: the request's tools (None or empty: no tool calls are parsed); `action_formats`: the
        episode's task's (the `actions` parser), else the parser's own. Whatever the model wrote, this returns
        a turn: a call that does not parse (bad JSON, nesting past the limit, text that is not valid
        Unicode) is left in the content and counted as malformed, never an error of the gateway."""
        reasoning = None
        if self.reasoning_parser == "think":
            reasoning, text = split_reasoning(text)
        names = set(tool_names or ())
        turn = ParsedTurn(text)
        if names and self.tool_parser != "none":
            formats = tuple(action_formats) if action_formats is not None else self.action_formats
            parse = {"hermes": _hermes, "llama3": _llama3,
                     "actions": lambda t, n: _actions(t, n, formats)}[self.tool_parser]
            calls, rest, malformed = parse(text, names)
            turn = ParsedTurn(rest, tool_calls=[_openai_call(name, args, f"{call_prefix}.{i}")
                                                for i, (name, args) in enumerate(calls)], malformed=malformed)
        turn.reasoning = reasoning
        if turn.tool_calls and not (turn.content or "").strip():
            turn.content = None
        return turn


def _actions(text: str, names: set[str], formats: Sequence[str]) -> tuple[list, str, int]:
    from hybridrl.agent.actions import ActionParser

    parsed = ActionParser(formats).parse(text)
    calls, rest, malformed = [], text, sum(e.kind == "malformed" for e in parsed.errors)
    for call in parsed.calls:
        if call.name in names:
            if not _plain(call.arguments):
                malformed += 1
                continue
            calls.append((call.name, call.arguments))
            rest = rest.replace(call.raw, "", 1)
    return calls, rest.strip(), malformed


def split_reasoning(text: str) -> tuple[str | None, str]:
    if "</think>" in text:
        head, _, rest = text.partition("</think>")
        return head.split("<think>", 1)[-1].strip("\n"), rest.lstrip("\n")
    if text.lstrip().startswith("<think>"):
        return text.lstrip()[len("<think>"):].strip("\n"), ""
    return None, text


def _hermes(text: str, names: set[str]) -> tuple[list, str, int]:
    calls, malformed = [], 0
    rest = text
    for match in _HERMES.finditer(text):
        call = _json_call(match.group(1), ("arguments",))
        if call is None:
            malformed += 1
            continue
        if call[0] in names:
            calls.append(call)
            rest = rest.replace(match.group(0), "", 1)
    return calls, rest.strip(), malformed


def _llama3(text: str, names: set[str]) -> tuple[list, str, int]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return [], text, 0
    calls = [_json_call(part, ("parameters", "arguments")) for part in _split_objects(body)]
    if any(c is None for c in calls):
        return [], text, 1
    kept = [c for c in calls if c[0] in names]
    return (kept, "", 0) if len(kept) == len(calls) else ([], text, 0)


def _split_objects(body: str) -> list[str]:
    """JSON objects separated by ';' (Llama-3 parallel calls), split outside strings."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def _load(text: str) -> Any:
    """JSON the model wrote, or None: nesting past the limit, bad JSON, or text that is not valid Unicode (a
    lone surrogate) are all malformed calls."""
    from hybridrl.agent.actions import MAX_JSON_DEPTH, nesting_depth

    if nesting_depth(text) > MAX_JSON_DEPTH:
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if _plain(obj) else None


def _plain(obj: Any) -> bool:
    """Whether `obj` encodes as UTF-8 JSON (no lone surrogates in any string, no nesting past the limit)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError, ValueError, TypeError):
        return False
    return True


def _json_call(body: str, argument_keys: Sequence[str]) -> tuple[str, dict] | None:
    obj = _load(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):
        args = _load(args) if args.strip() else {}
    return (obj["name"], args) if isinstance(args, dict) else None


def _openai_call(name: str, arguments: dict, seed: str) -> dict[str, Any]:
    return {"id": "call_" + hashlib.sha256(seed.encode()).hexdigest()[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
