"""The root configuration: one section per component, each a keyword-only dataclass.

A component's config lives beside the component (import-light: no torch, no megatron) and is
registered here by name (`SECTIONS`: section -> "module:Class", help), so this package imports no
component: the root class `Config` is assembled from the table on first use (`root()`), and the
package layering stays one way (every component imports `config.fields`; `config` imports none of
them). `configs/<section>.yaml` mirrors each section's defaults (written by `hybridrl config
defaults --write configs`). What spans sections (a placement's needs of the rollout and trainer
sections, say) is checked once the whole config is built (`check_across`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, knob, section

@dataclass(kw_only=True)
class SelfCheckConfig:
    """The self-check job: exercises dispatch, collect and error propagation on every rank."""

    batch_size: int = knob(7, "samples in the self-check batch (uneven on purpose)")
    fail_rank: int = knob(-1, "rank that raises in the error-propagation step; -1 = no injected failure")

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigValueError("batch_size", f"must be >= 1, got {self.batch_size}")


# section -> (its class, "module:Class"; what it configures). The order is the order of `config show`.
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("run", "hybridrl.jobs:RunConfig", "the run: name, directory, job, seed"),
    ("distributed", "hybridrl.distributed.config:DistributedConfig", "processes, devices, control plane"),
    ("placement", "hybridrl.distributed.placement:PlacementConfig",
     "which ranks train and which generate: colocated or disaggregated"),
    ("model", "hybridrl.backends.model_config:ModelConfig", "the policy model"),
    ("train", "hybridrl.training.registry:train_section",
     "the training engine (actor, reference, critic): train.engine's section"),
    ("rollout", "hybridrl.backends.rollout_config:RolloutConfig", "the rollout engine: native, sglang or vllm, layout, knobs"),
    ("publish", "hybridrl.publication.config:PublishConfig", "weight publication: buckets, verification, parity probe"),
    ("hybrid", "hybridrl.workers.config:HybridConfig", "the colocated worker's mode switches"),
    ("agent", "hybridrl.agent.config:AgentConfig", "the async agent loop: episode budgets, concurrency, sampling"),
    ("tools", "hybridrl.agent.config:ToolsConfig", "the tool sandbox pool and its limits"),
    ("task", "hybridrl.envs.config:TaskConfig", "the task: splits, reward weights, SFT demonstrations, options"),
    ("env", "hybridrl.envs.config:EnvServiceConfig", "the leased environment service"),
    ("gateway", "hybridrl.gateway.config:GatewayConfig", "the OpenAI-compatible gateway of task.agent episodes"),
    ("algo", "hybridrl.algo.config:AlgoConfig", "the RL algorithm: advantages, policy loss, KL, filters"),
    ("critic", "hybridrl.workers.critic_config:CriticConfig",
     "the value model of algo.advantage=gae: init, optimizer, value clip"),
    ("distill", "hybridrl.algo.distill:DistillConfig", "on-policy distillation: a teacher that scores the policy's tokens"),
    ("reward_model", "hybridrl.reward.config:RewardModelConfig", "a learned reward model as a reward component"),
    ("trainer", "hybridrl.controller.config:TrainerConfig", "the RL loop: steps, batch shape, validation, checkpoints"),
    ("incidents", "hybridrl.controller.incidents:IncidentsConfig",
     "rules over each step's metrics (NaN, mismatch, a drop, KL, failed episodes) and their actions"),
    ("sft", "hybridrl.controller.sft_config:SFTConfig", "supervised warm start on the task's demonstrations"),
    ("store", "hybridrl.store.config:StoreConfig", "the run ledger: trajectory store, lineage, retention"),
    ("telemetry", "hybridrl.telemetry.config:TelemetryConfig", "the run's timeline and OpenTelemetry traces of episodes and steps"),
    ("selfcheck", "hybridrl.config.schema:SelfCheckConfig", "the self-check job"),
)


def _class(target: str, train_engine: str | None) -> type:
    """A section's class: the class `target` names, or what the function it names returns for the run's
    training engine (`train`: that engine's row's section). Not a plug-in point (the table is ours), so no
    registry: the config package imports nothing outside itself."""
    module, _, attr = target.partition(":")
    found = vars(importlib.import_module(module))[attr]
    return found if isinstance(found, type) else found(train_engine)


def root(train_engine: str | None = None) -> type:
    """The root class `Config` of a run whose `train.engine` is `train_engine` (None: the default engine):
    a keyword-only dataclass with one field per registered section, whose `__post_init__` runs the checks
    across sections. One class per set of section classes (the default engine named or not: the same)."""
    return _assemble(tuple(_class(target, train_engine) for _, target, _ in SECTIONS))


@functools.cache
def _assemble(classes: tuple[type, ...]) -> type:
    fields = [(name, cls, section(cls, help)) for (name, _, help), cls in zip(SECTIONS, classes)]
    cls = dataclasses.make_dataclass("Config", fields, kw_only=True,
                                     namespace={"__doc__": "The whole run.", "__post_init__": check_across})
    cls.__module__ = __name__
    return cls


def check_across(self) -> None:
    """What one section needs of others, each refusal naming its key."""
    if self.run.needs_model and not self.model.path:
        raise ConfigValueError("model.path", f"run.job={self.run.job} needs an HF model directory: set "
                                             "model.path in the recipe or pass model.path=DIR")
    self.placement.resolve().validate(self)
    self.rollout.engine_row.check_run(self)
    rolling_back = self.incidents.rolling_back()
    if rolling_back and (self.placement.mode != "colocated" or self.trainer.rollout_mode != "sync"):
        raise ConfigValueError(f"incidents.{rolling_back[0]}", "rollback restores a checkpoint inside the running "
                               "process: it needs placement.mode=colocated and trainer.rollout_mode=sync (no episode "
                               "in flight across steps); use stop (the same command then resumes)")
    if not self.rollout.engine_row.reads_back_weights and self.publish.verify == "post_copy":
        raise ConfigValueError("publish.verify", "post_copy needs an engine that reads its weights back after "
                                                 f"the copy; rollout.engine={self.rollout.engine} cannot: set "
                                                 "publish.verify=structure")
