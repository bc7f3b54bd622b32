from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models("qwen2"))
