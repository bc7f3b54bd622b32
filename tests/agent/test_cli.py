"""`hybridrl agent ...` end to end, in process."""

from __future__ import annotations

import json

from hybridrl.cli import main


def test_tasks_writes_instances_and_demonstrations(tmp_path, capsys):
    assert main(["agent", "tasks", "--config", "recipes/calculator.yaml", "-n", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(r["task"] == "calculator" and r["tools"] == ["calculator"] for r in rows)
    out = tmp_path / "sft.jsonl"
    assert main(["agent", "tasks", "--config", "recipes/calculator.yaml", "--split", "sft", "-n", "4",
                 "--out", str(out), "task.sft_tool_use_fraction=0.5"]) == 0
    demos = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert sum(any(m["role"] == "tool" for m in d) for d in demos) == 2


def test_rollout_with_the_scripted_agent(tmp_path, tiny_models, capsys):
    summary = tmp_path / "summary.json"
    code = main(["agent", "rollout", "--config", "recipes/calculator.yaml", "--engine", "scripted", "-n", "4",
                 "--group-size", "2", "--show", "1", "--json", str(summary), f"model.path={tiny_models('qwen2')}",
                 f"run.dir={tmp_path}"])
    assert code == 0
    result = json.loads(summary.read_text())
    assert result["episodes"] == 8 and result["statuses"] == {"completed": 8} and result["mean_reward"] == 1.0
    assert result["accuracy"] == 1.0 and result["split"] == "validation"
    assert (result["temperature"], result["temperature_from"]) == (0.0, "trainer.validation_temperature")
    out = capsys.readouterr()
    assert "<calc>" in out.out and "validation accuracy (greedy, trainer.validation_temperature): 100.0%" in out.err
    assert main(["agent", "rollout", "recipes/calculator.yaml", "--engine", "scripted", "-n", "2", "--temperature",
                 "0.7", "--json", str(summary), f"model.path={tiny_models('qwen2')}", f"run.dir={tmp_path}"]) == 0
    assert (json.loads(summary.read_text())["temperature"], json.loads(summary.read_text())["temperature_from"]) \
        == (0.7, "--temperature")


def test_bad_override_is_a_config_error(capsys):
    assert main(["agent", "tasks", "task.options={min_digits: 9, max_digits: 2}"]) == 2
    assert "task.options.max_digits" in capsys.readouterr().err




def test_rollout_of_an_agent_recipe_names_the_eval_command_that_runs_it(tmp_path, tiny_models, capsys):
    """task.agent episodes run through the gateway, which `agent rollout` does not start: it refuses, naming
    `hybridrl eval` with the same recipe and overrides, which takes the recipe form and runs them."""
    import shlex

    from hybridrl.cli import build_parser

    given = ["recipes/calculator.yaml", "task.agent=hybridrl.gateway.examples.calculator_agent:run",
             f"model.path={tiny_models('qwen2')}", f"run.dir={tmp_path}"]
    assert main(["agent", "rollout", *given, "-n", "3"]) == 2
    err = capsys.readouterr().err
    assert "task.agent=hybridrl.gateway.examples.calculator_agent:run" in err and "`hybridrl eval` runs them" in err
    command = shlex.split(err.strip().splitlines()[-1])
    assert command == ["hybridrl", "eval", *given, "-n", "3"]
    args = build_parser().parse_args(command[1:])
    assert args.recipe_args == given and args.n == 3

    from hybridrl.evaluate.suite import is_suite

    assert not is_suite(given[0])                  # the recipe form, which runs task.agent episodes
