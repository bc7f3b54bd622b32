"""The calculator tool: the safe evaluator of `hybridrl/envs/arithmetic.py` (the one the calculator task
computes its answers with), in process: it cannot run code."""

from __future__ import annotations

from typing import Any

from hybridrl.agent.actions import ToolSpec
from hybridrl.envs.arithmetic import calculate
from hybridrl.agent.tools.base import ToolResult
from hybridrl.agent.tools.registry import register_tool


class CalculatorTool:
    def __init__(self, *, max_chars: int = 256):
        self.max_chars = max_chars
        self.spec = ToolSpec(
            "calculator", "Evaluate an arithmetic expression with + - * / // % ^ and parentheses.",
            {"type": "object", "properties": {"expression": {"type": "string", "maxLength": max_chars}},
             "required": ["expression"]})

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult("error: 'expression' must be a string", False, "expression is not a string")
        try:
            text, ok = calculate(expression, max_chars=self.max_chars)
        except (ArithmeticError, ValueError, RecursionError, MemoryError) as err:
            # the evaluator is a pure function of the policy's expression: whatever it raises, the
            # expression caused it; the policy sees the error and is scored on it (never INFRA_INVALID)
            text, ok = f"error: cannot evaluate this expression ({type(err).__name__})", False
        return ToolResult(text, ok, None if ok else text[len("error: "):])


@register_tool("calculator")
def make_calculator(cfg, box) -> CalculatorTool:
    return CalculatorTool(max_chars=cfg.calculator_max_chars)
