"""A toy rollout engine, a toy model family and a toy front end defined outside the package (what a
user's module holds), each one row, named in a config as

    rollout.engine=tests.plugins.toy_plugins:ENGINE
    model.family=tests.plugins.toy_plugins:FAMILY
    task.front_end=tests.plugins.toy_plugins:ToyLoop

Each leaves its mark on the trajectories it touches (their metadata), so a run shows all three were
used: the front end stamps its name, the engine it drove and the family that engine's model is of."""

from __future__ import annotations

from hybridrl.agent.loop import AgentRunner
from hybridrl.backends.families import ModelFamily
from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.backends.native.engine import NativeEngine
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec

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
