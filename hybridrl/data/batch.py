"""`Batch`: named tensors that share a batch dimension, plus per-sample metadata.

The one container that moves between the controller and the workers. Tensors travel over the
data plane; metadata (small Python values, one per sample) travels in control messages.

`info` holds batch-level values (small, picklable: a step's scalars, say) that travel with the
batch's header and survive slicing; a concatenation keeps the first batch's (the pieces of one
call's output describe one step: rank 0's comes first).

Padding: `pad_to(n)` appends copies of the first rows (so no row is degenerate, e.g. an
all-zero attention mask) and zeroes the tensors named in `zero`, and records how many trailing
rows are padding in `num_padding`. Anything that reduces over samples must use `valid_rows`
or a zeroed mask; the dispatcher strips padding from outputs itself.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch


class BatchShapeError(ValueError):
    """A tensor or metadata list does not fit the batch."""


class Batch:
    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        meta: Mapping[str, Sequence[Any]] | None = None,
        *,
        num_padding: int = 0,
        info: Mapping[str, Any] | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: dict[str, list[Any]] = {k: list(v) for k, v in (meta or {}).items()}
        self.num_padding = int(num_padding)
        self.info: dict[str, Any] = dict(info or {})
        self._check()

    # ------------------------------------------------------------------ basics

    def _check(self) -> None:
        sizes = {}
        for name, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise BatchShapeError(f"tensor '{name}' is a {type(t).__name__}, not a torch.Tensor")
            if t.dim() == 0:
                raise BatchShapeError(f"tensor '{name}' is 0-d; every tensor needs the batch dim first")
            sizes[f"tensor '{name}'"] = t.shape[0]
        for name, values in self.meta.items():
            sizes[f"meta '{name}'"] = len(values)
        overlap = set(self.tensors) & set(self.meta)
        if overlap:
            raise BatchShapeError(f"name(s) {sorted(overlap)} used for both a tensor and metadata")
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{k}: {v}" for k, v in sizes.items())
            raise BatchShapeError(f"batch entries disagree on the batch size ({detail})")
        size = next(iter(sizes.values()), 0)
        if not 0 <= self.num_padding <= size:
            raise BatchShapeError(f"num_padding={self.num_padding} outside [0, {size}]")

    def __len__(self) -> int:
        if self.tensors:
            return next(iter(self.tensors.values())).shape[0]
        if self.meta:
            return len(next(iter(self.meta.values())))
        return 0

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.meta:
            return self.meta[name]
        raise KeyError(f"batch has no '{name}' (tensors: {sorted(self.tensors)}, meta: {sorted(self.meta)})")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.meta

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.meta)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                           for k, v in self.tensors.items())
        pad = f", num_padding={self.num_padding}" if self.num_padding else ""
        return f"Batch(size={len(self)}, tensors={{{shapes}}}, meta={sorted(self.meta)}{pad})"

    @property
    def num_valid(self) -> int:
        return len(self) - self.num_padding

    @property
    def valid_rows(self) -> torch.Tensor:
        """Bool [B]: True for real rows, False for padding."""
        mask = torch.ones(len(self), dtype=torch.bool)
        if self.num_padding:
            mask[-self.num_padding:] = False
        return mask

    def set(self, name: str, value: torch.Tensor | Sequence[Any]) -> "Batch":
        """Add or replace one entry in place (checked); returns self."""
        if isinstance(value, torch.Tensor):
            self.meta.pop(name, None)
            self.tensors[name] = value
        else:
            self.tensors.pop(name, None)
            self.meta[name] = list(value)
        try:
            self._check()
        except BatchShapeError:
            self.tensors.pop(name, None)
            self.meta.pop(name, None)
            raise
        return self

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta,
                     num_padding=self.num_padding, info=self.info)

    def tensor_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.tensors.items()}

    # ------------------------------------------------------------------ batch-dim operations

    def select(self, indices: Sequence[int] | torch.Tensor) -> "Batch":
        """Rows by index (any order, repeats allowed). Padding is not carried over."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if idx.numel() and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"index out of range for a batch of {len(self)}")
        positions = idx.tolist()
        return Batch(
            {k: v[idx.to(v.device)] for k, v in self.tensors.items()},
            {k: [v[i] for i in positions] for k, v in self.meta.items()},
            info=self.info,
        )

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch({k: v[start:stop] for k, v in self.tensors.items()},
                     {k: v[start:stop] for k, v in self.meta.items()}, info=self.info)

    def repeat_interleave(self, n: int) -> "Batch":
        """Each row n times in a row: [a, b] -> [a, a, b, b] (a group of n samples per prompt)."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def pad_to(self, size: int, *, zero: Iterable[str] = ()) -> "Batch":
        """Append copies of the first rows up to `size`; tensors named in `zero` are 0 there."""
        n = len(self)
        if size < n:
            raise ValueError(f"cannot pad a batch of {n} down to {size}")
        if size == n:
            return Batch(self.tensors, self.meta, num_padding=self.num_padding, info=self.info)
        if n == 0:
            raise ValueError("cannot pad an empty batch: there is no row to copy")
        zero = set(zero)
        unknown = zero - set(self.tensors)
        if unknown:
            raise KeyError(f"cannot zero {sorted(unknown)} on padding: no such tensors")
        idx = torch.arange(size - n) % n
        extra = self.select(idx)
        for name in zero:
            extra.tensors[name] = torch.zeros_like(extra.tensors[name])
        extra.meta = {k: [None] * len(extra) for k in self.meta}
        out = Batch.concat([Batch(self.tensors, self.meta, info=self.info), extra])
        out.num_padding = self.num_padding + (size - n)
        return out

    def pad_to_multiple(self, multiple: int, *, zero: Iterable[str] = ()) -> "Batch":
        size = -(-len(self) // multiple) * multiple
        return self.pad_to(size, zero=zero)

    def strip_padding(self) -> "Batch":
        return self.slice(0, self.num_valid)

    def chunk(self, n: int) -> list["Batch"]:
        """n equal chunks; the size must divide (pad first). Padding rows follow their chunk."""
        if n < 1:
            raise ValueError(f"chunk count must be >= 1, got {n}")
        if len(self) % n:
            raise BatchShapeError(f"cannot split a batch of {len(self)} into {n} equal chunks; "
                                  f"pad it first (pad_to_multiple({n}))")
        size = len(self) // n
        first_pad = self.num_valid
        chunks = []
        for i in range(n):
            lo, hi = i * size, (i + 1) * size
            part = self.slice(lo, hi)
            part.num_padding = max(0, hi - max(lo, first_pad))
            chunks.append(part)
        return chunks

    def split(self, size: int) -> Iterator["Batch"]:
        """Consecutive pieces of at most `size` rows (micro-batches)."""
        for lo in range(0, len(self), size):
            yield self.slice(lo, min(lo + size, len(self)))

    @staticmethod
    def concat(batches: Sequence["Batch"], *, pad_dim1: Mapping[str, float] | None = None) -> "Batch":
        """Rows of all batches in order; they must hold the same names and trailing shapes, except
        that tensors named in `pad_dim1` are first right-padded along dim 1 (sequence length) with
        the given value to the longest among the batches (a batch that lacks such a tensor while
        others hold it gets one of the pad value: e.g. a shard of placeholder rows). The first
        batch's `info` is kept."""
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        if pad_dim1:
            batches = _pad_dim1(batches, pad_dim1)
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensors) != set(first.tensors) or set(b.meta) != set(first.meta):
                raise BatchShapeError(f"batch {i} holds {sorted(b.keys())}, batch 0 holds {sorted(first.keys())}")
            for name, t in b.tensors.items():
                ref = first.tensors[name]
                if t.shape[1:] != ref.shape[1:] or t.dtype != ref.dtype:
                    raise BatchShapeError(
                        f"tensor '{name}': batch {i} has {tuple(t.shape[1:])} {t.dtype}, "
                        f"batch 0 has {tuple(ref.shape[1:])} {ref.dtype} (trailing dims must match)")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in first.meta}
        if any(b.num_padding for b in batches[:-1]):
            raise BatchShapeError("concat of padded batches would put padding mid-batch; strip it first")
        return Batch(tensors, meta, num_padding=batches[-1].num_padding, info=first.info)


