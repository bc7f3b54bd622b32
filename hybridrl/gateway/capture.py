"""Exact token capture for one episode of an OpenAI-client agent.

An agent sends whole conversations (messages); the engine needs token ids, and training needs the ids
the model actually saw and produced. Each served completion is kept as a *chain*: the context ids it
was generated from, its own ids (mask 1, with their logprobs and policy versions), the text those ids
stand for, and the messages of the request plus the assistant message the gateway returned. A new
request is served like this:

1. Find the longest chain whose messages are a prefix of the request's (the returned assistant
   message compared as returned: content and tool calls, the ids and extra fields ignored).
2. Render the request with the model's chat template, every assistant message the gateway returned
   replaced by the text the model generated for it (tool-call markup and reasoning included), so the
   template sees the model's own words.
3. If the rendering extends the chain's text, the context is the chain's exact ids + the tokens of the
   new text only. Completion ids are never re-tokenized. With `check_tokens` the result is compared
   with one tokenization of the whole rendering; a difference (a merge across the boundary, a
   non-canonical tokenization the model sampled) is counted as `token_drift` and marked.
4. If it does not (the template rewrites earlier turns: Qwen3 drops earlier reasoning once a new user
   turn arrives, Llama-3 trims contents), that is template drift, counted and handled per
   `on_drift`: `mark` keeps the exact ids and appends the new messages as the template renders them
   after a closed assistant turn, marking the chain; `split` serves the fresh rendering as the root
   of a new segment.
5. A request that extends no chain (the agent rewrote its history, or a side conversation) starts a
   new segment from its rendering (`branches`).

The episode's trajectory is the chain the agent ended on (`final`): a completion no later request
continued, delivered to the agent. Completions the agent did not continue (the other choices of an `n > 1`
request, a side conversation) are not trained (`untrained_policy_tokens`); a completion whose client went
away before it was delivered is never committed. When the episode ends on several such completions, the
agent names the one it used (`Outcome(completion=response.id, choice=index)`), or the one whose text holds
the agent's final answer is taken; otherwise nothing is trained (the episode is dropped, counted as
`ambiguous_final`), since no chain can be said to have earned the reward.

Each chain carries its routing record (mixture-of-experts models: the experts every computed position was
routed to, merged over its requests as the built-in loop merges turns), so routing replay trains a gateway
episode as it trains a built-in one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from hybridrl.agent.codec import TokenCodec
from hybridrl.agent.render import ChatRenderer

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MARK = "hybridrl-turn-mark"


class TemplateError(ValueError):
    """A request the chat template cannot render (shown to the agent as a 400)."""


class Template:
    """The model's tokenizer and chat template, as the gateway uses them."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.codec = TokenCodec(tokenizer)
        self.renderer = ChatRenderer(tokenizer)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids |= {int(tokenizer.eos_token_id)}
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token and the engine names none")
        self.source = str(getattr(tokenizer, "chat_template", "") or "")
        if not self.source:
            raise ValueError("the tokenizer has no chat template: the gateway renders messages with it")
        self._specials = sorted({str(t) for t in tokenizer.get_added_vocab()}, key=len, reverse=True)
        self.close_text = self._closing()           # how the template ends an assistant turn (an EOS string)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, options: Mapping[str, Any] | None = None) -> str:
        try:
            return self.renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        options=options)
        except Exception as err:  # noqa: BLE001 - jinja's errors are the request's problem
            raise TemplateError(f"the chat template cannot render these messages: {type(err).__name__}: {err}") from None

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def encode_whole(self, text: str) -> list[int]:
        """`encode(text)` of a whole conversation, from the ids of its pieces seen before (`TokenCodec`)."""
        return self.codec.encode_whole(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def defuse(self, text: str) -> str:
        """`text` with every special-token string made plain text (so it cannot forge turn structure)."""
        for token in self._specials:
            if token in text:
                text = text.replace(token, "&lt;" + token[1:] if token.startswith("<") else token[:1] + "\u200b" + token[1:])
        return text

    def sanitize(self, text: str, max_chars: int) -> str:
        """Untrusted text (a tool's output) with special-token strings defused and control characters
        removed, cut to `max_chars` (as the built-in agent loop treats observations)."""
        text = self.defuse(_CONTROL.sub("", text))
        if len(text) > max_chars:
            text = text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"
        return text

    def _closing(self) -> str | None:
        text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}],
                           add_generation_prompt=False)
        after = text[text.rfind(_MARK) + len(_MARK):] if _MARK in text else ""
        for eos in sorted((self.decode([i]) for i in self.eos_ids), key=len, reverse=True):
            if eos and after.startswith(eos):
                return eos
        return None

    def delta_after_turn(self, messages: Sequence[Mapping[str, Any]], *, tools=None, options=None) -> str | None:
        """The template's text for `messages` right after an assistant turn's EOS (what follows it up to the
        next generation prompt), from a rendering of [user, assistant, *messages]; None when the template
        does not end assistant turns with an EOS string."""
        if self.close_text is None:
            return None
        text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}, *messages],
                           tools=tools, options=options)
        anchor = _MARK + self.close_text
        at = text.rfind(anchor)
        return text[at + len(anchor):] if at >= 0 else None


