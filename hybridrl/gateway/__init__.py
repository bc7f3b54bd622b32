"""The OpenAI-compatible inference gateway: agents written with any OpenAI client, trained unchanged.

`task.agent: module:function` names an `async def run(client, instance) -> reward | Outcome`; its
episodes run through a gateway on the rollout side (`runner.GatewayRunner`) that captures the exact
tokens the model saw and produced (`capture.py`). See docs/agents-howto.md.
This module imports only what an agent needs (no torch, no web stack).
"""

from hybridrl.gateway.agent import Outcome, call_tool, is_budget_error

__all__ = ["Outcome", "call_tool", "is_budget_error"]
