"""What the gateway checks of a request before anything else runs: every malformed field is a 400 naming it.

The agent's input and the model's output are different things. A request the agent sent that is malformed
(a wrong type, a lone surrogate in its text, a body nested past the limit, a body or a text too large) is
refused here with a clear message and never becomes an infrastructure fault of the episode; what the model
wrote is parsed leniently elsewhere (toolcalls.py: a call that does not parse is a malformed call, scored).
Sizes are checked before any tokenizing: a body over `gateway.max_body_kb` is not read past the limit, and a
request whose text is longer than `gateway.max_request_chars` is refused before the chat template runs.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from hybridrl.agent.actions import nesting_depth
from hybridrl.gateway.episodes import GatewayError

MAX_DEPTH = 64                 # JSON nesting of a request body
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
_NUMBERS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INTEGERS = ("n", "max_tokens", "max_completion_tokens", "seed", "top_k", "top_logprobs")
_FLAGS = ("stream", "echo", "parallel_tool_calls")
# JSON's \\u escape of a UTF-16 surrogate (U+D800-U+DFFF): the only way a UTF-8 body can hold one (a
# false positive, an escaped backslash before "ud8..", only costs the full walk)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        text: str | None = raw.decode("utf-8-sig")   # decoded UTF-8 holds no lone surrogate: the codec refuses one
    except UnicodeDecodeError:
        text = None                              # UTF-16/32 (json.loads reads those too), or not text at all
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and \
            nesting_depth(text if text is not None else raw.decode("utf-8", "replace")) > MAX_DEPTH:
        raise GatewayError(400, f"the request body is nested deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(raw if text is None else text)
    except (ValueError, RecursionError):
        raise GatewayError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    if text is None or _SURROGATE_ESCAPE.search(text):     # else no string of it can hold a lone surrogate
        _check_text(body, "body")
    return body


def check_request(body: Mapping[str, Any], *, chat: bool, max_chars: int, body_bytes: int | None = None) -> None:
    """Types of every field the gateway reads, and the request's text length (before tokenizing). `body_bytes`,
    the body's size, bounds its text (a character of a JSON string is at least one byte of the body): the
    text is counted only in a body larger than `max_chars`."""
    for key in _NUMBERS:
        if body.get(key) is not None and not _is_number(body[key]):
            raise GatewayError(400, f"'{key}' must be a number, got {_kind(body[key])}", param=key)
    for key in _INTEGERS:
        if body.get(key) is not None and not _is_int(body[key]):
            raise GatewayError(400, f"'{key}' must be an integer, got {_kind(body[key])}", param=key)
    for key in _FLAGS:
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise GatewayError(400, f"'{key}' must be true or false, got {_kind(body[key])}", param=key)
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], (bool, int)):
        raise GatewayError(400, f"'logprobs' must be a boolean, got {_kind(body['logprobs'])}", param="logprobs")
    for key in ("stream_options", "response_format", "chat_template_kwargs", "metadata"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise GatewayError(400, f"'{key}' must be an object, got {_kind(body[key])}", param=key)
    if chat:
        _check_messages(body.get("messages"))
        _check_tools(body.get("tools"))
        _check_tool_choice(body.get("tool_choice"))
    size = 0 if body_bytes is not None and body_bytes <= max_chars else \
        _text_size(body.get("messages") if chat else body.get("prompt"))
    if size > max_chars:
        raise GatewayError(400, f"the request holds {size} characters of text, more than gateway.max_request_chars="
                                f"{max_chars}: it cannot fit the model's context", type="budget_exceeded",
                           code="context", param="messages" if chat else "prompt")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "'messages' must be a non-empty list of messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise GatewayError(400, f"messages[{i}] must be an object with a 'role' in {list(ROLES)}",
                               param=f"messages[{i}]")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise GatewayError(400, f"messages[{i}].content must be a string or a list of text parts, got "
                                    f"{_kind(content)}", param=f"messages[{i}].content")
        for call in m.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise GatewayError(400, f"messages[{i}].tool_calls[] must each hold a 'function' object with a "
                                        "'name'", param=f"messages[{i}].tool_calls")


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise GatewayError(400, f"'tools' must be a list, got {_kind(tools)}", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise GatewayError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                               param=f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise GatewayError(400, f"tools[{i}].function.parameters must be an object", param=f"tools[{i}]")


def _check_tool_choice(choice: Any) -> None:
    if choice is None or choice in ("none", "auto", "required"):
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise GatewayError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'function': {'name': ...}}", param="tool_choice")


def _check_text(value: Any, where: str) -> None:
    """Every string of the body is valid Unicode (JSON's \\ud800 escapes can make a lone surrogate)."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise GatewayError(400, f"{at} holds text that is not valid Unicode (a lone surrogate)",
                                   param=at) from None
        elif isinstance(item, dict):
            stack += [(v, f"{at}.{k}") for k, v in item.items()] + [(k, f"{at} key") for k in item]
        elif isinstance(item, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(item)]


def _text_size(value: Any) -> int:
    stack, size = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            stack += list(item.values())
        elif isinstance(item, list):
            stack += item
    return size


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {str: "a string", bool: "a boolean", dict: "an object", list: "a list"}.get(type(value), type(value).__name__)
