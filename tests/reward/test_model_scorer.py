"""A reward model as a reward component: the tiny classifier's known rule, batched scoring equal to
transformers' own classifier, the evaluator id, bad directories refused, and (real ranks) every
trajectory of a rollout recorded with the model's score and id beside the verifier's."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.assets.tiny_classifier import build_tiny_classifier
from hybridrl.reward.model_scorer import RewardModelScorer, weights_version
from tests.controller.test_rl_e2e import hybridrl_train
from tests.workers.test_hybrid import RECIPE


@pytest.fixture(scope="module")
def policy(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


@pytest.fixture(scope="module")
def classifier(policy, tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("rm") / "tiny-rm", policy)


def _rule(ids, positive):
    return 1.0 if ids[-1] in positive else 0.0


def test_tiny_classifier_follows_its_rule_and_batched_scores_match_transformers(policy, classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier)
    positive = set(json.loads((classifier / "hybridrl_asset.json").read_text())["positive_token_ids"])
    texts = ["12 * 3 = 36", "hello", "<answer>7</answer>", "x9", "the result is 4", "no digits here at all!"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    hf = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.no_grad():
        reference = [hf(torch.tensor([r])).logits.item() for r in rows]       # one row at a time, no padding
    rule = [_rule(r, positive) for r in rows]
    assert rule == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert reference == pytest.approx(rule, abs=1e-5)
    scorer = RewardModelScorer(classifier, component="rm", device=torch.device("cpu"), batch_size=4,
                               policy_tokenizer_dir=policy)
    assert scorer.same_tokenizer
    assert scorer.score_ids(rows) == pytest.approx(reference, abs=1e-5)    # batched, right-padded
    assert scorer.evaluator == f"rm:tiny-rm@{weights_version(classifier)}" and len(weights_version(classifier)) == 12
    # another tokenizer: decoded and encoded again, same scores
    other = RewardModelScorer(classifier, component="rm", device=torch.device("cpu"), policy_tokenizer_dir=None)
    assert not other.same_tokenizer
    assert other.score_ids(other.token_rows(rows, tok)) == pytest.approx(reference, abs=1e-5)


def test_a_directory_without_a_scalar_head_is_refused(policy, tmp_path):
    with pytest.raises(ValueError, match="no scalar head"):
        RewardModelScorer(policy, component="rm", device=torch.device("cpu"))
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    two = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=64, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1,
                                                     intermediate_size=16, num_labels=2))
    two.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModelScorer(tmp_path, component="rm", device=torch.device("cpu"))


def test_rollout_records_the_reward_model_component_per_trajectory(tmp_path, policy, classifier):
    proc = hybridrl_train(RECIPE, "run.job=tests.workers.critic_jobs:REWARD_MODEL_ROLLOUT", f"model.path={policy}",
                          f"run.dir={tmp_path}", f"reward_model.path={classifier}", "reward_model.component=rm",
                          "reward_model.weight=0.5", "reward_model.batch_size=3", "trainer.prompts_per_step=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    positive = set(json.loads((classifier / "hybridrl_asset.json").read_text())["positive_token_ids"])
    trajectories = r["trajectories"]
    assert len(trajectories) == 4 and len(r["collected"]) == 4      # a sync rollout and a partial collection
    version = weights_version(classifier)
    for t in trajectories + r["collected"]:                          # every status the policy answers for
        assert t["status"] in ("completed", "truncated", "failed")
        assert t["evaluators"]["rm"] == f"rm:tiny-rm@{version}"
        assert t["rewards"]["rm"] == pytest.approx(_rule(t["ids"], positive), abs=1e-5)
        assert "correct" in t["rewards"] and t["evaluators"]["correct"] != t["evaluators"]["rm"]
        others = sum(v for k, v in t["rewards"].items() if k != "rm")       # the verifier's (weights 1 here)
        assert t["reward"] == pytest.approx(others + 0.5 * t["rewards"]["rm"], abs=1e-5)
    assert r["report"]["phases"]["reward_model"]["count"] >= 1               # scored in one phase per rollout


def test_preflight_names_a_bad_critic_or_reward_model_before_anything_starts(tmp_path, capsys, policy, classifier):
    from tests.test_preflight import GRPO, refused

    run = f"run.dir={tmp_path / 'run'}"
    err = refused(capsys, GRPO, f"model.path={policy}", run, "algo.advantage=gae", "critic.path=/no/such/critic")
    assert "critic.path=/no/such/critic: no such directory" in err
    err = refused(capsys, GRPO, f"model.path={policy}", run, f"reward_model.path={policy}")
    assert f"reward_model.path={policy}: no scalar head" in err and "tiny-classifier" in err
    err = refused(capsys, GRPO, f"model.path={policy}", run, "reward_model.path=/no/rm")
    assert "reward_model.path=/no/rm: no such directory" in err
    from tests.test_preflight import check

    code, err = check(capsys, GRPO, f"model.path={policy}", run, f"reward_model.path={classifier}",
                      "algo.advantage=gae", f"critic.path={policy}", "--check")
    assert code == 0, err
