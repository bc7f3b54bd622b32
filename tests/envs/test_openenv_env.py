"""An OpenEnv environment (`task.name: openenv`) on the real openenv-core package: hybridrl starts the shipped
example's server (uvicorn on a private Unix socket), episodes go through the agent loop and the leased
environment service (tokens exactly the engine's; the reward is the sum of what the server's environment gives
the same moves, replayed here on the environment class itself; the ledger's components), and a server killed
mid-episode: the episode is infrastructure-invalid, no move reaches a server twice, the next episode runs on a
new server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.tools.base import ToolBox
from hybridrl.config import ConfigError, load_config
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.client import LeasedEnvProvider
from hybridrl.envs.service import EnvService
from hybridrl.envs.tasks import get_task
from tests.envs.episodes import RecordingEngine, check_tokens, ledger_rewards, load_file
from tests.launch import ROOT

pytest.importorskip("openenv.core", reason="pip install -e .[openenv]")

APP = f"{ROOT}/recipes/envs/openenv_guess.py:app"


@pytest.fixture(scope="module")
def game():
    return load_file(APP.rpartition(":")[0], "openenv_guess_test")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    return tmp_path_factory.mktemp("openenv")


@pytest.fixture(scope="module")
def task(logdir):
    """The task, and one server for the module (its log: every move it executes)."""
    from hybridrl.envs.tasks import openenv

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENENV_GUESS_LOG", str(logdir / "steps.jsonl"))            # the server inherits it
        yield get_task("openenv", load_config(None, ["task.name=openenv", f"task.options.app={APP}"]).task)
        openenv._stop_servers()
        openenv.SERVERS.clear()


def moves(game, inst):
    """The policy: 50, then the secret (known from the game's rule), for a third of the seeds a wrong number."""
    secret = random.Random(inst.metadata["seed"]).randint(1, 100)
    return ["50", str(secret if inst.metadata["seed"] % 3 else secret % 100 + 1), str(secret)]


def play(tokenizer, task, instances, respond, db, *, concurrent=1):
    """The episodes through the agent loop; with concurrent=1 one at a time, in order, so `respond` may know
    the instance (the prompts are all the same), else at once, `respond` getting None."""
    order = iter(instances)
    current = []

    def responder(ids, turn):
        if concurrent > 1:
            return f"<answer>{respond(None, turn)}</answer>"
        if turn == 0:
            current[:] = [next(order)]
        return f"<answer>{respond(current[0], turn)}</answer>"

    engine = RecordingEngine(tokenizer, responder, max_model_len=1 << 16)
    agent = AgentConfig(max_turns=3, max_new_tokens_per_turn=64, max_response_tokens=1024,
                        max_concurrent_episodes=concurrent)

    async def go():
        async with ToolBox([]) as box:
            runner = AgentRunner(engine, tokenizer, agent_cfg=agent, tools=box, run_id="oe",
                                 envs=LeasedEnvProvider(EnvService(db)))
            return await runner.run(instances, task=task)

    return engine, asyncio.run(go())


def steps(tmp_path):
    """The moves the server executed (the test's own replay, in this process, has no episode id)."""
    return [s for s in map(json.loads, (tmp_path / "steps.jsonl").read_text().splitlines()) if s["episode"]]


def test_episodes_against_the_started_server_are_scored_by_its_rewards(task, game, tokenizer, tmp_path, logdir):
    instances = task.train_split(4)
    assert not {i.task_id for i in instances} & {i.task_id for i in task.validation_split(16)}
    engine, trajectories = play(tokenizer, task, instances, lambda inst, turn: moves(game, inst)[turn],
                                tmp_path / "envs.sqlite")
    check_tokens(engine, trajectories)
    stored = ledger_rewards(tmp_path / "ledger", trajectories)
    for inst, traj in zip(instances, trajectories):
        env, total = game.GuessEnvironment(), 0.0                  # the same moves on the environment itself
        env.reset(seed=inst.metadata["seed"])
        for move in moves(game, inst):
            obs = env.step(game.GuessAction(message=move))
            total += obs.reward
            if obs.done:
                break
        assert traj.status == S.COMPLETED and traj.reward == total == 1.0
        assert traj.turns == (2 if inst.metadata["seed"] % 3 else 3)
        assert stored[traj.trajectory_id] == {"correct": 1.0}
    assert len(steps(logdir)) == sum(t.turns for t in trajectories)            # each move reached the server once


def test_a_server_killed_mid_episode_leaves_it_invalid_and_the_next_runs_on_a_new_server(task, game, tokenizer,
                                                                                           tmp_path, logdir):
    from hybridrl.envs.tasks import openenv

    first, second = task.validation_split(2)
    pid = openenv.SERVERS[APP].proc.pid if APP in openenv.SERVERS else None

    def respond(inst, turn):
        if inst is first and turn == 1:
            openenv.SERVERS[APP].proc.kill()                  # the server dies with the episode's second move
        return moves(game, inst)[turn]

    _, [killed] = play(tokenizer, task, [first], respond, tmp_path / "envs.sqlite")
    assert killed.status == S.INFRA_INVALID and killed.reward == 0.0
    _, [after] = play(tokenizer, task, [second], respond, tmp_path / "envs.sqlite")
    assert after.status == S.COMPLETED and after.reward == 1.0
    log = steps(logdir)
    assert [s["guess"] for s in log if s["episode"].startswith(first.task_id + "/")] == [50]     # never sent again
    served = {s["pid"] for s in log if s["episode"].startswith(second.task_id + "/")}
    assert len(served) == 1 and served != {pid} and openenv.SERVERS[APP].proc.pid in served   # a new server


@pytest.fixture
def served(logdir):
    """The example's server started here, as a user would run it: uvicorn on a loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OPENENV_GUESS_LOG": str(logdir / "url_steps.jsonl")}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", "--app-dir", f"{ROOT}/recipes/envs", "openenv_guess:app"],
                            env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    try:
        yield port, proc
    finally:
        proc.kill()
        proc.wait()


def test_episodes_against_a_server_named_by_url_run_at_once_scored_by_its_rewards(served, game, tokenizer,
                                                                                 tmp_path, logdir):
    """Eight episodes at once (the example takes 64 sessions), each move the same for all: 50, 25, 75."""
    port, proc = served
    task = get_task("openenv", load_config(None, ["task.name=openenv",
                                                  f"task.options.url=http://127.0.0.1:{port}"]).task)
    instances = task.train_split(8)
    guesses = ["50", "25", "75"]
    engine, trajectories = play(tokenizer, task, instances, lambda inst, turn: guesses[turn],
                                tmp_path / "envs.sqlite", concurrent=8)
    check_tokens(engine, trajectories)
    for inst, traj in zip(instances, trajectories):
        env, total, turns = game.GuessEnvironment(), 0.0, 0            # the same moves on the environment itself
        env.reset(seed=inst.metadata["seed"])
        for move in guesses:
            obs = env.step(game.GuessAction(message=move))
            total, turns = total + obs.reward, turns + 1
            if obs.done:
                break
        assert traj.status in (S.COMPLETED, S.TRUNCATED) and (traj.reward, traj.turns) == (total, turns)
    log = [json.loads(line) for line in (logdir / "url_steps.jsonl").read_text().splitlines()]
    assert {s["pid"] for s in log} == {proc.pid}               # the user's server played them, none started here
    assert len(log) == sum(t.turns for t in trajectories)


@pytest.mark.parametrize("options, match", [
    ([f"task.options.app={ROOT}/recipes/envs/nope.py:app"], "not module:app"),
    ([f"task.options.app={APP}", "task.options.url=ws://127.0.0.1:1"], "not both"),
    (["task.options.url=ws://example.org:80"], "loopback"),
    (["task.options.url=ws://127.0.0.1.example.org:80"], "loopback"),
    (["task.options.url=ftp://127.0.0.1:80"], "a ws or wss or http or https URL"),
])
def test_bad_options_are_refused_at_load(options, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["task.name=openenv", *options])


def test_init_task_from_openenv_scaffolds_an_environment_and_its_recipe(tmp_path, monkeypatch):
    
    from hybridrl.scaffold_envs import write_env

    monkeypatch.chdir(tmp_path)
    files = write_env("game", tmp_path, "openenv")
    cfg = load_config(files["grpo"])
    assert cfg.task.name == "openenv" and cfg.task.options["app"] == "game_env.py:app" and cfg.agent.max_turns == 7
    [inst] = get_task("openenv", cfg.task).train_split(1)
    module = load_file(files["env"], "game_env")
    env = module.GameEnvironment()
    env.reset(seed=inst.metadata["seed"])
    secret = random.Random(inst.metadata["seed"]).randint(1, 100)
    assert env.step(module.GameAction(message=f"it is {secret - 1}")).message == "higher"
    won = env.step(module.GameAction(message=str(secret)))
    assert (won.reward, won.done) == (1.0, True)


def test_the_sft_games_are_played_by_the_example_environments_rules(game):
    """recipes/data/openenv_guess.jsonl (recipes/openenv_guess_sft_cpu.yaml): each row's observations are what the
    environment answers its moves, laid out as an episode reaches the model."""
    from hybridrl.envs.tasks.openenv import PROMPT

    rows = [json.loads(line) for line in (ROOT / "recipes/data/openenv_guess.jsonl").read_text().splitlines()]
    wins = 0
    for row in rows[:200]:
        messages, env = row["messages"], game.GuessEnvironment()
        start = env.reset(seed=0)
        env.secret = int(row["answer"])
        assert messages[:2] == [{"role": "user", "content": PROMPT}, {"role": "user", "content": start.message}]
        moves, hints = messages[2::2], messages[3::2]
        assert {m["role"] for m in moves} == {"assistant"} and 1 <= len(moves) <= game.MAX_GUESSES
        for i, move in enumerate(moves):
            obs = env.step(game.GuessAction(message=move["content"]))
            if i < len(hints):
                assert hints[i] == {"role": "user", "content": obs.message}
        assert obs.done
        wins += obs.reward
    assert 0.6 < wins / 200 < 0.95            # the weaker strategy of most rows leaves RL something to find
