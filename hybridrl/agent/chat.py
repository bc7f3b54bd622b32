"""Token ids from the model's chat template, without ever re-encoding what the model generated.

- `prompt_ids(messages)`: the prompt rendered once (with the generation prompt).
- `observation_ids(messages, after_eos)`: the ids to append after an assistant turn so that the
  sequence continues exactly as the template renders "assistant turn, then these messages,
  then the next assistant header": the rest of the assistant message's closing (what follows
  the EOS the model generated, e.g. "\\n" in ChatML; the whole closing if the turn did not end
  with EOS) and the messages themselves. They are computed as the difference of two templated
  conversations tokenized in full, so BPE merges at the boundaries are the template's own.
- `sanitize(text)`: untrusted observation text with the tokenizer's special / added token
  strings defused (`<|im_end|>` becomes `&lt;|im_end|>`), control characters removed and a
  length cap, so a tool cannot forge turns or tags.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from hybridrl.agent.codec import TokenCodec
from hybridrl.agent.render import ChatRenderer

_BASE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class ChatFormat:
    def __init__(self, tokenizer: Any, *, eos_token_ids: Iterable[int] | None = None):
        self.tokenizer = tokenizer
        self.codec = TokenCodec(tokenizer)
        self.renderer = ChatRenderer(tokenizer)
        eos = set(eos_token_ids or ())
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        if not eos:
            raise ValueError("the tokenizer has no EOS token and none was given")
        self.eos_ids = frozenset(eos)
        base_text = self.render(_BASE, add_generation_prompt=False)
        self._base_text = base_text
        self._base_ids = self.encode(base_text)
        closing = [i for i, t in enumerate(self._base_ids) if t in self.eos_ids]
        if not closing:
            raise ValueError("the chat template does not end an assistant message with an EOS token; "
                             "token-in-token-out observation deltas need one")
        self._close_ids = self._base_ids[closing[-1]:]        # [EOS, what the template adds after it]
        self._specials = sorted({str(t) for t in tokenizer.get_added_vocab()}, key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return self.renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]], *,
                   tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def observation_ids(self, messages: Sequence[Mapping[str, str]], *, after_eos: bool) -> list[int]:
        full_text = self.render([*_BASE, *messages], add_generation_prompt=True)
        if not full_text.startswith(self._base_text):
            raise ValueError("the chat template renders a conversation differently once messages are added")
        full = self.encode(full_text)
        n = len(self._base_ids)
        if full[:n] != self._base_ids:
            raise ValueError("tokenizing the templated conversation is not prefix-stable at the message boundary")
        closing = self._close_ids[1:] if after_eos else self._close_ids
        return list(closing) + full[n:]

    def conversation_ids(self, messages: Sequence[Mapping[str, str]], *,
                         tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """A full conversation laid out exactly as the agent loop builds episodes (token in, token
        out): the prompt rendered once (up to the first assistant turn), each assistant turn as its
        content's ids + EOS (mask 1, what the policy emits), each run of other messages as the
        template's observation delta (mask 0). Returns (ids, mask); what SFT trains on."""
        roles = [m["role"] for m in messages]
        if "assistant" not in roles:
            raise ValueError("a training conversation needs at least one assistant turn")
        first = roles.index("assistant")
        ids = self.prompt_ids(messages[:first], tools=tools)
        mask = [0] * len(ids)
        eos = self.tokenizer.eos_token_id
        i = first
        while i < len(messages):
            turn = self.encode(messages[i]["content"]) + [eos]
            ids += turn
            mask += [1] * len(turn)
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j > i + 1:
                obs = self.observation_ids(messages[i + 1: j], after_eos=True)
                ids += obs
                mask += [0] * len(obs)
            i = j
        return ids, mask

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids for parsing (EOS ids dropped, tags kept)."""
        return self.codec.decode([i for i in ids if i not in self.eos_ids])

    def sanitize(self, text: str, max_chars: int) -> str:
        text = _CONTROL.sub("", text)
        for token in self._specials:
            if token in text:
                text = text.replace(token,
                                    "&lt;" + token[1:] if token.startswith("<") else token[:1] + "\u200b" + token[1:])
        if len(text) > max_chars:
            text = text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"
        return text
