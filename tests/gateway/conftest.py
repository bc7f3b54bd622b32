from __future__ import annotations

import pytest

from tests.gateway.templates import tokenizer_for


@pytest.fixture(scope="session")
def base_tokenizer_dir(tiny_models):
    return tiny_models("qwen2")


@pytest.fixture(scope="session")
def styled(base_tokenizer_dir):
    """styled(style) -> the tiny tokenizer with that family's chat template (cached)."""
    cache = {}

    def make(style: str):
        if style not in cache:
            cache[style] = tokenizer_for(style, base_tokenizer_dir)
        return cache[style]

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer(base_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_tokenizer_dir)