# ---------------------------------------------------------------------------------------------------------
# messages


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise TemplateError(f"only text content parts are served, got a {kind!r} part")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise TemplateError(f"a message's content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def message_key(message: Mapping[str, Any]) -> str:
    """What identifies a message for prefix matching: role, text content, tool calls (name and parsed
    arguments), name and tool_call_id. Ids of tool calls and extra fields a client adds are ignored."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise TemplateError("every message must be an object with a string 'role'")
    out: dict[str, Any] = {"role": message["role"], "content": content_text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [[(c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments"))]
                             for c in calls]
    for name in ("name", "tool_call_id"):
        if message.get(name):
            out[name] = message[name]
    return _KEY_JSON.encode(out)


_KEY_JSON = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str)   # one encoder, not one a message


def prefix_digests(keys: Sequence[str]) -> list[str]:
    """digests[k] identifies keys[:k] (digests[0] is the empty conversation)."""
    out = [""]
    for key in keys:
        out.append(_then(out[-1], key))
    return out


def _then(digest: str, key: str) -> str:
    return hashlib.blake2b((digest + "\x1e" + key).encode(), digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# chains


@dataclass(eq=False)
class Chain:
    """A served completion with everything before it, as the engine saw it."""

    ids: list[int]                 # context + completion
    mask: list[int]                # 1 = generated by the policy
    logprobs: list[float]
    versions: list[int]
    prompt_len: int                # the segment's first prompt (what the trajectory calls its prompt)
    text: str                      # what the ids stand for
    view: list[dict[str, Any]]     # the messages the template renders, through this completion
    ended_with_eos: bool
    segment: int
    template_drift: int = 0        # requests along this chain served with the exact ids against the template
    token_drift: int = 0           # requests along this chain whose ids differ from one tokenization
    routes: Any = None             # MoE: the routing record of ids[:-1] (data/trajectory.py), or None
    final_text: str = ""           # the completion's text as returned (content, or the completion's text)
    response_id: str = ""          # the response it was returned in, and its choice index there
    index: int = 0
    continued: bool = False        # a later request extended it
    steps: list = field(default_factory=list)    # per completion along the chain: its [start, end) in ids, the
    #                                               roles of the messages before it, and the service's note

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.mask)


@dataclass
class Prepared:
    """The context of one request, before its completion: what the engine is sent."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    text: str
    view: list[dict[str, Any]]
    digest: str                       # of the request's messages (chat requests)
    parent: Chain | None
    carries: list[Chain]              # earlier completions this request carries on (their returned messages)
    kind: str                         # root | extend | branch | drift_mark | drift_split
    segment: int
    template_drift: int = 0           # along the chain, this request included
    token_drift: int = 0
    drift: str = ""                   # this request's: "" | "template" | "tokens"
    reused_tokens: int = 0            # context ids taken from the chain as they were
    encoded_tokens: int = 0           # context ids tokenized for this request

    @property
    def response_tokens(self) -> int:
        return len(self.ids) - self.prompt_len


COUNTERS = ("requests", "roots", "extended", "branches", "template_drift", "token_drift", "splits",
            "reused_tokens", "encoded_tokens")


@dataclass
class EpisodeCapture:
    """The chains of one episode and how each request was served (see the module doc)."""

    template: Template
    on_drift: str = "mark"
    check_tokens: bool = True
    max_tool_chars: int = 1 << 20
    specials_as_text: bool = True               # special-token strings in the agent's messages are plain text
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    policy_tokens: int = 0                                  # every completion's, trained or not
    _committed: list[Chain] = field(default_factory=list)             # in commit order
    _chains: dict[str, Chain] = field(default_factory=dict)           # digest of messages -> chain
    _text_chains: list[Chain] = field(default_factory=list)            # /v1/completions chains
    _returned: dict[str, str] = field(default_factory=dict)            # assistant key -> the model's text
    _returned_chain: dict[str, Chain] = field(default_factory=dict)    # assistant key -> its completion
    _segments: int = 0

    # ------------------------------------------------------------------ chat requests

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]], *, tools=None, options=None) -> Prepared:
        if not messages:
            raise TemplateError("'messages' must not be empty")
        keys = [message_key(m) for m in messages]
        carried = [self._returned_chain[k] for k in keys if k in self._returned_chain]
        out = self._prepare_chat(messages, keys, tools, options)
        out.carries = carried
        return out

    def _prepare_chat(self, messages: Sequence[Mapping[str, Any]], keys: list[str], tools, options) -> Prepared:
        digests = prefix_digests(keys)
        parent, matched = None, 0
        for k in range(len(messages), 0, -1):
            parent = self._chains.get(digests[k])
            if parent is not None:
                matched = k
                break
        new = [self._view(m, key) for m, key in zip(messages[matched:], keys[matched:])]
        if parent is None:
            return self._root(new, digests[-1], tools, options, kind="branch" if self._segments else "root")
        view = parent.view + new
        text = self.template.render(view, tools=tools, options=options)
        if text.startswith(parent.text):
            delta = self.template.encode(text[len(parent.text):])
            out = self._extend(parent, delta, text, view, digests[-1], kind="extend")
            if self.check_tokens and self.template.encode_whole(text) != out.ids:
                out.token_drift, out.drift = out.token_drift + 1, "tokens"
            return out
        if self.on_drift == "mark":
            after = self.template.delta_after_turn(new, tools=tools, options=options)
            if after is not None:
                closing = "" if parent.ended_with_eos else self.template.close_text
                added = closing + after
                out = self._extend(parent, self.template.encode(added), parent.text + added, view, digests[-1],
                                   kind="drift_mark")
                out.template_drift, out.drift = out.template_drift + 1, "template"
                return out
        out = self._root(view, digests[-1], tools, options, kind="drift_split", rendered=text)
        out.template_drift, out.drift = parent.template_drift + 1, "template"
        return out

    def _view(self, message: Mapping[str, Any], key: str) -> dict[str, Any]:
        """The message as the template gets it: the model's own text for an assistant message the gateway
        returned, a tool's output sanitized, anything else as sent."""
        role = message["role"]
        if role == "assistant" and key in self._returned:
            return {"role": "assistant", "content": self._returned[key]}
        out = dict(message)
        if role in ("tool", "ipython"):
            out["content"] = self.template.sanitize(content_text(message.get("content")), self.max_tool_chars)
        elif isinstance(out.get("content"), list):
            out["content"] = content_text(out["content"])
        if self.specials_as_text and isinstance(out.get("content"), str):
            out["content"] = self.template.defuse(out["content"])
        return out

    def _root(self, view, digest, tools, options, *, kind: str, rendered: str | None = None) -> Prepared:
        text = rendered if rendered is not None else self.template.render(view, tools=tools, options=options)
        ids = self.template.encode_whole(text)
        self._segments += 1
        return Prepared(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids), len(ids), text, view, digest,
                        None, [], kind, self._segments - 1, encoded_tokens=len(ids))

    def _extend(self, parent: Chain, delta: list[int], text: str, view, digest, *, kind: str) -> Prepared:
        n = len(delta)
        return Prepared(parent.ids + delta, parent.mask + [0] * n, parent.logprobs + [0.0] * n,
                        parent.versions + [-1] * n, parent.prompt_len, text, view, digest, parent, [parent], kind,
                        parent.segment, parent.template_drift, parent.token_drift, reused_tokens=len(parent.ids),
                        encoded_tokens=n)

    # ------------------------------------------------------------------ text / token requests

    def prepare_prompt(self, prompt: str | Sequence[int]) -> Prepared:
        """A /v1/completions prompt: text, or token ids (taken as they are)."""
        if isinstance(prompt, str):
            parent = max((c for c in self._text_chains if prompt.startswith(c.text)), key=lambda c: len(c.text),
                         default=None)
            if parent is None:
                return self._root_ids(self.template.encode(prompt), prompt)
            out = self._extend(parent, self.template.encode(prompt[len(parent.text):]), prompt, [], "", kind="extend")
            if self.check_tokens and self.template.encode_whole(prompt) != out.ids:
                out.token_drift, out.drift = out.token_drift + 1, "tokens"
            return out
        ids = [int(i) for i in prompt]
        parent = max((c for c in self._text_chains if ids[:len(c.ids)] == c.ids), key=lambda c: len(c.ids),
                     default=None)
        if parent is None:
            return self._root_ids(ids, self.template.decode(ids))
        out = self._extend(parent, ids[len(parent.ids):], parent.text + self.template.decode(ids[len(parent.ids):]),
                           [], "", kind="extend")
        out.encoded_tokens = 0
        return out

    def _root_ids(self, ids: list[int], text: str) -> Prepared:
        kind = "branch" if self._segments else "root"
        self._segments += 1
        return Prepared(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids), len(ids), text, [], "", None, [],
                        kind, self._segments - 1, encoded_tokens=len(ids))

    # ------------------------------------------------------------------ completions

    def commit(self, prepared: Prepared, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], *,
               returned: Mapping[str, Any] | None = None, routes: Any = None, text: str = "",
               response_id: str = "", index: int = 0, note: Mapping[str, Any] | None = None) -> Chain:
        """Record a completion of `prepared` (`returned`: the assistant message sent back, chat requests;
        `routes`: the engine's routing records of its requests, in order; `text`: what the agent was given)."""
        ids = [int(i) for i in ids]
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"a completion of {len(ids)} ids needs as many logprobs and versions")
        if ids and min(versions) < 0:
            raise ValueError("every generated token needs the policy version that produced it")
        ended = bool(ids) and ids[-1] in self.template.eos_ids
        raw = self.template.decode(ids[:-1] if ended else ids)
        merged = prepared.parent.routes if prepared.parent is not None else None
        for record in routes or ():
            merged = merge_routes(merged, record)
        chain = Chain(prepared.ids + ids, prepared.mask + [1] * len(ids), prepared.logprobs + [float(x) for x in logprobs],
                      prepared.versions + [int(v) for v in versions], prepared.prompt_len,
                      prepared.text + self.template.decode(ids), prepared.view + [{"role": "assistant", "content": raw}],
                      ended, prepared.segment, prepared.template_drift, prepared.token_drift, routes=merged,
                      final_text=text or raw, response_id=response_id, index=index,
                      steps=_steps(prepared, len(ids), note))
        if returned is not None:
            key = message_key(returned)
            self._returned[key] = raw
            self._returned_chain[key] = chain
            self._chains[_then(prepared.digest, key)] = chain
        else:
            self._text_chains.append(chain)
        for earlier in prepared.carries:
            earlier.continued = True
        self._count(prepared)
        self.policy_tokens += len(ids)
        self._committed.append(chain)
        return chain

    def _count(self, prepared: Prepared) -> None:
        c = self.counts
        c["requests"] += 1
        c["roots"] += prepared.kind in ("root", "branch", "drift_split")
        c["extended"] += prepared.kind in ("extend", "drift_mark")
        c["branches"] += prepared.kind == "branch"
        c["splits"] += prepared.kind == "drift_split"
        c["template_drift"] += prepared.drift == "template"
        c["token_drift"] += prepared.drift == "tokens"
        c["reused_tokens"] += prepared.reused_tokens
        c["encoded_tokens"] += prepared.encoded_tokens

    def final(self, **named: Any) -> Chain | None:
        """The chain the episode trains on, or None (see `choose`)."""
        return self.choose(**named)[0]

    def choose(self, *, completion: str | None = None, choice: int | None = None,
               text: str | None = None) -> tuple[Chain | None, str]:
        """The chain the episode trains on and, when there is none, why ("no_request" or the ambiguity). See
        the module doc: the leaf the agent named, else the only leaf, else the only leaf holding `text`."""
        leaves = [c for c in self._committed if not c.continued]
        if not leaves:
            return None, "no_request"
        if completion is not None:
            named = [c for c in leaves if c.response_id == completion and c.index == (choice or 0)]
            if named:
                return named[0], ""
            return None, (f"ambiguous_final: the agent named completion {completion!r} choice {choice or 0}, which "
                          "is not a completion the episode ended on")
        if len(leaves) == 1:
            return leaves[0], ""
        holding = [c for c in leaves if text and text in c.final_text]
        if len(holding) == 1:
            return holding[0], ""
        return None, (f"ambiguous_final: the episode ended on {len(leaves)} completions no request continued (n > 1, "
                      "or a side conversation) and the agent did not say which it used: return "
                      "Outcome(completion=response.id, choice=index)")

    @property
    def last(self) -> Chain | None:
        """The most recently committed chain (progress reporting; `final` decides what is trained)."""
        return self._committed[-1] if self._committed else None


def _steps(prepared: Prepared, n: int, note: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The chain's completions so far: the parent's, then this one ([start, end) in the chain's ids, the roles
    of the messages added since the parent's completion, what the service noted of it)."""
    parent = prepared.parent
    roles = [m.get("role") for m in prepared.view[len(parent.view):]] if parent is not None else []
    step = {**(note or {}), "start": len(prepared.ids), "end": len(prepared.ids) + n, "roles": roles}
    return [*(parent.steps if parent is not None else []), step]


def merge_routes(have: Any, new: Any) -> Any:
    """A routing record merged with a later request's (`new` covers the whole context it computed): the
    later record of a position wins (data/trajectory.py's rule, the same for every front end)."""
    from hybridrl.data.trajectory import merge_routes as merge

    return merge(have, new)
