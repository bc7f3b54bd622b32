"""A toy rollout engine, a toy training engine, a toy model family and a toy front end defined outside
the package (what a user's module holds), each one row, named in a config as

    rollout.engine=tests.plugins.toy_plugins:ENGINE
    train.engine=tests.plugins.toy_plugins:TRAIN      (its own `train` section: `train.toy_mark`)
    model.family=tests.plugins.toy_plugins:FAMILY
    task.front_end=tests.plugins.toy_plugins:ToyLoop

Each leaves its mark on what it touches, so a run shows all four were used: the front end stamps on the
trajectories its name, the engine it drove and the family that engine's model is of; the training engine
reports its section's `toy_mark` with every optimizer step (metrics `train/toy_mark`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.agent.loop import AgentRunner
from hybridrl.backends.megatron.config import MegatronConfig
from hybridrl.config import knob
from hybridrl.backends.families import ModelFamily
from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.backends.native.engine import NativeEngine
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec
from hybridrl.training.registry import TrainEngineSpec

_ENGINE = "hybridrl.backends.native.engine:NativeEngine"

# a Llama-shaped family of another name: its layer kinds exist, so it is this one row
FAMILY = ModelFamily(name="toyllama", architectures=("ToyLlamaForCausalLM",),
                     adapter=Lazy("hybridrl.backends.megatron.adapters.llama:LlamaAdapter"),
                     tiny_config=Lazy("hybridrl.assets.tiny_model:llama_config"), reads_mlp_bias=True,
                     summary="Llama under another architecture name (a test)")


class ToyEngine(NativeEngine):
    """The native engine, under another name, that says which family it serves."""

    @classmethod
    def for_rank(cls, cfg, ctx) -> "ToyEngine":
        return cls.from_pretrained(cfg.model.path, cfg.rollout.engine_section, device=ctx.device)

    def family(self) -> str:
        return self._core.spec.arch


ENGINE = RolloutEngineSpec(
    "toy", engine=Lazy("tests.plugins.toy_plugins:ToyEngine"), config=NativeEngineConfig,
    colocated_transport=Lazy(f"{_ENGINE}.colocated_transport"),
    releasable_tags=Lazy(f"{_ENGINE}.releasable_tags_for"),
    serves_before_publication=True, reads_back_weights=True, remote_publication=True,
    summary="the native engine under another name (a test)")


class ToyLoop(AgentRunner):
    """The built-in loop as a front end of one's own: it marks each trajectory before it is scored."""

    def finish(self, ep) -> None:
        super().finish(ep)
        ep.traj.metadata["toy"] = {"front_end": type(self).__name__, "engine": type(self.engine).__name__,
                                   "family": self.engine.family()}


@dataclass
class ToyTrainConfig(MegatronConfig):
    """Megatron's knobs and one of the toy engine's own."""

    engine: str = knob("tests.plugins.toy_plugins:TRAIN", "the training engine")
    toy_mark: float = knob(0.0, "reported with every optimizer step as train/toy_mark")


TRAIN = TrainEngineSpec("toytrain", engine=Lazy("tests.plugins.toy_train:ToyTrainEngine"), config=ToyTrainConfig)
