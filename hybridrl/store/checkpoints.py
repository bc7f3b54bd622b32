"""Run checkpoints: where they live, when one counts as complete, which one `resume=auto` takes,
and the one contract every stateful part of a run keeps (`Stateful`, saved and restored by a
`Checkpointer`).

    <run.dir>/checkpoints/step_000012/
        model/               the training side's distributed checkpoint (every training rank writes)
        trainer_state.json   the run's own state at the top (step, policy version, identity, config)
                             and each other part's under its name (the data stream, the collection,
                             the controller's RNG, the logs)
        trainer_state.pkl    what a part holds that is not JSON (e.g. trajectories a collection
                             finished before the checkpoint), when any part does
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
import pickle
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

_PREFIX = "step_"


class Stateful(Protocol):
    """A part of a run that a checkpoint saves and a resume restores, as torchtitan's components do."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Saves and restores every stateful part of a run in one checkpoint.

    `run`: the run's own part, whose state is trainer_state.json's top level (step, policy version,
    identity: what `resume` and the run directory's checks read); `parts`: name -> Stateful (JSON-able
    state under the name; `Blob` values pickled to trainer_state.pkl). `write_model(dir)` /
    `read_model(dir)` are the training side's own checkpoint (a collective on every training rank)."""

    def __init__(self, manager: "CheckpointManager", run: Stateful, parts: Mapping[str, Stateful], *,
                 write_model: Callable[[Path], None], read_model: Callable[[Path], None]):
        self.manager, self.run, self.parts = manager, run, dict(parts)
        self.write_model, self.read_model = write_model, read_model

    def save(self, step: int, *, before_complete: Callable[[], None] | None = None) -> Path:
        state, blobs = dict(self.run.state_dict()), {}
        for name, part in self.parts.items():
            state[name], blobs[name] = _split_blobs(part.state_dict())
        state.pop("step", None)          # the manager writes it
        return self.manager.save(step, state, self.write_model, before_complete=before_complete,
                                 blobs={k: v for k, v in blobs.items() if v})

    def restore(self, path: Path) -> dict[str, Any]:
        """Every part's state back from checkpoint `path` (the model first); returns the whole state."""
        state = CheckpointManager.load_state(path)
        self.read_model(path / "model")
        blobs = CheckpointManager.load_blobs(path)
        self.run.load_state_dict(state)
        for name, part in self.parts.items():
            part.load_state_dict({**state.get(name, {}), **blobs.get(name, {})})
        return state


class Blob:
    """A value of a part's state that is not JSON (pickled beside trainer_state.json)."""

    def __init__(self, value: Any):
        self.value = value


def _split_blobs(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    plain = {k: v for k, v in state.items() if not isinstance(v, Blob)}
    return plain, {k: v.value for k, v in state.items() if isinstance(v, Blob)}


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
             before_complete: Callable[[], None] | None = None, blobs: dict[str, Any] | None = None) -> Path:
        """`write_model(dir)` writes the engine checkpoint (a collective: every rank takes part);
        `before_complete()` runs when everything but the COMPLETE marker is written (fault injection)."""
        target = self.path(step)
        if target.exists():
            shutil.rmtree(target)   # an incomplete or superseded save of the same step
        (target / "model").mkdir(parents=True)
        write_model(target / "model")
        _write_atomic(target / "trainer_state.json", json.dumps({"step": step, **state}, indent=1))
        if blobs:
            tmp = target / "trainer_state.pkl.tmp"
            with tmp.open("wb") as f:
                pickle.dump(blobs, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target / "trainer_state.pkl")
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

    @staticmethod
    def load_blobs(path: Path) -> dict[str, Any]:
        file = path / "trainer_state.pkl"
        if not file.exists():
            return {}
        with file.open("rb") as f:
            return pickle.load(f)      # written by this project's own checkpoint, in this run directory

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
