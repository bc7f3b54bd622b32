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

from hybridrl.config.fields import ConfigValueError, check_choice, knob, section

# Jobs shipped with hybridrl; `run.job` may also name any "package.module:JOB" attribute.
JOBS = ("selfcheck", "rl", "sft")


@dataclass(kw_only=True)
class RunConfig:
    """What this run is and where it writes."""

    name: str = knob("run", "run name; also the default run directory's leaf")
    dir: str = knob("runs/${run.name}", "run directory: logs, metrics.jsonl, checkpoints")
    job: str = knob("selfcheck", f"what the ranks run: one of {list(JOBS)} or 'package.module:JOB'")
    seed: int = knob(0, "global seed: data order, sampling, init")
    log_level: str = knob("info", "debug | info | warning | error")

    def __post_init__(self) -> None:
        if ":" not in self.job:
            check_choice("job", self.job, JOBS)
        check_choice("log_level", self.log_level, ("debug", "info", "warning", "error"))


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model: a Hugging Face model directory on local disk."""

    path: str = knob("", "HF model directory on local disk (config.json, *.safetensors, tokenizer files); "
                         "dtypes are per engine: train.dtype, rollout.native.dtype, rollout.sglang.dtype")


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
    ("run", "hybridrl.config.schema:RunConfig", "the run: name, directory, job, seed"),
    ("distributed", "hybridrl.distributed.config:DistributedConfig", "processes, devices, control plane"),
    ("placement", "hybridrl.distributed.placement:PlacementConfig",
     "which ranks train and which generate: colocated or disaggregated"),
    ("model", "hybridrl.config.schema:ModelConfig", "the policy model"),
    ("train", "hybridrl.backends.megatron.config:MegatronConfig",
     "the Megatron-core training backend (actor and reference)"),
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
    ("reward_model", "hybridrl.reward.config:RewardModelConfig", "a learned reward model as a reward component"),
    ("trainer", "hybridrl.controller.config:TrainerConfig", "the RL loop: steps, batch shape, validation, checkpoints"),
    ("sft", "hybridrl.controller.sft_config:SFTConfig", "supervised warm start on the task's demonstrations"),
    ("store", "hybridrl.store.config:StoreConfig", "the run ledger: trajectory store, lineage, retention"),
    ("selfcheck", "hybridrl.config.schema:SelfCheckConfig", "the self-check job"),
)


def _class(target: str) -> type:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def root() -> type:
    """The root class `Config`: a keyword-only dataclass with one field per registered section, whose
    `__post_init__` runs the checks across sections."""
    fields = [(name, _class(target), section(_class(target), help)) for name, target, help in SECTIONS]
    cls = dataclasses.make_dataclass("Config", fields, kw_only=True,
                                     namespace={"__doc__": "The whole run.", "__post_init__": check_across})
    cls.__module__ = __name__
    return cls


def check_across(self) -> None:
    """What one section needs of others, each refusal naming its key."""
    if self.run.job in ("rl", "sft") and not self.model.path:
        raise ConfigValueError("model.path", f"run.job={self.run.job} needs an HF model directory: set "
                                             "model.path in the recipe or pass model.path=DIR")
    if self.placement.disaggregated:
        _check_disaggregated(self)
    if not self.rollout.engine_config.reads_back_weights and self.publish.verify == "post_copy":
        raise ConfigValueError("publish.verify", "post_copy needs an engine that reads its weights back after "
                                                 f"the copy; rollout.engine={self.rollout.engine} cannot: set "
                                                 "publish.verify=structure")


def _check_disaggregated(self) -> None:
    """What the disaggregated placement needs of the other sections, each refusal naming its key."""
    if self.run.job in ("sft", "selfcheck"):
        raise ConfigValueError("placement.mode", f"run.job={self.run.job} runs colocated: the disaggregated "
                                                 "placement is for RL (run.job=rl)")
    if self.algo.max_policy_lag < 0:
        raise ConfigValueError("algo.max_policy_lag", "placement.mode=disaggregated needs a lag bound: 1 lets the "
                                                      "rollout ranks generate the next step while this one "
                                                      "trains, 0 makes them wait for every update")
    refusals = (
        ("rollout.engine", not self.rollout.engine_config.remote_publication,
         f"the disaggregated placement publishes to engines on their own ranks; rollout.engine={self.rollout.engine} "
         "takes weights from a colocated trainer only: use another rollout.engine or placement.mode=colocated"),
        ("rollout.tp", self.rollout.tp != 1, "each rollout rank serves its own engine: set rollout.tp=1"),
        ("trainer.rollout_mode", self.trainer.rollout_mode != "sync",
         "the disaggregated placement collects continuously on its own: leave trainer.rollout_mode=sync (partial "
         "rollouts are for the colocated placement)"),
        ("trainer.dynamic_sampling", self.trainer.dynamic_sampling,
         "not available with the disaggregated placement yet: use placement.mode=colocated"),
    )
    for key, refused, why in refusals:
        if refused:
            raise ConfigValueError(key, why)
