"""The one check of published tensors against what an engine holds: names, shapes, dtypes.

`spec_problems` compares two specs ({HF name: (shape, dtype)}) and lists what differs; it serves
the publication's structure check (before anything moves: the whole model, missing names too)
and `validate_named_tensors`, the check every engine runs on an `update_weights` call (one
bucket: every name must be known, with the engine's shape and dtype, and appear once).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

WeightSpec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class WeightMismatch(ValueError):
    """Tensors whose content, read back from the engine's own storage after the copy, differs from
    what the sender hashed. `names` lists them; nothing of theirs counts as arrived."""

    def __init__(self, names: Sequence[str], message: str):
        super().__init__(message)
        self.names = list(names)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def spec_problems(published: Iterable[tuple[str, tuple[tuple[int, ...], torch.dtype | str]]], held: WeightSpec,
                  *, complete: bool = True, limit: int = 5) -> list[str]:
    """What differs between `published` and `held` (empty when they fit). `complete`: every held
    tensor must be published too (a whole publication, not one bucket)."""
    published = dict(published)
    problems = []
    extra = [n for n in published if n not in held]
    if extra:
        hint = ""
        if "lm_head.weight" in extra and "model.embed_tokens.weight" in held:
            hint = " (this model ties lm_head to model.embed_tokens.weight: send that one only)"
        problems.append(f"{len(extra)} unknown tensor(s): {sorted(extra)[:limit]}{hint}")
    if complete:
        missing = sorted(set(held) - set(published))
        if missing:
            problems.append(f"{len(missing)} missing tensor(s): {missing[:limit]}")
    for name in [n for n in published if n in held]:
        shape, dtype = published[name]
        want_shape, want_dtype = held[name]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"tensor '{name}' has shape {tuple(shape)}, expected {tuple(want_shape)}")
        elif dtype_name(dtype) != dtype_name(want_dtype):
            problems.append(f"tensor '{name}' has dtype {dtype_name(dtype)}, expected {dtype_name(want_dtype)}")
    return problems


def validate_named_tensors(items: Sequence[tuple[str, torch.Tensor]], spec: WeightSpec) -> None:
    """Check one `update_weights` call whole before any copy (a bad call changes nothing); raise
    ValueError/TypeError naming the problems."""
    seen: set[str] = set()
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError(f"update_weights expects (name, tensor) pairs, got {type(entry).__name__}")
        name, tensor = entry
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in seen:
            raise ValueError(f"update_weights: tensor '{name}' appears twice in one call")
        seen.add(name)
    problems = spec_problems(((n, (tuple(t.shape), t.dtype)) for n, t in items), spec, complete=False)
    if problems:
        raise ValueError("update_weights: " + "; ".join(problems))
