"""What objective a config trains, in words, and the combinations that would silently train
something else (`hybridrl config show --explain`; the refusals also stop `hybridrl train` in its
preflight, the warnings are printed there).

Each check is a `Finding`: `refuse` (the run would train nothing, or not what its keys say),
`warn` (legitimate but easy to get wrong: a different divergence, a biased correction). They read
the algorithm's registry entries (`hybridrl/algo/registry.py`) and the KL table
(`hybridrl/algo/kl.py`), so the explanation is the code's own. Import-light: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.algo import distill, kl
from hybridrl.algo.registry import estimator, policy_loss

REFUSE, WARN = "refuse", "warn"


@dataclass(frozen=True)
class Finding:
    level: str          # REFUSE | WARN
    key: str            # the key to change
    message: str        # one line: what happens, and the fix

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def stale_tokens_possible(cfg: Any) -> bool:
    """Whether a trained token can come from an older policy version than the one being trained."""
    if cfg.algo.max_policy_lag == 0:
        return False                      # the admission filter drops every token older than the trainer
    if cfg.placement.disaggregated:
        return True
    return cfg.trainer.rollout_mode == "partial"


def findings(cfg: Any, *, train_size: int | None = None) -> list[Finding]:
    """The checks on `cfg` (a resolved Config). `train_size`: instances the task's train split really
    holds (preflight draws it), else task.train_size."""
    if cfg.run.job != "rl":
        return []
    algo, tc, agent = cfg.algo, cfg.trainer, cfg.agent
    adv = estimator(algo.advantage)
    out: list[Finding] = []

    def refuse(key: str, message: str) -> None:
        out.append(Finding(REFUSE, key, message))

    def warn(key: str, message: str) -> None:
        out.append(Finding(WARN, key, message))

    partial = tc.rollout_mode == "partial" and not cfg.placement.disaggregated
    group_signal = adv.group_baseline(algo)
    if tc.group_size == 1 and group_signal:
        refuse("trainer.group_size", f"{algo.advantage} compares each sample with its group: with groups of one "
                                     "every advantage is 0; use trainer.group_size >= 2, or an estimator without a "
                                     "group baseline (algo.advantage=gae, or reinforce_pp with "
                                     "algo.reinforce_baseline=none)")
    elif tc.group_size == 1 and algo.drop_all_equal_groups:
        refuse("algo.drop_all_equal_groups", "a group of one always has equal rewards: every episode would be "
                                             "dropped before the update; set algo.drop_all_equal_groups=false")
    elif algo.drop_all_equal_groups and not group_signal:
        warn("algo.drop_all_equal_groups", f"{algo.advantage} gives all-equal groups non-zero advantages, and they "
                                           "are dropped (fewer samples per step); set it false to train on them")
    stale = stale_tokens_possible(cfg)
    if stale and not algo.corrects_behavior:
        refuse("algo.tis_cap", "tokens sampled by older policy versions (partial rollouts, a queue, or a "
                               "disaggregated lag) would train as if on-policy: set algo.tis_cap > 0 (e.g. 2.0) or "
                               "algo.mis, or algo.max_policy_lag=0")
    filtered = agent.top_p < 1.0 or agent.top_k > 0
    if filtered and algo.corrects_behavior:
        refuse("agent.top_p" if agent.top_p < 1.0 else "agent.top_k",
               "the engines return logprobs of the full softmax, not of the top-p/top-k distribution they sample "
               "from, so the behaviour weights would not be ratios to the sampling policy; sample the full policy "
               "(agent.top_p=1, agent.top_k=-1), or turn the correction off (algo.tis_cap=0, algo.mis=off) and "
               "accept the bias")
    elif filtered:
        warn("agent.top_p" if agent.top_p < 1.0 else "agent.top_k",
             "samples of the truncated top-p/top-k distribution train as samples of the full policy (a biased "
             "gradient); RL usually samples with agent.top_p=1 agent.top_k=-1")
    if algo.uses_reference:
        option = algo.kl_option
        gradient = kl.GRADIENTS[(algo.kl_in, option)]
        if (algo.kl_in, option) not in kl.FORWARD:
            warn("algo.kl_estimator", f"{option} in the {algo.kl_in} gives {gradient}; "
                                      f"algo.kl_estimator=auto gives grad KL(pi || ref)")
    lora = cfg.train.lora
    if lora.enabled and lora.dropout > 0:
        refuse("train.lora.dropout", f"{lora.dropout} in an RL run: the training forward draws dropout masks while "
                                     "the rollout engine and the old-logprob and reference forwards run without, so "
                                     "the first PPO ratio is not 1 and the clip and the behaviour weights compare two "
                                     "different functions; set train.lora.dropout=0 for RL (dropout is for SFT)")
    if distill.enabled(cfg) and algo.drop_all_equal_groups:
        warn("algo.drop_all_equal_groups", "the teacher scores every token, so a group of equal rewards still carries "
                                           "its signal, and such groups are dropped; set it false to distil on them")
    if algo.drop_truncated:
        warn("algo.drop_truncated", "truncated members leave their group before its statistics, so running out "
                                    "of budget is a way out of a negative advantage; false keeps them with "
                                    "their reward")
    if algo.overlong_buffer >= agent.max_response_tokens:
        refuse("algo.overlong_buffer", f"{algo.overlong_buffer} >= agent.max_response_tokens "
                                       f"({agent.max_response_tokens}): every response would be penalised; use a "
                                       "buffer shorter than the budget")
    if stale and algo.max_policy_lag < 0:
        warn("algo.max_policy_lag", "no bound on the age of trained tokens: queued or waiting groups of any age "
                                    "train, corrected by the behaviour weight only; set algo.max_policy_lag")
    return out + _prompt_findings(cfg, partial, train_size)


def _prompt_findings(cfg: Any, partial: bool, train_size: int | None) -> list[Finding]:
    """How a step draws its prompts: a sampler with nothing to choose between, a step larger than its split."""
    out = []
    if cfg.task.sampler != "uniform" and not cfg.task.mixture:
        out.append(Finding(WARN, "task.sampler", f"{cfg.task.sampler} draws prompts of a task.mixture; this run has "
                                                 "one task, whose prompts are drawn uniformly (each once per epoch): "
                                                 "the knob does nothing here; set task.mixture or leave "
                                                 "task.sampler=uniform"))
    drawn = cfg.trainer.groups_in_flight if partial else cfg.trainer.prompts_per_step
    size = train_size if train_size is not None else cfg.task.train_size
    if drawn > size:
        out.append(Finding(REFUSE, "trainer.prompts_per_step", f"a step draws {drawn} prompts from a train split of "
                                                               f"{size}: a prompt would be drawn twice in one step (one "
                                                               "merged group); raise task.train_size or lower "
                                                               "trainer.prompts_per_step / oversample"))
    return out


def describe(cfg: Any) -> list[str]:
    """The objective `cfg` trains, one line per part: every transformation between the configured
    objective and the one optimised (where the KL goes and its effective scale, what the prompt sampler
    reweights, what is dropped and why)."""
    algo, agent = cfg.algo, cfg.agent
    adv, loss = estimator(algo.advantage), policy_loss(algo.policy_loss)
    lines = [f"advantage      {algo.advantage}: {adv.summary}",
             f"policy loss    {algo.policy_loss}: {loss.summary}",
             _kl_line(algo)]
    if distill.enabled(cfg):
        d = cfg.distill
        target = ("its own position's reverse KL (prefixes held fixed: not the sequence KL's gradient)"
                  if d.discount == 0 else "the sequence reverse KL's gradient" if d.discount == 1 else
                  f"the reverse KL's return discounted by {d.discount} per policy token")
        lines.append(f"distillation   teacher {d.teacher}: per token A = {d.reward_weight} x the advantage above - "
                     f"{d.kl_coef} x the return of (log pi - log teacher) over the later policy tokens "
                     f"(distill.discount={d.discount}): {target}")
    lines.append(f"entropy bonus  {algo.entropy_coef} x H per policy token, not on tokens the behaviour correction "
                 "rejects (w = 0)" if algo.entropy_coef > 0 else "entropy bonus  off")
    lines.append(f"behaviour      {_behaviour(algo)}")
    if stale_tokens_possible(cfg):
        bound = f"at most {algo.max_policy_lag} versions old" if algo.max_policy_lag >= 0 else "of any age"
        lines.append(f"stale tokens   trained tokens may be {bound} ({algo.partial_policy} for multi-version "
                     f"rows), each weighted by w")
    else:
        lines.append("stale tokens   none: every trained token was sampled by the version being trained "
                     "(w corrects the engine's numerics only)")
    truncated = ("dropped before the group statistics" if algo.drop_truncated else
                 "kept in their group with the reward they earned, and trained")
    if algo.overlong_buffer > 0:
        truncated += (f"; overlong penalty up to {algo.overlong_penalty} over the last {algo.overlong_buffer} of "
                      f"{agent.max_response_tokens} response tokens")
    lines.append(f"truncated      {truncated}")
    errors = ("a scored failure (its reward from the task, trained like any failure: raising is no way out of a "
              "negative advantage)" if agent.on_agent_error == "score" else
              "dropped (agent.on_agent_error=drop: never trained, counted as agent_errors)")
    lines.append(f"agent errors   an episode whose agent code raised is {errors}; one that raised before any "
                 "generation has nothing to train and is dropped")
    return lines + _dropped_lines(algo) + [_prompts_line(cfg)]


def _behaviour(algo: Any) -> str:
    if algo.tis_cap > 0:
        how = "truncated (TIS)" if algo.tis_mode == "truncate" else "masked above it (decoupled PPO)"
        behaviour = f"w = pi_old / pi_behaviour per token, {how} at {algo.tis_cap}"
    else:
        behaviour = "none (w = 1)"
    if algo.mis != "off":
        behaviour += f"; MIS at {algo.mis} level drops ratios outside [{algo.mis_low}, {algo.mis_high}]"
    return behaviour


def _kl_line(algo: Any) -> str:
    """Where the KL penalty goes and the coefficient it trains with."""
    if not algo.uses_reference:
        return "KL penalty     off (algo.kl_coef=0): no reference model"
    option, coef = algo.kl_option, algo.kl_coef
    gradient = kl.GRADIENTS[(algo.kl_in, option)] + (
        f"; log(pi / ref) clamped to +-{kl.CLAMP_NATS:g} nats straight through (the value saturates there, the "
        "gradient does not)")
    if algo.kl_in == "loss":
        return (f"KL penalty     {coef} x {option} in the loss, per policy token x sg(pi / pi_behaviour) (the "
                f"samples' importance weight), aggregated as the policy loss is; effective coefficient {coef}: "
                f"{gradient}")
    where = {"grpo": "added outside the group normalisation (not divided by the group's std)",
             "rloo": "added outside the group baseline",
             "reinforce_pp": "in the per-token returns, whitened together with the task reward over the batch "
                             "(relative to the task reward its scale stays",
             "gae": "in GAE's token rewards" + (", whitened with the advantages over the batch (relative to the "
                                                "task reward its scale stays" if algo.gae_whiten else "")}
    placed = where.get(algo.advantage, "passed to the estimator as token rewards (its own treatment)")
    if placed.endswith("stays"):
        placed += f" {coef})"
    return (f"KL penalty     -{coef} x {option} per policy token as a reward: each token's advantage gets the sum "
            f"of those from it to the end of the response, {placed}; effective coefficient {coef}: {gradient}")


def _dropped_lines(algo: Any) -> list[str]:
    """What never reaches the gradient, and why."""
    kl_note = " and their KL penalty with them" if algo.uses_reference else ""
    equal = (f"groups of equal task reward dropped (no signal for the group baseline){kl_note}"
             if algo.drop_all_equal_groups else "groups kept")
    lag = f", tokens older than {algo.max_policy_lag} versions ({algo.stale})" if algo.max_policy_lag >= 0 else ""
    return [f"all-equal      {equal}",
            "dropped        infra-invalid and aborted episodes (not the policy's doing: never trained, never in a "
            f"group's statistics, never a sampler's failure){lag}; tokens with w = 0 keep their place in the loss's "
            "denominators but carry no gradient"]


def _prompts_line(cfg: Any) -> str:
    """Which prompts the expectation is over: uniform, or reweighted by the task mixture's sampler."""
    task = cfg.task
    if not task.mixture:
        return "prompts        the train split, uniformly (each prompt once per epoch)"
    weights = ", ".join(f"{m.name} {m.weight:g}" for m in task.mixture)
    line = f"prompts        tasks by weight ({weights}; shares count trained groups, task.share_policy={task.share_policy})"
    if task.sampler == "difficulty":
        line += (f"; within a task the difficulty sampler reweights the objective, uncorrected: prompt i weighs "
                 f"{task.sampler_floor:g} + {1 - task.sampler_floor:g} x N w_i / sum_j w_j times its uniform weight "
                 f"(w_i = 4 s_i (1 - s_i), s_i its success rate over its last {task.sampler_window} scored episodes)")
    else:
        line += "; within a task, uniformly"
    return line


def explain(cfg: Any, *, train_size: int | None = None) -> tuple[str, list[Finding]]:
    """(the text of `hybridrl config show --explain`, the findings)."""
    if cfg.run.job != "rl":
        return f"run.job={cfg.run.job}: no RL objective", []
    found = findings(cfg, train_size=train_size)
    lines = ["the RL objective:", *(f"  {line}" for line in describe(cfg))]
    if found:
        lines.append("checks:")
        lines += [f"  {f.level:6s} {f}" for f in found]
    else:
        lines.append("checks: nothing refused or warned")
    return "\n".join(lines), found
