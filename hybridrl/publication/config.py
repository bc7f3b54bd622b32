"""The `publish` section: how trained weights reach the rollout engines."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import check_choice, check_positive, knob

VERIFY_MODES = ("post_copy", "structure")


@dataclass(kw_only=True)
class PublishConfig:
    """Weight publication: buckets, verification, the logprob parity probe."""

    bucket_mb: int = knob(64, "bucket size in MiB; a fused group (q/k/v, gate/up) is never split")
    verify: str = knob(
        "post_copy", "post_copy: after the copy the engine hashes its own storage and compares with the sender's "
                     "digests; a mismatch is copied once more, then the step stops with an error naming the "
                     "tensor (the version never switches to unverified weights; the native engine only). "
                     "structure: names/shapes/dtypes checked before the copy, contents hashed for the manifest "
                     "only (the parity probe remains the check on contents)")
    parity_prompts: int = knob(2, "fixed prefixes the parity probe generates from after each publication; 0 = off")
    parity_tokens: int = knob(8, "greedy tokens per parity prefix")
    parity_tolerance: float = knob(1e-3, "fail the publication when engine and trainer logprobs differ by more "
                                         "(max abs, nats)")

    def __post_init__(self) -> None:
        check_positive("bucket_mb", self.bucket_mb)
        check_choice("verify", self.verify, VERIFY_MODES)
        check_positive("parity_prompts", self.parity_prompts, allow_zero=True)
        check_positive("parity_tokens", self.parity_tokens)
        check_positive("parity_tolerance", self.parity_tolerance)
