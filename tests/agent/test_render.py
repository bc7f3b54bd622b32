"""ChatRenderer: plain conversations through the compiled template give apply_chat_template's text; the rest,
and any template where the two differ, go through apply_chat_template."""

from __future__ import annotations

import random

import pytest

from hybridrl.agent.render import SHADOW_CHECKS, ChatRenderer

ROLES = ("system", "user", "assistant", "tool")
WORDS = ("What is 12 * 34?", "<answer>408</answer>", "<calc>1+2</calc>", "", " ", "\n\n", "naïve 東京 🙂", "Next.",
         "<|im_end|>", "x" * 40)


def conversations(seed: int, n: int = 60) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 8)):
            content = rng.choice((None, *WORDS)) if rng.random() < 0.1 else " ".join(rng.sample(WORDS, 3))
            messages.append({"role": rng.choice(ROLES), "content": content})
        out.append(messages)
    return out


def test_plain_conversations_render_as_apply_chat_template_does(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert renderer.fast
    refused = 0
    for messages in conversations(0):
        for generation in (True, False):
            try:
                want = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                     add_generation_prompt=generation)
            except Exception as err:  # noqa: BLE001 - a message without content: the template's own error
                with pytest.raises(type(err)):
                    renderer.render(messages, add_generation_prompt=generation)
                refused += 1
                continue
            assert renderer.render(messages, add_generation_prompt=generation) == want
    assert 0 < refused < 40 and renderer.fast and renderer.fast_renders == 120 - refused


def test_tools_options_and_richer_messages_go_through_apply_chat_template(tokenizer):
    renderer = ChatRenderer(tokenizer)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    call = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]
    for messages, kwargs in (([{"role": "user", "content": "q"}], {"tools": tools}), (call, {}),
                             ([{"role": "user", "content": "q", "name": "ann"}], {}),
                             ([{"role": "user", "content": "q"}], {"options": {"enable_thinking": False}})):
        want = tokenizer.apply_chat_template([dict(m) for m in messages], tools=kwargs.get("tools"), tokenize=False,
                                             add_generation_prompt=True, **kwargs.get("options", {}))
        assert renderer.render(messages, **kwargs) == want
    assert renderer.fast_renders == 0
    with pytest.raises(TypeError):                 # content parts: this template's own error, as before
        renderer.render([{"role": "user", "content": [{"type": "text", "text": "q"}]}])


def test_one_difference_in_the_shadow_checks_turns_the_fast_path_off(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "q"}]
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert renderer.render(messages) == want and renderer.fast
    renderer._compiled = _Shouting(renderer._compiled)           # a template that no longer agrees
    assert renderer.render(messages) == want and not renderer.fast
    assert renderer.render(messages) == want and renderer.fast_renders == 1
    later = ChatRenderer(tokenizer)
    for _ in range(SHADOW_CHECKS):
        later.render(messages)
    later._compiled = _Shouting(later._compiled)                  # past the shadow checks nothing is compared
    assert later.render(messages) == want.upper()


class _Shouting:
    def __init__(self, compiled):
        self.compiled = compiled

    def render(self, **variables):
        return self.compiled.render(**variables).upper()
