"""`PolicyRelease`: the manifest of one weight publication (version, training step, content hash,
model-config / tokenizer / chat-template hashes, sampler contract, readiness).

The checkpoint hash is `digest.checkpoint_hash` over the per-tensor digests (`digest.py`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hybridrl.rollout.protocol import SAMPLER_CONTRACT_VERSION
from hybridrl.rollout.weight_spec import WeightSpec, spec_problems


class PublicationError(RuntimeError):
    """A publication that failed (the engine may hold some of its tensors, never as a new version)."""


class PublicationRefused(PublicationError):
    """A publication refused before anything was copied: the engine still serves its old version."""


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
        # not asdict(): it would deep-copy the per-tensor tables only to drop them
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("tensor_hashes", "tensor_specs")}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def check_structure(self, weight_spec: WeightSpec) -> None:
        """Refuse a release whose tensors do not match what the engine holds, before any copy."""
        problems = spec_problems(self.tensor_specs.items(), weight_spec)
        if problems:
            raise PublicationRefused(f"publication v{self.policy_version} refused: " + "; ".join(problems))
