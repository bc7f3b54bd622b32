"""The rollout side's protocol (engines) and request routing; backends live in hybridrl/backends."""

from hybridrl.rollout.gateway import RolloutGateway
from hybridrl.rollout.protocol import (
    SAMPLER_CONTRACT,
    SAMPLER_CONTRACT_VERSION,
    FinishReason,
    GenerationOutput,
    GenerationTimings,
    RolloutEngine,
    SamplingParams,
)

__all__ = ["SAMPLER_CONTRACT", "SAMPLER_CONTRACT_VERSION", "FinishReason", "GenerationOutput",
           "GenerationTimings", "RolloutEngine", "RolloutGateway", "SamplingParams"]
