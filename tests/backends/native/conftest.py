"""Fixtures for the native engine tests: engines that are closed afterwards, HF references."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.backends.native import NativeEngine, NativeEngineConfig
from hybridrl.data.batch import pad_sequences
from hybridrl.rollout.protocol import SamplingParams

# Parity models: random weights scaled up so that logits are not flat (near-ties would make
# greedy comparisons flaky and hide mistakes).
PARITY = {"init_std": 0.1}


def needs_kernels(choice: str) -> None:
    """Skip a test variant that runs the C kernels on a machine where they cannot be built (no C compiler)."""
    if choice != "c":
        return
    from hybridrl.backends.native import cpu_kernels

    try:
        cpu_kernels.load()
    except cpu_kernels.KernelUnavailable as exc:
        pytest.skip(f"the native engine's C kernels cannot be built here: {exc}")


@pytest.fixture
def make_engine():
    made: list[NativeEngine] = []

    def make(model_dir, **cfg) -> NativeEngine:
        needs_kernels(cfg.get("kernels", "auto"))
        engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(**{"kv_cache_mb": 8, **cfg}), device="cpu")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def prompts_of(lengths, vocab=500, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_all(engine, prompts, sampling: SamplingParams | list[SamplingParams], tag="r"):
    """Run every prompt concurrently on a fresh event loop; outputs in prompt order."""
    params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)

    async def go():
        return await asyncio.gather(*[engine.generate(p, s, f"{tag}{i}") for i, (p, s) in enumerate(zip(prompts, params))])

    return asyncio.run(go())


def hf_logprobs(model, prompt, output, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / T) of a transformers forward over prompt + output, at the output tokens."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def hf_greedy(model, prompts, max_new_tokens, eos) -> list[list[int]]:
    """transformers generate(do_sample=False) on the batch (left padded); each row cut after its first EOS."""
    ids = pad_sequences(prompts, left=True)
    mask = pad_sequences([[1] * len(p) for p in prompts], left=True)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=list(eos))
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows
