"""The root configuration: one section per component, each a keyword-only dataclass.

A component's config lives beside the component (import-light: no torch, no megatron), and is
mounted here under its section name. `configs/<section>.yaml` mirrors each section's defaults
(written by `hybridrl config defaults --write configs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.backends.megatron.config import MegatronConfig
from hybridrl.config.fields import ConfigValueError, check_choice, knob, section
from hybridrl.distributed.config import DistributedConfig
from hybridrl.distributed.placement import PlacementConfig
from hybridrl.envs.config import EnvServiceConfig, TaskConfig
from hybridrl.rollout.config import RolloutConfig
from hybridrl.algo.config import AlgoConfig
from hybridrl.controller.config import TrainerConfig
from hybridrl.controller.sft_config import SFTConfig
from hybridrl.publication.config import PublishConfig
from hybridrl.store.config import StoreConfig
from hybridrl.workers.config import HybridConfig
from hybridrl.workers.critic_config import CriticConfig
from hybridrl.reward.config import RewardModelConfig

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


@dataclass(kw_only=True)
class Config:
    """The whole run."""

    run: RunConfig = section(RunConfig, "the run: name, directory, job, seed")
    distributed: DistributedConfig = section(DistributedConfig, "processes, devices, control plane")
    placement: PlacementConfig = section(PlacementConfig, "which ranks train and which generate: colocated or "
                                                          "disaggregated")
    model: ModelConfig = section(ModelConfig, "the policy model")
    train: MegatronConfig = section(MegatronConfig, "the Megatron-core training backend (actor and reference)")
    rollout: RolloutConfig = section(RolloutConfig, "the rollout engine: native or sglang, layout, knobs")
    publish: PublishConfig = section(PublishConfig, "weight publication: buckets, verification, parity probe")
    hybrid: HybridConfig = section(HybridConfig, "the colocated worker's mode switches")
    agent: AgentConfig = section(AgentConfig, "the async agent loop: episode budgets, concurrency, sampling")
    tools: ToolsConfig = section(ToolsConfig, "the tool sandbox pool and its limits")
    task: TaskConfig = section(TaskConfig, "the task: splits, reward weights, SFT demonstrations, options")
    env: EnvServiceConfig = section(EnvServiceConfig, "the leased environment service")
    algo: AlgoConfig = section(AlgoConfig, "the RL algorithm: advantages, policy loss, KL, filters")
    critic: CriticConfig = section(CriticConfig, "the value model of algo.advantage=gae: init, optimizer, value clip")
    reward_model: RewardModelConfig = section(RewardModelConfig, "a learned reward model as a reward component")
    trainer: TrainerConfig = section(TrainerConfig, "the RL loop: steps, batch shape, validation, checkpoints")
    sft: SFTConfig = section(SFTConfig, "supervised warm start on the task's demonstrations")
    store: StoreConfig = section(StoreConfig, "the run ledger: trajectory store, lineage, retention")
    selfcheck: SelfCheckConfig = section(SelfCheckConfig, "the self-check job")

    def __post_init__(self) -> None:
        if self.run.job in ("rl", "sft") and not self.model.path:
            raise ConfigValueError("model.path", f"run.job={self.run.job} needs an HF model directory: set "
                                                 "model.path in the recipe or pass model.path=DIR")
        if self.placement.disaggregated:
            self._check_disaggregated()
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
