"""Run checkpoints: where they live, when one counts as complete, which one `resume=auto` takes.

    <run.dir>/checkpoints/step_000012/
        model/               the training engine's distributed checkpoint (every rank writes)
        trainer_state.json   controller state: step, policy version, data cursor, RNG, run config
        COMPLETE             written last; a directory without it is ignored (a killed save)
    <run.dir>/checkpoints/latest   "step_000012", replaced atomically after COMPLETE

Only the newest `keep` complete checkpoints are kept. Import-light (numpy and torch load only to
capture or restore RNG state): the launcher reads checkpoints before any process starts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

_PREFIX = "step_"


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch CPU generator states (JSON-serialisable)."""
    import numpy as np
    import torch

    np_state = np.random.get_state()
    return {"python": _to_json(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state().tolist()}


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(_from_json(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _to_json(obj):
    return [_to_json(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _from_json(obj):
    return tuple(_from_json(x) for x in obj) if isinstance(obj, list) else obj


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:06d}"

    def save(self, step: int, state: dict[str, Any], write_model: Callable[[Path], None], *,
             before_complete: Callable[[], None] | None = None) -> Path:
        """`write_model(dir)` writes the engine checkpoint (a collective: every rank takes part);
        `before_complete()` runs when everything but the COMPLETE marker is written (fault injection)."""
        target = self.path(step)
        if target.exists():
            shutil.rmtree(target)   # an incomplete or superseded save of the same step
        (target / "model").mkdir(parents=True)
        write_model(target / "model")
        _write_atomic(target / "trainer_state.json", json.dumps({"step": step, **state}, indent=1))
        if before_complete is not None:
            before_complete()
        _write_atomic(target / "COMPLETE", "")
        _write_atomic(self.root / "latest", target.name)
        self._prune()
        return target

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.name.startswith(_PREFIX) and (p / "COMPLETE").exists()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))

    def latest(self) -> Path | None:
        """The newest complete checkpoint (the `latest` pointer is a hint; COMPLETE decides)."""
        done = self.complete()
        return done[-1] if done else None

    @staticmethod
    def load_state(path: Path) -> dict[str, Any]:
        if not (path / "COMPLETE").exists():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
        return json.loads((path / "trainer_state.json").read_text())

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in self.root.iterdir():
            if partial.name.startswith(_PREFIX) and not (partial / "COMPLETE").exists():
                if done and int(partial.name[len(_PREFIX):]) < int(done[-1].name[len(_PREFIX):]):
                    shutil.rmtree(partial, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with tmp.open() as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
