"""The reasoning_gym task on the real reasoning-gym package: seeded splits from disjoint seed ranges,
episodes through the agent loop whose reward is the package's own `score_answer`, the ledger's
components, a mixture, and the refusals (a bad dataset or config, the package missing)."""

from __future__ import annotations

import sys

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks import get_task
from tests.envs.episodes import check_tokens, ledger_rewards, run_scripted

rg = pytest.importorskip("reasoning_gym", reason="pip install -e .[reasoning-gym]")
from reasoning_gym.utils import extract_answer  # noqa: E402

from hybridrl.envs.tasks.reasoning_gym import PAIRS, SPAN, split_base  # noqa: E402

CHAIN = {"name": "chain_sum", "weight": 3, "config": {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3}}
LEGS = {"name": "leg_counting", "weight": 1, "config": {"max_animals": 3}}


def task_cfg(*datasets, tools=("calculator",), **task):
    opts = [f"task.options.datasets={[dict(d) for d in datasets]!r}".replace("'", '"'),
            f"task.options.tools=[{','.join(tools)}]"]
    return load_config(None, ["task.name=reasoning_gym", *opts, *(f"task.{k}={v}" for k, v in task.items())]).task


def package_item(inst, config):
    """The package's own item for an instance, made afresh (not through the task's cache)."""
    m = inst.metadata
    dataset = rg.create_dataset(m["dataset"], seed=m["seed"], size=m["size"], **config)
    return dataset, dataset[m["index"]]


def test_splits_are_seeded_disjoint_and_weighted():
    task = get_task("reasoning_gym", task_cfg(CHAIN, LEGS, train_size=40, validation_size=16, seed=5))
    train, val = task.train_split(), task.validation_split()
    assert [i.task_id for i in train] == [i.task_id for i in get_task("reasoning_gym", task.cfg).train_split()]
    assert sum(i.metadata["dataset"] == "chain_sum" for i in train) == 30            # weights 3 : 1
    assert not {i.task_id for i in train} & {i.task_id for i in val}
    for split, insts in (("train", train), ("validation", val)):
        base = split_base(5, split)
        assert all(base <= i.metadata["seed"] < base + SPAN for i in insts)
    assert split_base(5, "validation") // SPAN % 2 == 0 and split_base(5 + PAIRS, "train") // SPAN % 2 == 1
    for inst in train + val:                                    # the instance is the package's item
        _, item = package_item(inst, CHAIN["config"] if inst.metadata["dataset"] == "chain_sum" else LEGS["config"])
        assert inst.messages[-1]["content"] == item["question"] and inst.reference == item["answer"]


