"""The agent loop on model-backed engines with a tiny model: the reference torch engine (always)
and the native engine (activates once hybridrl.backends.native exists).

The policy is a random tiny model, so tool calls follow a fixed schedule (the parser below),
which still exercises every path: generated ids (mask 1), observation deltas (mask 0), the
next turn generated on top of them, budgets. The behaviour logprobs the engine returned are
checked against an independent recomputation with transformers on the final sequences.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from hybridrl.agent.actions import ParsedTurn, ToolCall  # noqa: E402
from hybridrl.agent.config import AgentConfig  # noqa: E402
from hybridrl.agent.loop import AgentRunner  # noqa: E402
from hybridrl.agent.testing import TorchReferenceEngine  # noqa: E402
from hybridrl.agent.tools.base import ToolBox  # noqa: E402
from hybridrl.agent.tools.calculator import CalculatorTool  # noqa: E402
from hybridrl.data.trajectory import TrajectoryStatus, to_batch  # noqa: E402
from hybridrl.envs.tasks import get_task  # noqa: E402


class _Scheduled:
    def __init__(self, calls: int):
        self.left = calls

    def parse(self, text: str) -> ParsedTurn:
        if self.left:
            self.left -= 1
            return ParsedTurn(calls=(ToolCall("calculator", {"expression": "12*034"}, "", "calc"),))
        return ParsedTurn(answer=text.strip()[:20], num_answers=1)


class ScheduledRunner(AgentRunner):
    calls = 2

    def parser(self, task):
        return _Scheduled(self.calls)


async def _close(engine) -> None:
    for name in ("close", "shutdown", "stop"):
        fn = getattr(engine, name, None)
        if fn is not None:
            out = fn()
            if inspect.isawaitable(out):
                await out
            return


def make_engine(kind: str, model_dir):
    if kind == "native":
        native = pytest.importorskip("hybridrl.backends.native")
        return native.NativeEngine.from_pretrained(model_dir, native.NativeEngineConfig(), device="cpu")
    return TorchReferenceEngine.from_pretrained(str(model_dir))


ENGINES = ["reference", "native"]


def _episodes(kind, model_dir, tokenizer, agent_cfg, n=3, group_size=2):
    task = get_task("calculator")

    async def go():
        engine = make_engine(kind, model_dir)
        try:
            runner = ScheduledRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=ToolBox([CalculatorTool()]),
                                 run_id="native")
            return engine, await runner.run(task.train_split(n), task=task, group_size=group_size)
        finally:
            await _close(engine)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen2", init_std=0.1)


@pytest.fixture(scope="module")
def model_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("kind", ENGINES)
def test_episodes_are_token_exact_with_matching_logprobs(kind, model_dir, model_tokenizer):
    from transformers import AutoModelForCausalLM

    cfg = AgentConfig(max_turns=3, max_new_tokens_per_turn=12, max_response_tokens=200, temperature=1.0,
                      on_turn_limit="close_turn")     # a random model rarely says EOS: close its turns
    engine, trajs = _episodes(kind, model_dir, model_tokenizer, cfg)
    assert all(t.status != TrajectoryStatus.INFRA_INVALID for t in trajs), [t.metadata for t in trajs]
    assert all(t.versions <= {engine.policy_version} for t in trajs)
    with_obs = [t for t in trajs if 0 in t.response_mask]
    assert with_obs, "no episode reached a tool observation"
    batch = to_batch(trajs, pad_id=model_tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].bool()
    got = batch["behavior_logprobs"][:, 1:][mask]
    want = logp[mask]
    assert got.numel() > 0
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ENGINES)
def test_episodes_respect_budgets(kind, model_dir, model_tokenizer):
    cfg = AgentConfig(max_turns=2, max_new_tokens_per_turn=6, max_response_tokens=40, temperature=1.0)
    _, trajs = _episodes(kind, model_dir, model_tokenizer, cfg, n=2)
    for t in trajs:
        t.validate()
        assert t.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)
        assert t.turns <= 2 and len(t.response_ids) <= 40
        if t.status == TrajectoryStatus.TRUNCATED:
            assert t.truncation is not None
