"""The `publish` section: how trained weights reach the rollout engines.

The parity probe's tolerance depends on the dtypes on both sides: float32 engines and trainers
agree to ~1e-6 nats, but one bfloat16 rounding step of a logit of 2-4 is already 2^-7..2^-6
(0.008-0.016) nats, and a forward pass in bfloat16 accumulates several of them, so logprobs of
bfloat16 (or float16) kernels on either side differ by a few 1e-2. `parity_tolerance_floor` is the
least a tolerance must allow to be passable at all, `default_parity_tolerance` what runs in those
dtypes use (preflight refuses a tolerance below the floor, naming this value).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import check_choice, check_positive, knob

VERIFY_MODES = ("post_copy", "structure")
SIXTEEN_BIT = ("bfloat16", "float16")


def _names(dtypes) -> list[str]:
    return [str(d).replace("torch.", "") for d in dtypes]


def parity_tolerance_floor(*dtypes) -> float:
    """The smallest parity tolerance a probe between these dtypes (names or torch dtypes) can pass:
    one bfloat16 step at a logit of ~3 (2^-6 nats) with a 16-bit side, else none."""
    return 2.0 ** -6 if any(d in SIXTEEN_BIT for d in _names(dtypes)) else 0.0


def default_parity_tolerance(*dtypes) -> float:
    """What runs in these dtypes use: 0.1 nats with a 16-bit side, 1e-3 when both are float32."""
    return 0.1 if parity_tolerance_floor(*dtypes) > 0 else 1e-3


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
    parity_every: int = knob(1, "run the parity probe on a process's first publication and on every version that "
                                "is a multiple of this (1 = every publication); metrics parity/probed says which did")
    parity_tolerance: float = knob(1e-3, "fail the publication when engine and trainer logprobs differ by more "
                                         "(max abs, nats). 1e-3 suits float32 on both sides; with bfloat16/float16 "
                                         "on either side use 0.1 (preflight refuses less than 2^-6 there: one "
                                         "bfloat16 step of a logit of ~3)")

    def __post_init__(self) -> None:
        check_positive("bucket_mb", self.bucket_mb)
        check_choice("verify", self.verify, VERIFY_MODES)
        check_positive("parity_prompts", self.parity_prompts, allow_zero=True)
        check_positive("parity_tokens", self.parity_tokens)
        check_positive("parity_every", self.parity_every)
        check_positive("parity_tolerance", self.parity_tolerance)
