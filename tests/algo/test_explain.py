"""`hybridrl config show --explain` and the preflight's objective checks: the combinations that would
silently train something else are refused (exit 2, one line naming the key), the doubtful ones warned."""

from __future__ import annotations

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.algo.explain import REFUSE, WARN, explain, findings
from tests.launch import ROOT

GRPO = str(ROOT / "recipes" / "calc_grpo_cpu.yaml")
PPO = str(ROOT / "recipes" / "calc_ppo_cpu.yaml")


def found(*overrides: str, recipe: str = GRPO, **kw) -> dict[str, str]:
    cfg = load_config(recipe, ["model.path=unused", *overrides])
    return {f.key: f.level for f in findings(cfg, **kw)}


def test_a_reward_model_with_partial_rollouts_is_not_refused():
    """The colocated partial collection scores its complete groups with the reward model too."""
    assert "reward_model.path" not in found("reward_model.path=/rm", "trainer.rollout_mode=partial")


def test_the_shipped_rl_recipes_pass_clean():
    for recipe in (GRPO, PPO, str(ROOT / "recipes" / "qwen2.5_0.5b_gsm8k_calc.yaml")):
        assert found(recipe=recipe) == {}


@pytest.mark.parametrize("overrides, key, level", [
    # GAE + groups of one + drop-all-equal: every episode dropped
    (["algo.advantage=gae", "trainer.group_size=1"], "algo.drop_all_equal_groups", REFUSE),
    # a group baseline with groups of one: every advantage 0
    (["trainer.group_size=1", "algo.drop_all_equal_groups=false"], "trainer.group_size", REFUSE),
    # stale tokens (partial rollouts, a disaggregated lag) without a behaviour weight
    (["trainer.rollout_mode=partial", "algo.tis_cap=0"], "algo.tis_cap", REFUSE),
    (["placement.mode=disaggregated", "algo.max_policy_lag=1", "algo.tis_cap=0"], "algo.tis_cap", REFUSE),
    # behaviour weights under top-p / top-k: the engines' logprobs are of the full softmax
    (["agent.top_p=0.9"], "agent.top_p", REFUSE),
    (["agent.top_k=20", "algo.tis_cap=0", "algo.mis=token"], "agent.top_k", REFUSE),
    (["agent.top_p=0.9", "algo.tis_cap=0"], "agent.top_p", WARN),
    # KL options whose gradient is not that of KL(policy || reference)
    (["algo.kl_coef=0.1", "algo.kl_estimator=k3"], "algo.kl_estimator", WARN),
    (["algo.kl_coef=0.1", "algo.kl_in=reward", "algo.kl_estimator=k3"], "algo.kl_estimator", WARN),
    (["algo.drop_truncated=true"], "algo.drop_truncated", WARN),
    (["algo.overlong_buffer=96"], "algo.overlong_buffer", REFUSE),
    (["trainer.rollout_mode=partial"], "algo.max_policy_lag", WARN),
    (["trainer.prompts_per_step=40", "task.train_size=32"], "trainer.prompts_per_step", REFUSE),
])
def test_each_check(overrides, key, level):
    assert found(*overrides).get(key) == level, found(*overrides)


def test_what_passes():
    assert found("trainer.rollout_mode=partial", "algo.tis_cap=0", "algo.max_policy_lag=0") == {}   # nothing stale
    assert found("algo.advantage=gae", "trainer.group_size=1", "algo.drop_all_equal_groups=false") == {}
    assert found("algo.advantage=reinforce_pp", "algo.reinforce_baseline=none", "trainer.group_size=1",
                 "algo.drop_all_equal_groups=false") == {}
    assert found("algo.kl_coef=0.1") == found("algo.kl_coef=0.1", "algo.kl_in=reward") == {}     # auto: k2 / k1
    assert found("trainer.prompts_per_step=16", "task.train_size=32", train_size=12) == {"trainer.prompts_per_step":
                                                                                          REFUSE}


def test_the_explanation_says_what_each_part_optimises():
    text, _ = explain(load_config(GRPO, ["model.path=unused", "algo.kl_coef=0.05", "trainer.rollout_mode=partial",
                                          "algo.max_policy_lag=2", "algo.overlong_buffer=16"]))
    assert "grpo: the sample's reward minus its group's mean" in text
    assert "k2 in the loss" in text and "grad KL(pi || ref)" in text
    assert "at most 2 versions old" in text and "truncated (TIS) at 2.0" in text
    assert "kept in their group with the reward they earned" in text and "overlong penalty up to 1.0" in text


