"""The Megatron-core training engine as a registered row (`training.registry.ENGINES`). Import-light."""

from hybridrl.backends.megatron.config import MegatronConfig
from hybridrl.registry import Lazy
from hybridrl.training.registry import TrainEngineSpec

ENGINE = TrainEngineSpec("megatron", engine=Lazy("hybridrl.backends.megatron.engine:MegatronEngine"),
                         config=MegatronConfig)
