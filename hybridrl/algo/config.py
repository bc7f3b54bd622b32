"""The `algo` config section: which estimator, loss, KL and filters an RL run uses."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "gae")
POLICY_LOSSES = ("ppo_clip",)
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(kw_only=True)
class AlgoConfig:
    """Advantage estimator, policy loss, KL penalty, entropy bonus, mismatch correction, filters."""

    advantage: str = knob("grpo", f"advantage estimator: {' | '.join(ADVANTAGE_ESTIMATORS)} (gae trains a critic: see the critic section)")
    norm_adv_by_std: bool = knob(True, "grpo: divide by the group's reward std")
    reinforce_baseline: str = knob("group", "reinforce_pp: baseline 'group' (group mean reward) or 'none'")
    gamma: float = knob(1.0, "gae: discount")
    lam: float = knob(0.95, "gae: lambda")
    gae_whiten: bool = knob(True, "gae: whiten the advantages over the step's policy tokens (mean 0, std 1)")
    policy_loss: str = knob("ppo_clip", f"policy loss: {' | '.join(POLICY_LOSSES)}")
    clip_low: float = knob(0.2, "PPO clip range below 1 (ratio >= 1 - clip_low)")
    clip_high: float = knob(0.2, "PPO clip range above 1 (ratio <= 1 + clip_high); > clip_low is 'clip-higher'")
    dual_clip: float = knob(3.0, "dual-clip constant c > 1 for negative advantages; 0 disables")
    kl_estimator: str = knob("k3", f"KL(policy || reference) estimator: {' | '.join(KL_ESTIMATORS)}")
    kl_coef: float = knob(0.0, "KL penalty coefficient; 0 disables it (and the reference model)")
    kl_in: str = knob("loss", "where the KL penalty goes: 'loss' (per token) or 'reward' (token rewards)")
    entropy_coef: float = knob(0.0, "entropy bonus coefficient")
    tis_cap: float = knob(2.0, "truncated importance sampling cap for rollout/trainer mismatch; 0 disables")
    drop_truncated: bool = knob(True, "drop TRUNCATED (overlong) trajectories from updates")
    drop_all_equal_groups: bool = knob(True, "drop groups whose rewards are all equal (no signal)")
    max_policy_lag: int = knob(-1, "drop trajectories with tokens older than this many versions; -1 = off")
    stale: str = knob("drop", "a trajectory over max_policy_lag: drop (counted as filter/policy_lag) | requeue (partial "
                              "rollouts: its whole group leaves the step and its prompt is launched again, fresh; "
                              "counted as stale/requeued_groups)")
    partial_policy: str = knob("newest_segment", "a trajectory holding tokens of several policy versions (partial "
                               "rollouts): newest_segment (train its newest version's tokens, the rest is context) | "
                               "per_segment (train all, each token corrected by its own behaviour logprob; needs "
                               "tis_cap > 0) | discard_mixed (no token of such a row is trained)")
    router_replay: str = knob("off", "mixture-of-experts policies: rollout = the trainer's routers use the experts the "
                                     "rollout engine recorded for each token (rollout routing replay, R3); off = they "
                                     "choose themselves (the agreement is logged as moe/router_agreement either way)")
    ppo_epochs: int = knob(1, "passes over each rollout batch; each pass takes ppo_mini_batches optimizer steps")
    ppo_mini_batches: int = knob(1, "optimizer steps per epoch: the admitted batch is split into this many "
                                    "mini-batches of (nearly) equal sequence counts, each one step with its own "
                                    "global loss denominators. 1 epoch x 1 mini-batch: no old-logprob forward "
                                    "(the training forward's logprobs serve); more: one extra forward per batch")

    def __post_init__(self) -> None:
        check_choice("advantage", self.advantage, ADVANTAGE_ESTIMATORS)
        check_choice("reinforce_baseline", self.reinforce_baseline, ("group", "none"))
        check_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("kl_in", self.kl_in, ("loss", "reward"))
        check_choice("router_replay", self.router_replay, ("off", "rollout"))
        for name in ("ppo_epochs", "ppo_mini_batches"):
            check_positive(name, getattr(self, name))
        for name in ("clip_low", "clip_high"):
            check_positive(name, getattr(self, name))
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ConfigValueError("dual_clip", f"must be > 1 or 0 (off), got {self.dual_clip}")
        for name in ("kl_coef", "entropy_coef", "tis_cap"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_range("gamma", self.gamma, 0.0, 1.0)
        check_range("lam", self.lam, 0.0, 1.0)
        check_choice("stale", self.stale, ("drop", "requeue"))
        check_choice("partial_policy", self.partial_policy, ("newest_segment", "per_segment", "discard_mixed"))
        if self.partial_policy == "per_segment" and self.tis_cap == 0:
            raise ConfigValueError("partial_policy", "per_segment corrects old segments with truncated importance "
                                                     "weights: set tis_cap > 0 (e.g. 2.0), or use newest_segment")

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0
