"""Evaluation answers stay away from the policy and from training: each attack is performed and fails.

- tool code (a real sandboxed process of the python tool) searches every file it can see (but the
  system's installed packages: /usr/lib, /usr/share, /lib...), its environment and every process's for the suite's instance ids and expected answers, while the
  evaluating process holds them and an evaluation's outputs lie in a run directory; the same search
  with that run directory made visible finds them (the search works; the defence is the view)
- the training stream is asked for each suite instance by id (plain and mixture streams)
- a suite that overlaps the training split is refused before the run starts, naming the instances
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from hybridrl.evaluate.suite import load_suite
from tests.launch import ROOT

SUITE = Path(__file__).with_name("mix_tiny.yaml")
MIXTURE = "task.mixture=[{name: calculator, weight: 1}, {name: guess_number, weight: 1, options: {max_value: 32}}]"

SEARCH = """
import json, os, stat
needles = json.loads({needles!r})
INSTALLED = ("/usr/lib", "/usr/local/lib", "/usr/share", "/lib", "/usr/include")   # the system's installed packages
found = set()
def look(text, where):
    for n in needles:
        if n in text and n not in found:
            found.add(n)
            print("FOUND", n, "in", where)
seen = 0
for top, dirs, files in os.walk("/"):
    if top in ("/proc", "/sys", "/dev") or top.startswith(INSTALLED):
        dirs[:] = []
        continue
    for name in files:
        path = os.path.join(top, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size < 1 << 22:
                with open(path, "rb") as f:
                    look(f.read(1 << 22).decode("utf-8", "replace"), path)
                seen += 1
        except OSError:
            pass
look(repr(dict(os.environ)), "environ")
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("environ", "cmdline"):
            try:
                look(open(f"/proc/{{pid}}/{{what}}", "rb").read().decode("utf-8", "replace"), f"/proc/{{pid}}/{{what}}")
            except OSError:
                pass
print("searched", seen, "files")
print("DONE")
"""


def _search(cfg, needles: list[str]):
    from hybridrl.agent.sandbox.pool import SandboxPool

    async def go():
        pool = await SandboxPool(cfg).start()
        try:
            if pool.mode == "none":
                pytest.skip("the OS refused namespaces here (isolation=none): the tool's view is not private")
            return await pool.run(SEARCH.format(needles=json.dumps(needles)))
        finally:
            await pool.close()

    return asyncio.run(go())


@pytest.mark.slow            # two searches of the tool's whole filesystem: ~50 s on a loaded 2-core machine
def test_tool_code_searching_for_evaluation_answers_finds_none(monkeypatch):
    from hybridrl.agent.config import ToolsConfig
    from hybridrl.evaluate.runner import EpisodeLog

    suite = load_suite(SUITE)
    instances = [inst for _, inst in suite.instances()]
    # what an evaluation holds: the instances (ids, prompts, expected answers) in its memory, and, in the
    # run directory, its outputs (an episode log of ids and scores)
    answers = [json.dumps({"task_id": i.task_id, "reference": i.reference}) for i in instances]
    ids = [i.task_id for i in instances]
    run_dir = ROOT / "runs" / f"test-protect-{uuid.uuid4().hex[:8]}"
    try:
        log = EpisodeLog(run_dir / "eval" / suite.name / "step_000001.episodes.jsonl", {"suite": suite.hash})
        for inst in instances:
            log.add({"key": f"greedy/{inst.task_id}/0", "task_id": inst.task_id, "correct": 1.0})
        log.close()
        (run_dir / "eval" / suite.name / "instances.txt").write_text("\n".join(answers))   # the worst case
        monkeypatch.setenv("HYBRIDRL_TEST_EVAL_INSTANCES", json.dumps(answers))
        base = dict(pool_size=1, warm=0, timeout_s=90.0, cpu_s=60, memory_mb=256, max_processes=4,
                    max_file_mb=1, max_output_bytes=1 << 16, audit_log="")
        result = _search(ToolsConfig(**base), ids + answers)
        assert result.ok and result.stdout.rstrip().endswith("DONE"), (result.stdout[-2000:], result.stderr[-2000:])
        assert "FOUND" not in result.stdout, result.stdout[-4000:]
        assert int(result.stdout.split("searched ")[1].split()[0]) > 100      # it did search the tool's world
        # the same search where the run directory is visible finds both the ids and the answers
        control = _search(ToolsConfig(**base, visible_paths=ToolsConfig().visible_paths + [str(run_dir)]),
                          ids + answers)
        assert all(f"FOUND {n} in {run_dir}" in control.stdout for n in (ids[0], answers[0])), control.stdout[-2000:]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("mixture", [False, True])
def test_the_training_stream_asked_for_an_evaluation_instance_has_none(mixture):
    from hybridrl.config import load_config
    from hybridrl.controller.curriculum import training_stream
    from hybridrl.envs.tasks import get_task
    from hybridrl.evaluate.protect import stream_lookup

    overrides = ["model.path=unused", "task.validation_size=4"] + (["task.name=mixture", MIXTURE] if mixture else [])
    cfg = load_config(ROOT / "tests" / "controller" / "rl_tiny.yaml", overrides)
    task = get_task(cfg.task.name, cfg.task)
    stream = training_stream(cfg, task)
    suite = load_suite(SUITE)
    evaluated = [inst for _, inst in suite.instances() if inst.task in task.task_names()]
    assert evaluated
    for inst in evaluated:
        with pytest.raises(KeyError, match="holds no instance"):
            stream_lookup(stream, inst.task_id)
    drawn = stream.next(8)
    assert stream_lookup(stream, drawn[0].task_id) is not None          # the lookup finds what the stream holds
    assert not {i.task_id for i in drawn} & {i.task_id for i in evaluated}


def test_a_suite_overlapping_the_training_split_is_refused_before_the_run(tmp_path):
    from hybridrl.config import load_config
    from hybridrl.preflight import PreflightError, check_curriculum_and_suite

    leaky = tmp_path / "leaky.yaml"
    leaky.write_text(SUITE.read_text().replace("suite: mix_tiny", "suite: leaky")
                     .replace("{task: calculator, split: validation", "{task: calculator, split: train"))
    recipe = ROOT / "tests" / "controller" / "rl_tiny.yaml"
    base = ["model.path=unused", "task.name=mixture", MIXTURE, "task.validation_size=4"]
    check_curriculum_and_suite(load_config(recipe, base + [f"trainer.eval_suite={SUITE}"]))     # disjoint: fine
    with pytest.raises(PreflightError) as err:
        check_curriculum_and_suite(load_config(recipe, base + [f"trainer.eval_suite={leaky}"]))
    message = str(err.value)
    first = load_suite(leaky).instances()[0][1].task_id           # a calculator instance of the train split
    assert "shares 4 of its 8 instances" in message and first in message, message
    # a suite of a task the run does not train on, and one with other budgets, are refused too
    with pytest.raises(PreflightError, match="does not hold"):
        check_curriculum_and_suite(load_config(recipe, base[:1] + [f"trainer.eval_suite={SUITE}"]))
    with pytest.raises(PreflightError, match="agent.max_turns=3, this run with 4"):
        check_curriculum_and_suite(load_config(recipe, base + [f"trainer.eval_suite={SUITE}", "agent.max_turns=4"]))
