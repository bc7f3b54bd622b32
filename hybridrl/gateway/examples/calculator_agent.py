"""The calculator task's agent, written with the OpenAI client: what the built-in agent loop does for this
task, as an agent of your own would do it.

    task:
      name: calculator
      agent: hybridrl.gateway.examples.calculator_agent:run

Each turn asks the model with the calculator listed as a tool; each tool call it makes runs hybridrl's
calculator tool (`call_tool`: the instance's tools, authorized like the built-in loop's) and goes back as a
`role: tool` message; the episode ends at an answer (`<answer>...</answer>`), at a turn with neither a
call nor an answer, or when the gateway refuses a request past the episode's budgets.
"""

from __future__ import annotations

import json
import re

import openai

from hybridrl.gateway import Outcome, call_tool, is_budget_error

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / // % ^ and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


async def run(client: openai.AsyncOpenAI, instance) -> Outcome:
    messages = [dict(m) for m in instance.messages]
    while True:
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except openai.BadRequestError as err:
            if is_budget_error(err):          # turns, tokens or time are spent: the episode is TRUNCATED
                return Outcome()
            raise
        message = reply.choices[0].message
        answers = ANSWER.findall(message.content or "")
        if answers or not message.tool_calls:
            return Outcome(answer=answers[0].strip() if answers else None, num_answers=len(answers))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = {}
            result = await call_tool(call.function.name, arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
