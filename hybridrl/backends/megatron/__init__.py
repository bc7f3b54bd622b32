"""The Megatron-core training backend: the only package of hybridrl that imports megatron.

    from hybridrl.backends.megatron import MegatronConfig, MegatronEngine
    engine = MegatronEngine.from_hf(model_dir, cfg)          # on every rank, after init_distributed

Importing this package (and `config`) stays light: megatron and torch load on first use of the
engine, so configs and the CLI never pay for them.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from hybridrl.backends.megatron.config import MegatronConfig

# megatron-core announces at import that Transformer Engine / Apex are absent and it uses its
# torch fallbacks (what we want on CPU and with the local layer spec); say it once in our docs, not
# on every rank of every run.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex|Apex is not installed)",
                        category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
# megatron-core 0.16 calls torch APIs that torch 2.13 deprecates (TypedStorage, the *_into_tensor
# collectives) and reads .grad of non-leaf views in its optimizer: harmless, and not ours to fix.
warnings.filterwarnings("ignore", message=r"TypedStorage is deprecated", category=UserWarning)
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf", category=UserWarning)
# megatron-core's torch checkpoint strategy loads through torch's deprecated `load_state_dict` and
# ShardedTensor (every checkpoint load: a resume, `hybridrl export`): the same, not ours to fix.
warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)

if TYPE_CHECKING:
    from hybridrl.backends.megatron.engine import MegatronEngine

__all__ = ["MegatronConfig", "MegatronEngine"]


def __getattr__(name: str) -> Any:
    if name == "MegatronEngine":
        from hybridrl.backends.megatron.engine import MegatronEngine

        return MegatronEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