def test_config_show_explain_and_train_refuse_with_exit_2(capsys, tiny_models):
    assert main(["config", "show", GRPO, "model.path=unused", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "# the RL objective:" in out and "# checks: nothing refused or warned" in out
    assert main(["config", "show", GRPO, "model.path=unused", "agent.top_p=0.9", "--explain"]) == 2
    captured = capsys.readouterr()
    assert "# checks:" in captured.out and "refused: agent.top_p: the engines return logprobs" in captured.err
    model = tiny_models("qwen2")
    code = main(["train", GRPO, f"model.path={model}", "run.dir=/nonexistent/never", "trainer.group_size=1",
                 "algo.drop_all_equal_groups=false", "--check"])
    err = capsys.readouterr().err
    assert code == 2 and "trainer.group_size: grpo compares each sample with its group" in err
    assert len([line for line in err.splitlines() if line.startswith("hybridrl:")]) == 1


def test_explain_states_where_the_kl_goes_and_its_effective_scale():
    """Before: '0.05 x k1 in the reward' and nothing else, while GRPO divided it by each group's std."""
    text, _ = explain(load_config(GRPO, ["model.path=unused", "algo.kl_coef=0.05", "algo.kl_in=reward"]))
    kl_line = next(line for line in text.splitlines() if "KL penalty" in line)
    assert "outside the group normalisation" in kl_line and "effective coefficient 0.05" in kl_line
    assert "their KL penalty with them" in text                    # all-equal groups take their KL term along
    assert "infra-invalid and aborted episodes" in text            # what is dropped, and why
    text, _ = explain(load_config(GRPO, ["model.path=unused", "algo.kl_coef=0.05", "algo.advantage=reinforce_pp"]))
    assert "effective coefficient 0.05" in text and "x sg(pi / pi_behaviour)" in text


def test_explain_states_the_difficulty_samplers_reweighting():
    """Before: the difficulty sampler reweighted the objective with no word in `explain`."""
    from types import SimpleNamespace

    from hybridrl.algo.explain import describe

    cfg = load_config(GRPO, ["model.path=unused"])
    task = SimpleNamespace(mixture=[SimpleNamespace(name="calculator", weight=1.0),
                                    SimpleNamespace(name="guess_number", weight=2.0)],
                           share_policy="wait", sampler="difficulty", sampler_floor=0.25, sampler_window=8)
    lines = describe(SimpleNamespace(algo=cfg.algo, agent=cfg.agent, run=cfg.run, placement=cfg.placement,
                                     trainer=cfg.trainer, distill=cfg.distill, task=task))
    prompts = next(line for line in lines if line.startswith("prompts"))
    assert "reweights the objective, uncorrected" in prompts and "0.25 + 0.75 x N w_i / sum_j w_j" in prompts
    assert "calculator 1, guess_number 2" in prompts


def test_lora_dropout_is_refused_for_rl():
    """Before: train.lora.dropout > 0 ran RL with dropout in the training forward only (the first ratio != 1)."""
    assert found("train.lora.rank=8", "train.lora.dropout=0.1").get("train.lora.dropout") == REFUSE
    assert "train.lora.dropout" not in found("train.lora.rank=8")


def test_explain_states_the_kl_clamp_and_what_an_agent_error_trains():
    """Before: nothing about the straight-through clamp of log(pi / ref), nor about agent errors."""
    text, _ = explain(load_config(GRPO, ["model.path=unused", "algo.kl_coef=0.05", "algo.kl_estimator=k2"]))
    kl_line = next(line for line in text.splitlines() if "KL penalty" in line)
    assert "clamped to +-10 nats straight through" in kl_line
    errors = next(line for line in text.splitlines() if "agent errors" in line)
    assert "a scored failure" in errors
    text, _ = explain(load_config(GRPO, ["model.path=unused", "agent.on_agent_error=drop"]))
    assert "dropped (agent.on_agent_error=drop" in text


def test_a_difficulty_sampler_without_a_mixture_is_named_as_doing_nothing():
    """Before: task.sampler=difficulty on one task was silently ignored."""
    assert found("task.sampler=difficulty").get("task.sampler") == WARN
    assert "task.sampler" not in found()
