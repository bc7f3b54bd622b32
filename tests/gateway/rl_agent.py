"""The agent of the gateway's RL-job test (tests/gateway/test_rl_job.py), written with the OpenAI client:
two turns around one of hybridrl's tools whatever the model says, so that every trajectory holds policy
tokens, a tool result the policy did not sample, and policy tokens again. It returns its own reward
(a function of what the model said, so that a group's rewards differ) and its final conversation
(the test renders it once with the chat template and compares)."""

from __future__ import annotations

import openai

from hybridrl.gateway import Outcome, call_tool, is_budget_error


async def run(client: openai.AsyncOpenAI, instance) -> Outcome | float:
    messages = [dict(m) for m in instance.messages]
    try:
        for turn in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
            content = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": content})
            if turn == 0:
                messages.append({"role": "tool", "content": await call_tool("calculator", {"expression": "6 * 7"})})
    except openai.BadRequestError as err:
        if is_budget_error(err):
            return 0.0
        raise
    return Outcome(reward=float(len(content) % 2), metadata={"messages": messages})


async def crash(client: openai.AsyncOpenAI, instance) -> Outcome:
    """The failing-run test's agent (tests/gateway/test_adversarial.py): asks once, then raises, every episode."""
    await client.chat.completions.create(model="policy", messages=list(instance.messages), max_tokens=4)
    raise ValueError("the agent's own bug")
