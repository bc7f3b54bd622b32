"""The replicas rollout engine as a registered row (`rollout.registry.ENGINES`). Import-light: the config
checks read it; the client loads when a rank builds it."""

from hybridrl.backends.replicas.config import ReplicasConfig
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec

_ENGINE = "hybridrl.backends.replicas.engine:ReplicasEngine"

ENGINE = RolloutEngineSpec(
    "replicas", engine=Lazy(_ENGINE), config=ReplicasConfig,
    colocated_transport=Lazy(f"{_ENGINE}.colocated_transport"),
    releasable_tags=Lazy(f"{_ENGINE}.releasable_tags_for"),
    # a replica serves only weights this trainer published to it; each reads a bucket back after its copy
    serves_before_publication=False, reads_back_weights=True,
    # the trainer's rank is the replicas' client; a rollout rank of the disaggregated placement is not (yet)
    remote_publication=False,
    summary="native engines in processes of their own (hybridrl replica), over HTTP; losing one does not stop "
            "the run",
    section_help="the replica pool: where replicas register, how many to wait for, timeouts",
    single_rank="one client per trainer rank talks to the whole pool (rollout.tp does not apply to it)",
)
