"""`PolicyRelease`: the manifest of one weight publication (the release manifest of an RL weight publication: version, step, content and tokenizer hashes, sampler contract).

The checkpoint hash covers the published tensors in canonical order (sorted HF names; each
tensor's name, dtype, shape and bytes). It uses xxh3-128 (about as fast as a memory copy here,
12 GB/s against 1.1 GB/s for sha256), so verifying every publication costs about one extra read
of the weights rather than ten; the algorithm is named in the hash string. Tensors on a GPU are
first reduced to a checksum on the device (`device_checksum`), so hashing never copies them to host.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
import xxhash

from hybridrl.rollout.protocol import SAMPLER_CONTRACT_VERSION

HASH_ALGO = "xxh3_128"


class PublicationError(RuntimeError):
    """A publication that failed (the engine may hold some of its tensors)."""


class PublicationRefused(PublicationError):
    """A publication refused before anything was copied: the engine still serves its old version."""


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy() if t.numel() else b"")


_CHECKSUM_WORDS = 1 << 22          # words per chunk: bounds the index tensor at 32 MiB


def device_checksum(t: torch.Tensor) -> bytes:
    """Two position-weighted sums (mod 2**64) of the tensor's bytes read as 64-bit words, computed
    on the tensor's own device: no host copy of the weights. Odd weights make the first sum change
    with any single changed word; the second (sum of squared weighted words) catches compensating
    changes. A checksum against transport faults, not a cryptographic hash."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = b.numel() // 8 * 8
    words = b[:whole]
    if words.storage_offset() % 8:
        words = words.clone()
    words = words.view(torch.int64)
    tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
    tail[: b.numel() - whole] = b[whole:]
    s1 = tail.view(torch.int64).sum() * (2 * words.numel() + 1)
    s2 = s1 * s1
    for start in range(0, words.numel(), _CHECKSUM_WORDS):
        chunk = words[start: start + _CHECKSUM_WORDS]
        weighted = chunk * torch.arange(2 * start + 1, 2 * (start + chunk.numel()), 2, dtype=torch.int64,
                                        device=t.device)
        s1 = s1 + weighted.sum()
        s2 = s2 + (weighted * weighted).sum()
    return torch.stack([s1, s2]).cpu().numpy().tobytes()


def tensor_digest(name: str, t: torch.Tensor, *, on_device: bool | None = None) -> str:
    """xxh3-128 over the tensor's name, dtype, shape and bytes. For a tensor off the CPU (or with
    `on_device=True`) the bytes are first reduced to `device_checksum` where they live, so a GPU
    publication never copies the weights to host to hash them (the digest says which it is)."""
    h = xxhash.xxh3_128()
    _update(h, name, t, on_device=t.device.type != "cpu" if on_device is None else on_device)
    return h.hexdigest()


def _update(h, name: str, t: torch.Tensor, *, on_device: bool = False) -> None:
    h.update(f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
    if on_device:
        h.update(b"device_checksum|" + device_checksum(t))
    else:
        h.update(_tensor_bytes(t))


class StreamHasher:
    """Running checkpoint hash over (name, tensor) pairs; they must arrive in canonical order."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self._last: str | None = None
        self.tensor_hashes: dict[str, str] = {}
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}

    def update(self, name: str, t: torch.Tensor) -> str:
        if self._last is not None and name <= self._last:
            raise PublicationError(f"tensor '{name}' out of canonical order (after '{self._last}')")
        self._last = name
        digest = tensor_digest(name, t)
        self._h.update(digest.encode())
        self.tensor_hashes[name] = digest
        self.specs[name] = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
        return digest

    def hexdigest(self) -> str:
        return f"{HASH_ALGO}:{self._h.hexdigest()}"


def file_hash(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


def model_hashes(model_dir: str | Path) -> dict[str, str]:
    """Hashes of the model config, tokenizer and chat template a release is valid with."""
    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    template = ""
    if (d / "chat_template.jinja").exists():
        template = (d / "chat_template.jinja").read_text()
    elif (d / "tokenizer_config.json").exists():
        template = json.loads((d / "tokenizer_config.json").read_text()).get("chat_template") or ""
    return {
        "model_config_hash": "sha256:" + hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "tokenizer_hash": file_hash(d / "tokenizer.json"),
        "chat_template_hash": "sha256:" + hashlib.sha256(template.encode()).hexdigest(),
    }


@dataclass(kw_only=True)
class PolicyRelease:
    policy_version: int
    training_step: int
    checkpoint_hash: str
    model_config_hash: str
    tokenizer_hash: str
    chat_template_hash: str
    sampler_contract: int = SAMPLER_CONTRACT_VERSION
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    ready: bool = False
    tensor_hashes: dict[str, str] = field(default_factory=dict)
    tensor_specs: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)

    def summary(self) -> dict:
        """The reference's manifest fields (without the per-tensor tables)."""
        d = asdict(self)
        d.pop("tensor_hashes")
        d.pop("tensor_specs")
        return d

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def check_structure(self, weight_spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Refuse a release whose tensors do not match what the engine holds, before any copy."""
        problems = check_specs(self.tensor_specs.items(), weight_spec)
        if problems:
            raise PublicationRefused(f"publication v{self.policy_version} refused: " + "; ".join(problems))


def check_specs(published: Iterable[tuple[str, tuple[tuple[int, ...], str]]],
                weight_spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], limit: int = 5) -> list[str]:
    published = dict(published)
    problems = []
    missing = sorted(set(weight_spec) - set(published))
    extra = sorted(set(published) - set(weight_spec))
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {missing[:limit]}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s): {extra[:limit]}")
    for name in sorted(set(published) & set(weight_spec)):
        shape, dtype = published[name]
        want_shape, want_dtype = weight_spec[name]
        want = str(want_dtype).replace("torch.", "")
        if tuple(shape) != tuple(want_shape) or dtype != want:
            problems.append(f"'{name}' is {tuple(shape)} {dtype}, the engine holds {tuple(want_shape)} {want}")
    return problems
