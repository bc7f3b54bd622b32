"""Drives an episode's token capture the way an OpenAI-client agent and a model would: the agent sends
messages (the assistant messages as the gateway returned them, through a client's round trip), the
"model" answers with given text (or given ids), and the conversation is kept in both shapes: as the agent
sees it, and with the model's own text, whose single rendering the capture is compared against."""

from __future__ import annotations

import json
from typing import Any

from hybridrl.gateway.capture import EpisodeCapture, Template
from hybridrl.gateway.toolcalls import TurnParser, choose_parsers

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}, "required": ["expression"]}}}


class Conversation:
    def __init__(self, tokenizer: Any, *, on_drift: str = "mark", check_tokens: bool = True, tools=(CALCULATOR,),
                 options: dict | None = None):
        self.tokenizer = tokenizer
        self.template = Template(tokenizer, [tokenizer.eos_token_id])
        self.capture = EpisodeCapture(self.template, on_drift=on_drift, check_tokens=check_tokens)
        self.parser = TurnParser(*choose_parsers("auto", "auto", self.template.source))
        self.tools = list(tools) or None
        self.options = options or {}
        self.messages: list[dict] = []      # what the agent sends
        self.raw: list[dict] = []           # the same conversation with the model's own text
        self.served: list[list[int]] = []   # the context of every request

    def say(self, role: str, content: str, **extra: Any) -> None:
        self.messages.append({"role": role, "content": content, **extra})
        self.raw.append({"role": role, "content": content, **extra})

    def tool_results(self, *results: str) -> None:
        calls = self.messages[-1].get("tool_calls") or []
        assert len(calls) == len(results), (calls, results)
        for call, result in zip(calls, results):
            self.say("tool", result, tool_call_id=call["id"])

    def model(self, text: str | None = None, *, ids: list[int] | None = None) -> dict:
        """One assistant turn: the request is prepared, the 'model' emits `text` (or `ids`) and EOS."""
        prepared = self.capture.prepare_chat(self.messages, tools=self.tools, options=self.options)
        self.served.append(list(prepared.ids))
        out = (list(ids) if ids is not None else self.template.encode(text)) + [self.tokenizer.eos_token_id]
        raw = self.template.decode(out[:-1])
        names = [t["function"]["name"] for t in self.tools or ()]
        message = self.parser.parse(raw, names, call_prefix=f"t{len(self.served)}").message()
        self.capture.commit(prepared, out, [-0.25] * len(out), [0] * len(out), returned=message)
        # what an OpenAI client sends back: the parsed message with the fields its model adds
        self.messages.append(json.loads(json.dumps({**message, "refusal": None, "annotations": []})))
        self.raw.append({"role": "assistant", "content": raw})
        return message

    def single_render(self) -> list[int]:
        """One tokenization of the whole conversation, the model's turns as it wrote them."""
        return self.template.encode(self.template.render(self.raw, tools=self.tools, add_generation_prompt=False,
                                                         options=self.options))

    def exact(self) -> bool:
        """The trajectory's ids are the single rendering's (up to the template's text after the last EOS)."""
        ids, single = self.capture.final().ids, self.single_render()
        return single[:len(ids)] == ids and not self.template.decode(single[len(ids):]).strip()

    def drift_counted(self) -> int:
        return self.capture.counts["template_drift"] + self.capture.counts["token_drift"]


def assert_exact_or_counted(conversation: Conversation) -> bool:
    """The conformance rule: the capture equals a single rendering, or its drift was counted."""
    exact = conversation.exact()
    assert exact or conversation.drift_counted() > 0, "the capture differs from a single rendering and no drift was counted"
    return exact
