"""The `algo` config section: which estimator, loss, KL, off-policy correction and filters an RL run uses.

Estimator and policy-loss names are checked against their registries (`algo/registry.py`);
combinations that involve other sections are checked by `hybridrl/algo/explain.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.algo import correction, kl
from hybridrl.algo.registry import ESTIMATORS, POLICY_LOSSES, estimator
from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob

PARTIAL_POLICIES = ("newest_segment", "per_segment", "discard_mixed")


@dataclass(kw_only=True)
class AlgoConfig:
    """Advantage estimator, policy loss, KL penalty, entropy bonus, off-policy correction, filters."""

    advantage: str = knob("grpo", "advantage estimator (hybridrl/algo/advantages/: grpo | rloo | reinforce_pp | gae, "
                                  "or module:ATTR); gae trains a critic: see the critic section")
    norm_adv_by_std: bool = knob(True, "grpo: divide by the group's reward std")
    reinforce_baseline: str = knob("group", "reinforce_pp: baseline 'group' (group mean reward) or 'none'")
    gamma: float = knob(1.0, "gae: discount")
    lam: float = knob(0.95, "gae: lambda")
    gae_whiten: bool = knob(True, "gae: whiten the advantages over the step's policy tokens (mean 0, std 1)")
    policy_loss: str = knob("ppo_clip", "policy loss (hybridrl/algo/losses/: ppo_clip, or module:ATTR)")
    clip_low: float = knob(0.2, "PPO clip range below 1 (ratio >= 1 - clip_low)")
    clip_high: float = knob(0.2, "PPO clip range above 1 (ratio <= 1 + clip_high); > clip_low is 'clip-higher'")
    dual_clip: float = knob(3.0, "dual-clip constant c > 1 for negative advantages; 0 disables")
    kl_estimator: str = knob("auto", "KL penalty estimator: auto (k2 in the loss, k1 in the reward: both give the "
                                     "gradient of KL(policy || reference)) | k1 | k2 | k3; k3 in the loss gives "
                                     "the gradient of KL(reference || policy), k1 in the loss none (refused); "
                                     "see hybridrl/algo/kl.py")
    kl_coef: float = knob(0.0, "KL penalty coefficient; 0 disables it (and the reference model)")
    kl_in: str = knob("loss", "where the KL penalty goes: 'loss' (per token, weighted by the ratio to the sampling "
                              "policy) or 'reward' (token rewards)")
    entropy_coef: float = knob(0.0, "entropy bonus coefficient")
    tis_cap: float = knob(2.0, "behaviour weight cap: each policy token's loss is weighted by r = pi_old / "
                               "pi_behaviour (rollout/trainer mismatch, stale tokens) handled per tis_mode above "
                               "the cap; 0 disables the weight")
    tis_mode: str = knob("truncate", "a behaviour weight above tis_cap: truncate (w = min(r, cap), TIS) | mask "
                                     "(w = 0: the token is dropped, AReaL's decoupled PPO)")
    mis: str = knob("off", "masked importance sampling: drop tokens (token: IcePop-style) or whole rows (sequence: "
                           "the product of the row's ratios; geometric: their geometric mean) whose ratio "
                           "pi_old / pi_behaviour leaves [mis_low, mis_high]; off | token | sequence | geometric")
    mis_low: float = knob(0.5, "mis: lower bound of the kept band (0 = no lower bound)")
    mis_high: float = knob(2.0, "mis: upper bound of the kept band")
    drop_truncated: bool = knob(False, "TRUNCATED trajectories (max turns / tokens / time: the policy's doing): "
                                       "false keeps them in their group's baseline with the reward they earned and "
                                       "trains them; true drops them before the group statistics (they then never "
                                       "get a negative advantage)")
    overlong_buffer: int = knob(0, "soft overlong penalty (DAPO): a response reaching into the last this many "
                                   "tokens of agent.max_response_tokens costs up to overlong_penalty, linearly, and "
                                   "one the token budget or the context cut costs overlong_penalty; 0 disables it")
    overlong_penalty: float = knob(1.0, "the largest overlong penalty (a reward component 'overlong')")
    drop_all_equal_groups: bool = knob(True, "drop groups whose rewards are all equal (no signal for a group baseline)")
    max_policy_lag: int = knob(-1, "drop trajectories with tokens older than this many versions; -1 = off")
    stale: str = knob("drop", "a trajectory over max_policy_lag: drop (counted as filter/policy_lag) | requeue (partial "
                              "rollouts: its whole group leaves the step and its prompt is launched again, fresh; "
                              "counted as stale/requeued_groups)")
    partial_policy: str = knob("newest_segment", "a trajectory holding tokens of several policy versions (partial "
                               "rollouts): newest_segment (train its newest version's tokens, the rest is context; "
                               "that version may be older than the trainer's, so they are corrected by the "
                               "behaviour weight) | per_segment (train all, each token corrected by its own "
                               "behaviour logprob; needs tis_cap > 0) | discard_mixed (no token of such a row is "
                               "trained)")
    router_replay: str = knob("off", "mixture-of-experts policies: rollout = the trainer's routers use the experts the "
                                     "rollout engine recorded for each token (rollout routing replay, R3); off = they "
                                     "choose themselves (the agreement is logged as moe/router_agreement either way)")
    ppo_epochs: int = knob(1, "passes over each rollout batch; each pass takes ppo_mini_batches optimizer steps")
    ppo_mini_batches: int = knob(1, "optimizer steps per epoch: the admitted batch is split into this many "
                                    "mini-batches of (nearly) equal sequence counts, each one step with its own "
                                    "global loss denominators. 1 epoch x 1 mini-batch: no old-logprob forward "
                                    "(the training forward's logprobs serve); more: one extra forward per batch")

    def __post_init__(self) -> None:
        ESTIMATORS.check("advantage", self.advantage)
        POLICY_LOSSES.check("policy_loss", self.policy_loss)
        check_choice("reinforce_baseline", self.reinforce_baseline, ("group", "none"))
        check_choice("kl_estimator", self.kl_estimator, kl.OPTIONS)
        check_choice("kl_in", self.kl_in, ("loss", "reward"))
        check_choice("router_replay", self.router_replay, ("off", "rollout"))
        check_choice("tis_mode", self.tis_mode, correction.TIS_MODES)
        check_choice("mis", self.mis, correction.MIS_LEVELS)
        for name in ("ppo_epochs", "ppo_mini_batches"):
            check_positive(name, getattr(self, name))
        for name in ("clip_low", "clip_high"):
            check_positive(name, getattr(self, name))
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ConfigValueError("dual_clip", f"must be > 1 or 0 (off), got {self.dual_clip}")
        for name in ("kl_coef", "entropy_coef", "tis_cap", "mis_low", "overlong_buffer", "overlong_penalty"):
            check_positive(name, getattr(self, name), allow_zero=True)
        if self.mis_high <= self.mis_low:
            raise ConfigValueError("mis_high", f"must be > mis_low ({self.mis_low}), got {self.mis_high}")
        check_range("gamma", self.gamma, 0.0, 1.0)
        check_range("lam", self.lam, 0.0, 1.0)
        check_choice("stale", self.stale, ("drop", "requeue"))
        check_choice("partial_policy", self.partial_policy, PARTIAL_POLICIES)
        if self.partial_policy == "per_segment" and self.tis_cap == 0:
            raise ConfigValueError("partial_policy", "per_segment corrects old segments with the behaviour weight: "
                                                     "set tis_cap > 0 (e.g. 2.0), or use newest_segment")
        if self.kl_coef > 0 and self.kl_in == "loss" and self.kl_option == "k1":
            raise ConfigValueError("kl_estimator", "k1 in the loss has an expected gradient of 0 (E[grad log pi] = 0): "
                                                   "it adds noise and regularises nothing; use kl_estimator=auto "
                                                   "(k2: the gradient of KL(policy || reference)) or kl_in=reward")

    @property
    def kl_option(self) -> str:
        """The KL estimator in use (`auto` resolved for kl_in)."""
        return kl.resolve(self.kl_estimator, self.kl_in)

    @property
    def uses_critic(self) -> bool:
        return estimator(self.advantage).needs_critic

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def corrects_behavior(self) -> bool:
        """Whether stale or mismatched tokens get a behaviour weight (TIS or MIS)."""
        return self.tis_cap > 0 or self.mis != "off"
