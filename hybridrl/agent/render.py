"""A conversation through the model's chat template, at the template's own cost for plain conversations.

`tokenizer.apply_chat_template` first rebuilds every message into plain data (objects to dicts, None
values dropped, every string and number copied, reasoning fields aliased), then renders the compiled
Jinja template with the tokenizer's special-token strings. For a conversation that is already plain (each
message a role and a string content, no tools, no template options) the rebuilding changes nothing and
costs more than the rendering (about 35 of 55 us for a 4-turn conversation). `ChatRenderer` renders such
conversations with transformers' own compiled template and the same variables; anything else goes through
`apply_chat_template`.

It is exact by check, not by assumption: at construction both paths render a few plain conversations
(with and without the generation prompt) and the fast one is kept only if they are equal; its first
`SHADOW_CHECKS` renders are compared with `apply_chat_template` too, and one difference turns it off for
good (logged). Without transformers' template compiler (another version) there is no fast path.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

SHADOW_CHECKS = 16
_PLAIN_KEYS = frozenset(("role", "content"))
_PROBES = ([{"role": "user", "content": "What is 12 * 34?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a <answer>1</answer>"}, {"role": "user", "content": "naïve 東京\n\n"}],
           [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "408"}])


class ChatRenderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.fast_renders = 0
        self._shadow = SHADOW_CHECKS
        self._compiled, self._variables = _compiled(tokenizer)
        if self._compiled is not None and not all(
                self._fast(list(p), g) == self._slow(list(p), None, g, {}) for p in _PROBES for g in (True, False)):
            self._compiled = None

    @property
    def fast(self) -> bool:
        return self._compiled is not None

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, options: Mapping[str, Any] | None = None) -> str:
        """The template's text of `messages` (what `apply_chat_template(..., tokenize=False)` returns)."""
        plain = None if tools or options or self._compiled is None else _plain(messages)
        if plain is None:
            return self._slow(messages, tools, add_generation_prompt, options or {})
        text = self._fast(plain, add_generation_prompt)
        if self._shadow > 0:
            self._shadow -= 1
            if text != self._slow(messages, None, add_generation_prompt, {}):
                log.warning("the chat template renders a conversation differently than apply_chat_template "
                            "does; every conversation goes through apply_chat_template from now on")
                self._compiled = None
                return self._slow(messages, None, add_generation_prompt, {})
        self.fast_renders += 1
        return text

    def _fast(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._compiled.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._variables)

    def _slow(self, messages: Sequence[Mapping[str, Any]], tools: Any, add_generation_prompt: bool,
              options: Mapping[str, Any]) -> str:
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **dict(options))


def _plain(messages: Sequence[Mapping[str, Any]]) -> list[dict] | None:
    """`messages` as the template would see them, if each is a role and a string content (None values
    dropped, as transformers drops them); None if any message is anything else."""
    out = []
    for m in messages:
        if type(m) is not dict:
            return None
        message = {k: v for k, v in m.items() if v is not None}
        if message.keys() - _PLAIN_KEYS or type(message.get("role")) is not str \
                or type(message.get("content", "")) is not str:
            return None
        out.append(message)
    return out


def _compiled(tokenizer: Any) -> tuple[Any, dict]:
    """transformers' compiled template of the tokenizer and the variables it renders with, or (None, {})."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None, {}
    try:
        source = tokenizer.get_chat_template()
        variables = dict(tokenizer.special_tokens_map)
        if not all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
                   for v in variables.values()):
            return None, {}
        return _compile_jinja_template(source), variables
    except Exception:  # noqa: BLE001 - no template, or one this version cannot compile: the slow path says why
        return None, {}
