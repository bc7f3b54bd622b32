from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_models):
    """The tiny qwen2 tokenizer every scripted episode of these tests is written and checked with (one a session)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models("qwen2"))
