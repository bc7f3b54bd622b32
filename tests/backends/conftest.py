"""Fixtures shared by the backend tests: the family models built with transformers alone."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family_models(family, seed=0) -> an HF directory (see tests/backends/families.py), built once."""
    from tests.backends.families import build

    base = tmp_path_factory.mktemp("families")
    cache: dict[tuple, Path] = {}

    def make(family: str, seed: int = 0) -> Path:
        if (family, seed) not in cache:
            cache[(family, seed)] = build(family, base / f"{family}-{seed}", seed=seed)
        return cache[(family, seed)]

    return make
