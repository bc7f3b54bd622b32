"""The `data` task (a file of chats + ground truths, and a score function with veRL's signature) and SFT
from the same file: episodes through the agent loop scored by the user's function, its dict's entries
in the ledger, deterministic held-out splits, JSONL / Parquet / a saved `datasets` dataset, and the SFT
rows' loss mask on the assistant tokens only."""

from __future__ import annotations

import json
import random
import sys

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks import get_task
from tests.envs.episodes import check_tokens, ledger_rewards, load_file, run_scripted

SCORE = '''
import re

def compute_score(solution_str, ground_truth, extra_info=None):
    found = re.findall(r"<answer>(.*?)</answer>", solution_str)
    correct = float(bool(found) and found[-1].strip() == str(ground_truth) and extra_info["unit"] == "cm")
    return {"score": correct + 0.5 * len(found), "correct": correct, "answers": len(found), "pred": "text"}
'''
VERL_SCORE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if data_source == "toy" and ground_truth in solution_str else 0.0
'''


def rows(n=40):
    out = []
    for i in range(n):
        chat = [{"role": "system", "content": "Convert."}, {"role": "user", "content": f"{i} m in cm?"}]
        if i % 2:
            chat += [{"role": "assistant", "content": f"<calc>{i} * 100</calc>"},
                     {"role": "tool", "content": str(i * 100)},
                     {"role": "assistant", "content": f"<answer>{i * 100}</answer>"}]
        out.append({"messages": chat, "answer": str(i * 100), "info": {"unit": "cm", "i": i}})
    return out


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    (tmp_path / "toy_score.py").write_text(SCORE)
    return tmp_path


def data_cfg(*extra):
    return load_config(None, ["task.name=data", "task.options.path=toy.jsonl", "task.options.score=toy_score.py:"
                              "compute_score", "task.options.validation_fraction=0.25", "task.options.tools=[calculator]",
                              *extra]).task


def test_splits_are_a_fixed_partition_of_the_prompts(files):
    task = get_task("data", data_cfg())
    train, val = task.train_split(100), task.validation_split(100)
    assert len(train) + len(val) == 40 and 4 <= len(val) <= 16
    assert not {i.task_id for i in train} & {i.task_id for i in val}
    assert all(i.messages[-1]["role"] == "user" and i.tools == ("calculator",) for i in train + val)
    shuffled = rows()
    random.Random(1).shuffle(shuffled)
    (files / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shuffled + shuffled[:5]))
    again = get_task("data", data_cfg())                        # order and duplicates change nothing
    assert {i.task_id for i in again.validation_split(100)} == {i.task_id for i in val}
    (files / "val.jsonl").write_text(json.dumps(rows(50)[45]) + "\n")
    other = get_task("data", data_cfg("task.options.validation_path=val.jsonl"))
    assert len(other.train_split(100)) == 40 and [i.reference for i in other.validation_split()] == ["4500"]


def policy(inst, turn):
    i = inst.metadata["info"]["i"]
    if i % 3 == 0 and turn == 0:
        return f"<calc>{i} * 100</calc>"
    return {0: f"<answer>{inst.reference}</answer>", 1: f"<answer>{i}</answer> <answer>{inst.reference}</answer>",
            2: "no idea"}[i % 3]


def test_episodes_are_scored_by_the_users_function(files, tokenizer, tmp_path_factory):
    
    task = get_task("data", data_cfg())
    instances = task.train_split(12)
    engine, trajectories = run_scripted(tokenizer, task, instances, policy)
    check_tokens(engine, trajectories)
    stored = ledger_rewards(tmp_path_factory.mktemp("ledger"), trajectories)
    user = load_file(files / "toy_score.py", "toy_score_direct")
    seen = set()
    for inst, traj in zip(instances, trajectories):
        last = [r for r in engine.sampled if r.startswith(traj.trajectory_id + "/")][-1]
        final = tokenizer.decode(engine.sampled[last], skip_special_tokens=True)
        want = user.compute_score(final, inst.reference, {"unit": "cm", "i": inst.metadata["info"]["i"]})
        assert traj.reward == want["score"]
        assert traj.rewards == {"score": want["score"], "correct": want["correct"], "answers": want["answers"]}
        assert traj.reward_evaluators["score"] == "toy_score.py:compute_score@1"
        assert stored[traj.trajectory_id] == traj.rewards            # the dict's entries, in the ledger
        assert traj.status == (S.FAILED if inst.metadata["info"]["i"] % 3 == 2 else S.COMPLETED)
        seen.add(want["score"])
    assert seen == {1.5, 2.0, 0.0}                                   # right; right after a wrong one; none


def test_verl_layout_in_parquet_and_a_module_score(files, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    verl = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"Say {i}."}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(verl), files / "toy.parquet")
    (files / "verl_score.py").write_text(VERL_SCORE)
    monkeypatch.syspath_prepend(str(files))
    cfg = load_config(None, ["task.name=data", "task.options.path=toy.parquet", "task.options.score=verl_score:"
                             "compute_score"]).task                  # data_source: the row's
    task = get_task("data", cfg)
    inst = task.train_split(1)[0]
    from hybridrl.data.episode import EpisodeOutcome

    got = task.score(inst, EpisodeOutcome(answer=None, num_answers=0, final_text=f"it is {inst.reference}",
                                          completed=False))
    assert got.total == got.rewards["correct"] == 1.0 and inst.metadata["info"]["index"] == int(inst.reference)


def test_a_saved_datasets_dataset(files):
    datasets = pytest.importorskip("datasets", reason="pip install datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(12))}).save_to_disk(str(files / "saved"))
    task = get_task("data", load_config(None, ["task.name=data", "task.options.path=saved",
                                               "task.options.validation_fraction=0.3"]).task)
    assert len(task.train_split(100)) + len(task.validation_split(100)) == 12
    inst = task.validation_split(1)[0]
    from hybridrl.data.episode import EpisodeOutcome

    right = EpisodeOutcome(answer=inst.reference, num_answers=1, final_text=f"<answer>{inst.reference}</answer>",
                           completed=True)
    assert task.score(inst, right).rewards == {"correct": 1.0}     # no score function: exact <answer>


def test_a_saved_dataset_without_the_package_is_refused_at_load_with_the_pip_command(files, monkeypatch):
    (files / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)            # what `import datasets` sees uninstalled
    with pytest.raises(ConfigError, match=r"task.options.path': .*pip install -e \.\[data\]"):
        load_config(None, ["task.name=data", "task.options.path=saved"])


def test_sft_from_the_same_file_trains_on_assistant_tokens_only(files, tokenizer, tiny_models):
    from hybridrl.controller.sft import demonstration_chats, demonstration_rows

    base = ["task.name=data", "task.options.path=toy.jsonl", "task.options.validation_fraction=0.25",
            "sft.data=toy.jsonl", f"model.path={tiny_models('qwen2')}"]
    cfg = load_config(None, base)
    chats = demonstration_chats(cfg)
    held = {i.messages[-1]["content"] for i in get_task("data", cfg.task).validation_split(100)}
    assert chats and all(c[1]["content"] not in held for c in chats)         # never the held-out prompts
    assert len(chats) == sum(1 for i in range(1, 40, 2) if f"{i} m in cm?" not in held)   # rows with a solution
    eos = tokenizer.eos_token
    for chat, (ids, mask) in zip(chats, demonstration_rows(cfg, tokenizer)):
        spans, current = [], []
        for i, m in zip(ids, mask):
            if m:
                current.append(i)
            elif current:
                spans.append(current)
                current = []
        spans += [current] if current else []
        want = [m["content"] + eos for m in chat if m["role"] == "assistant"]
        assert [tokenizer.decode(s, skip_special_tokens=False) for s in spans] == want
        assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nConvert.")
    other_task = load_config(None, ["sft.data=toy.jsonl", f"model.path={tiny_models('qwen2')}"])   # calculator
    assert len(demonstration_chats(other_task)) == 20                   # the whole file's solved rows


@pytest.mark.parametrize("options, match", [
    (["task.options.path=nope.jsonl"], r"task.options.path': no such file"),
    (["task.options.path=toy.jsonl", "task.options.score=toy_score.py:nothing"], "has no function 'nothing'"),
    (["task.options.path=toy.jsonl", "task.options.score=no_module_here:f"], "cannot load 'no_module_here'"),
    (["task.options.path=toy.jsonl", "task.options.score=plain"], "is not 'module:function'"),
    (["task.options.path=toy.jsonl", "task.options.validation_fraction=0"], "no validation"),
    (["task.options.path=toy.jsonl", "sft.data=missing.jsonl"], r"sft.data': no such file"),
])
def test_bad_options_are_refused_at_load(files, options, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["task.name=data", *options])


def test_a_row_without_ground_truth_names_the_row(files):
    (files / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 0: no ground truth"):
        get_task("data", load_config(None, ["task.name=data", "task.options.path=bad.jsonl"]).task).train_split(1)


def test_a_file_of_prompts_and_answers_passes_the_preflight_for_rl_not_for_sft(files, tiny_models):
    from hybridrl.controller.sft import demonstration_chats
    from hybridrl.preflight import check_task

    (files / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)}) + "\n" for i in range(30)))
    cfg = load_config(None, ["task.name=data", "task.options.path=prompts.jsonl", "run.job=rl",
                             f"model.path={tiny_models('qwen2')}"])
    assert check_task(cfg) == len(get_task("data", cfg.task).train_split())
    with pytest.raises(ValueError, match="no demonstrations to train on .* sft.data=FILE"):
        demonstration_chats(cfg)


@pytest.mark.parametrize("value, match", [(float("nan"), "must be finite"), ({"score": float("inf")}, "must be finite"),
                                          ("high", "not a number"), ({"acc": 1.0}, "without 'score'")])
def test_a_score_that_is_not_a_finite_number_is_an_evaluator_error(value, match):
    from hybridrl.envs.tasks.data import reward_of

    with pytest.raises(ValueError, match=match):
        reward_of(value, "f@1")
