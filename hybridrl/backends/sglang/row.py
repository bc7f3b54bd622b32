"""The sglang rollout engine as a registered row (`rollout.registry.ENGINES`). Import-light: the config
checks read it; the engine loads when a rank builds it."""

from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec

_ENGINE = "hybridrl.backends.sglang.engine:SGLangEngine"

ENGINE = RolloutEngineSpec(
    "sglang", engine=Lazy(_ENGINE), config=SGLangConfig,
    colocated_transport=Lazy(f"{_ENGINE}.colocated_transport"),
    releasable_tags=Lazy(f"{_ENGINE}.releasable_tags_for"),
    # its weights live in its scheduler processes in its own fused layout (no read-back), and arrive over
    # CUDA IPC from a colocated trainer only
    serves_before_publication=False, reads_back_weights=False, remote_publication=False,
    summary="GPU extra", section_help="the SGLang engine (GPU extra)",
)