def _pad_dim1(batches: list["Batch"], pad_values: Mapping[str, float]) -> list["Batch"]:
    width = {name: max(b.tensors[name].shape[1] for b in batches if name in b.tensors) for name in pad_values
             if any(name in b.tensors for b in batches)}
    like = {name: next(b.tensors[name] for b in batches if name in b.tensors) for name in width}
    out = []
    for b in batches:
        tensors = dict(b.tensors)
        for name, w in width.items():
            t = tensors.get(name)
            if t is None:
                ref = like[name]
                t = tensors[name] = torch.full((len(b), w, *ref.shape[2:]), pad_values[name], dtype=ref.dtype,
                                               device=ref.device)
            if t is not None and t.shape[1] < w:
                pad = torch.full((t.shape[0], w - t.shape[1], *t.shape[2:]), pad_values[name], dtype=t.dtype,
                                 device=t.device)
                tensors[name] = torch.cat([t, pad], dim=1)
        out.append(Batch(tensors, b.meta, num_padding=b.num_padding, info=b.info))
    return out


def pad_sequences(rows: Sequence[Sequence[int] | torch.Tensor], *, pad_value: int | float = 0,
                  dtype: torch.dtype = torch.long, length: int | None = None, left: bool = False) -> torch.Tensor:
    """Pad variable-length rows into one [B, T] tensor (T = longest row, or `length`): on the right,
    or on the left with `left=True` (the layout of a batched `generate`)."""
    rows = [torch.as_tensor(r, dtype=dtype) for r in rows]
    width = max((len(r) for r in rows), default=0) if length is None else length
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise BatchShapeError(f"row {i} has {len(r)} entries, longer than length={width}")
        if left:
            out[i, width - len(r):] = r
        else:
            out[i, : len(r)] = r
    return out