def test_a_tiny_generator_never_repeats_a_validation_question_in_train():
    small = {"name": "chain_sum", "weight": 1, "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                          "max_digits": 1}}
    task = get_task("reasoning_gym", task_cfg(small, train_size=120, validation_size=40))
    questions = [i.messages[-1]["content"] for i in task.validation_split()]
    assert not set(questions) & {i.messages[-1]["content"] for i in task.train_split()}
    assert not set(questions) & {d[0]["content"] for d in task.sft_demonstrations(60)}
    with pytest.raises(ValueError, match="allows too few"):
        task.train_split(1000)                                  # 200 questions exist: it says so


def respond(inst, turn):
    """A policy that uses the calculator on chain_sum, then answers: right, near, wrong or untagged."""
    kind = int(inst.task_id[-1], 16) % 4
    if inst.metadata["expression"] and turn == 0:
        return f"<calc>{inst.metadata['expression']}</calc>"
    answer = {0: inst.reference, 1: inst.reference + ".0", 2: "banana", 3: inst.reference}[kind]
    return f"let me see <answer>{answer}</answer>" if kind != 3 else f"<answer>{answer}</answer> or <answer>7</answer>"


def test_episodes_score_with_the_packages_own_scorer(tokenizer, tmp_path):
    task = get_task("reasoning_gym", task_cfg(CHAIN, LEGS, validation_size=12))
    instances = task.validation_split()
    engine, trajectories = run_scripted(tokenizer, task, instances, respond)
    check_tokens(engine, trajectories)
    stored = ledger_rewards(tmp_path, trajectories)
    values = set()
    for inst, traj in zip(instances, trajectories):
        assert traj.status == S.COMPLETED, traj.metadata
        assert [c.name for c in traj.tool_calls] == (["calculator"] if inst.metadata["expression"] else [])
        config = CHAIN["config"] if inst.metadata["dataset"] == "chain_sum" else LEGS["config"]
        dataset, item = package_item(inst, config)
        last = [r for r in engine.sampled if r.startswith(traj.trajectory_id + "/")][-1]
        final = tokenizer.decode(engine.sampled[last], skip_special_tokens=True)   # the final turn's text
        expected = dataset.score_answer(extract_answer(final), item)
        assert traj.reward == traj.rewards["correct"] == expected
        assert traj.reward_evaluators["correct"].startswith(f"reasoning_gym.{inst.metadata['dataset']}@")
        assert stored[traj.trajectory_id] == traj.rewards            # the ledger has the components
        values.add(expected)
    assert {0.0, 1.0} <= values                                  # right and wrong answers both happened


def test_in_a_mixture_with_the_curriculums_shares():
    from hybridrl.data.mixture import MixtureStream

    cfg = load_config(None, ["task.name=mixture", "task.train_size=24", "task.validation_size=4",
                             'task.mixture=[{name: calculator, weight: 1}, {name: reasoning_gym, weight: 3, '
                             'options: {datasets: [{name: chain_sum, config: {min_digits: 2}}]}}]']).task
    task = get_task("mixture", cfg)
    assert task.task_names() == ["calculator", "reasoning_gym"]
    stream = MixtureStream({n: t.train_split() for n, t in task.tasks.items()}, task.weights, seed=0)
    drawn = stream.next(40)
    assert sum(i.task == "reasoning_gym" for i in drawn) == 30
    inst = next(i for i in drawn if i.task == "reasoning_gym")
    assert task.for_instance(inst) is task.tasks["reasoning_gym"]
    from hybridrl.data.episode import EpisodeOutcome

    outcome = EpisodeOutcome(answer=inst.reference, num_answers=1, final_text=f"<answer>{inst.reference}</answer>",
                             completed=True)
    assert task.score(inst, outcome).rewards["correct"] == 1.0


@pytest.mark.parametrize("datasets, match", [
    ([{"name": "chain_summ"}], r"datasets\[0\].name': no reasoning-gym dataset 'chain_summ'; did you mean 'chain_sum'"),
    ([{"name": "chain_sum", "config": {"seed": 3}}], r"datasets\[0\].config': seed and size are the task's"),
    ([{"name": "chain_sum", "config": {"min_terms": 0}}], r"datasets\[0\].config': reasoning-gym refused it"),
    ([{"name": "chain_sum", "config": {"no_such_knob": 1}}], r"datasets\[0\].config': reasoning-gym refused it"),
    ([], "name at least one reasoning-gym dataset"),
])
def test_bad_options_are_refused_at_load(datasets, match):
    with pytest.raises(ConfigError, match=match):
        task_cfg(*datasets)


def test_without_the_package_a_recipe_is_refused_with_the_pip_command(monkeypatch):
    from hybridrl.shipped import recipe_path

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)          # what `import reasoning_gym` sees uninstalled
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package .*pip install -e \.\[reasoning-gym\]"):
        load_config(recipe_path("rg_chain_sum_grpo_cpu"), ["model.path=/nowhere"])


def test_a_generator_that_is_not_deterministic_is_never_scored_against_another_item():
    """An entry is generated again to be scored; a generator that ignores its seed would score the answer
    against another question: the evaluator refuses (the episode becomes infrastructure-invalid)."""
    import random as global_random
    from dataclasses import dataclass as dc

    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS, register_dataset

    @dc
    class UnseededConfig:
        seed: int | None = None
        size: int = 500

    class Unseeded(ProceduralDataset):
        def __init__(self, config):
            super().__init__(config=config, seed=config.seed, size=config.size)

        def __getitem__(self, idx):
            a, b = global_random.randint(0, 10**9), global_random.randint(0, 10**9)
            return {"question": f"{a} + {b} =", "answer": str(a + b), "metadata": {}}

    if "hybridrl_unseeded" not in DATASETS:
        register_dataset("hybridrl_unseeded", Unseeded, UnseededConfig)
    task = get_task("reasoning_gym", task_cfg({"name": "hybridrl_unseeded"}, tools=(), validation_size=2))
    from hybridrl.data.episode import EpisodeOutcome

    inst = task.validation_split()[0]
    outcome = EpisodeOutcome(answer=inst.reference, num_answers=1, final_text=f"<answer>{inst.reference}</answer>",
                             completed=True)
    with pytest.raises(ValueError, match="not deterministic"):
        task.score(inst, outcome)
