"""The native engine against the shared rollout-engine contract (tests/rollout/engine_contract.py)."""

from __future__ import annotations

import pytest

from tests.rollout.engine_contract import EngineContract

pytestmark = pytest.mark.timeout(120)


class TestNativeContract(EngineContract):
    pass        # `make_engine` is the native conftest's fixture (CPU, float32, closed afterwards)
