"""An OpenEnv environment as a task (`task.name: openenv`; `pip install -e .[openenv]`, openenv-core 0.3).

    task:
      name: openenv
      options:
        app: recipes/envs/openenv_guess.py:app    # module:app or file.py:app: hybridrl starts the server
        # url: http://127.0.0.1:8000             # or a server already running on loopback (ws:// too)
        action_field: message                    # the action's text field (the turn's <answer>, else the turn)
        observation_field: message               # what the model reads of an observation

hybridrl starts the server itself (uvicorn on a private Unix socket, in a directory only this user can
open; one server per process that runs environments, stopped when the process exits; never a container),
and speaks OpenEnv's session protocol on its `/ws` socket: `reset` (with the instance's seed) opens the
episode, each assistant turn is one `step`, and the observation's text, reward and `done` are the
environment service's transition. So the leased environment service (`${run.dir}/envs.sqlite`) persists
every transition with its idempotency key, as for hybridrl's own environments: an action it committed is
answered from its record, never sent again. The environment is not declared pure (a server's step may
touch anything): a server that dies during a step leaves that step in doubt, and the service refuses to
run it again (the episode is infrastructure-invalid); the next episode starts a new server. An episode
restored elsewhere is rebuilt by `reset` with its seed and the committed actions again on a fresh session.

Instances are seeds: a fixed hash partition of the seeds keeps train and validation apart. The reward is
the sum of the environment's rewards (`correct`).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.config.fields import ConfigValueError
from hybridrl.data.episode import EpisodeOutcome, TaskInstance, Transition
from hybridrl.envs.config import check_loopback_url
from hybridrl.envs.tasks.base import Task, split_of
from hybridrl.envs.tasks.registry import register_task
from hybridrl.reward import RewardResult

INSTALL = "pip install -e .[openenv]   (or pip install openenv-core)"
PROMPT = "Play the game. End each turn with your move in <answer>...</answer>."


def check_installed(key: str) -> None:
    try:
        import openenv.core  # noqa: F401
        import websockets.sync.client  # noqa: F401
    except ImportError as err:
        raise ConfigValueError(key, f"task openenv needs openenv-core ({err}): {INSTALL}") from None


class Server:
    """One environment server of this process: `uvicorn --uds` on a socket in a private directory."""

    def __init__(self, app: str, start_timeout_s: float):
        self.app, self.start_timeout_s = app, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.dir, "env.sock")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure(self) -> "Server":
        if self.alive():
            return self
        self.stop()
        where, _, attr = self.app.rpartition(":")
        app_dir, module = (os.path.dirname(os.path.abspath(where)), Path(where).stem) if where.endswith(".py") \
            else (os.getcwd(), where)
        self.dir = tempfile.mkdtemp(prefix="hybridrl-openenv-")          # 0700: only this user reaches the socket
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([app_dir, os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--uds", self.socket_path, "--log-level",
                                      "warning", "--app-dir", app_dir, f"{module}:{attr}"],
                                     env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(self.socket_path)
                return self
            except OSError:
                time.sleep(0.05)
        code = self.proc.poll()
        self.stop()
        raise RuntimeError(f"the OpenEnv server {self.app} did not start within {self.start_timeout_s:g} s"
                           + (f" (it exited with {code})" if code is not None else ""))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


SERVERS: dict[str, Server] = {}


@atexit.register
def _stop_servers() -> None:
    for server in SERVERS.values():
        server.stop()


def server_for(app: str, start_timeout_s: float) -> Server:
    if app not in SERVERS:
        SERVERS[app] = Server(app, start_timeout_s)
    return SERVERS[app].ensure()


class OpenEnvEnvironment:
    """The hybridrl environment protocol over one OpenEnv session (a `/ws` connection)."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.ws: Any = None
        self.seed, self.episode, self.actions = 0, "", []

    def _connect(self) -> None:
        from websockets.sync.client import connect, unix_connect

        timeout = self.spec["step_timeout_s"]
        if self.spec["url"]:
            url = re.sub(r"^http", "ws", self.spec["url"].rstrip("/"))        # the server's session socket
            self.ws = connect(url + "/ws", open_timeout=timeout)
        else:
            server = server_for(self.spec["app"], self.spec["start_timeout_s"])
            self.ws = unix_connect(server.socket_path, "ws://localhost/ws", open_timeout=timeout)

    def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        self.ws.send(json.dumps(message))
        reply = json.loads(self.ws.recv(timeout=self.spec["step_timeout_s"]))
        if reply.get("type") == "error" and reply.get("data", {}).get("code") == "CAPACITY_REACHED":
            raise RuntimeError(f"the OpenEnv server takes {reply['data'].get('max_sessions')} sessions at once and "
                               "hybridrl plays up to agent.max_concurrent_episodes episodes at once: give its "
                               "create_app max_concurrent_envs=64 (and SUPPORTS_CONCURRENT_SESSIONS = True), or "
                               "lower agent.max_concurrent_episodes")
        if reply.get("type") != "observation":
            raise RuntimeError(f"the OpenEnv server answered {message['type']} with {reply}")
        return reply["data"]

    def _text(self, data: dict[str, Any]) -> str:
        observation = data.get("observation", {})
        field = self.spec["observation_field"]
        if field in observation:
            return str(observation[field])
        return json.dumps({k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")})

    def reset(self, instance: TaskInstance, seed: int) -> str | None:
        self.close()
        self._connect()
        self.seed, self.episode, self.actions = int(instance.metadata["seed"]), f"{instance.task_id}/{seed}", []
        return self._text(self._send({"type": "reset", "data": {"seed": self.seed, "episode_id": self.episode}}))

    def step(self, action: dict[str, Any]) -> Transition:
        move = action["answer"] if action.get("answer") is not None else action["text"]
        data = self._send({"type": "step", "data": {self.spec["action_field"]: move}})
        self.actions.append(move)
        return Transition(self._text(data), float(data.get("reward") or 0.0), bool(data.get("done")),
                          info={"openenv_step": len(self.actions)})

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "episode": self.episode, "actions": list(self.actions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuilt on a fresh session: reset with the seed, the committed actions sent again."""
        self.close()
        self._connect()
        self.seed, self.episode = int(state["seed"]), state["episode"]
        self._send({"type": "reset", "data": {"seed": self.seed, "episode_id": self.episode}})
        self.actions = []
        for move in state["actions"]:
            self._send({"type": "step", "data": {self.spec["action_field"]: move}})
            self.actions.append(move)

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.ws.send(json.dumps({"type": "close"}))
                self.ws.close()
            except Exception:  # noqa: BLE001 - a dead server's session is gone already
                pass
            self.ws = None


@dataclass(kw_only=True)
class OpenEnvOptions:
    app: str = ""                     # module:app | file.py:app (started by hybridrl)
    url: str = ""                     # ws:// or http://127.0.0.1:PORT of a running server (loopback only)
    prompt: str = PROMPT
    action_field: str = "message"
    observation_field: str = "message"
    start_timeout_s: float = 60.0
    step_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.app or self.url):
            return                    # the environment service builds the task without options: checked at use
        if self.app and self.url:
            raise ConfigValueError("url", "give app (hybridrl starts the server) or url (one running), not both")
        if self.url:
            check_loopback_url("url", self.url, ("ws", "wss", "http", "https"))
        if self.app and (":" not in self.app or (self.app.split(":")[0].endswith(".py")
                                                 and not Path(self.app.split(":")[0]).is_file())):
            raise ConfigValueError("app", f"{self.app!r} is not module:app or an existing file.py:app")
        check_installed("app" if self.app else "url")


@register_task
class OpenEnvTask(Task):
    name = "openenv"
    version = 1
    Options = OpenEnvOptions
    action_formats = ("json",)

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        o = self.options
        if not (o.app or o.url):
            raise ConfigValueError("app", "task openenv needs its environment: task.options.app=module:app (or url)")
        spec = {"app": o.app, "url": o.url, "action_field": o.action_field, "observation_field": o.observation_field,
                "start_timeout_s": o.start_timeout_s, "step_timeout_s": o.step_timeout_s}
        out: list[TaskInstance] = []
        while len(out) < n:
            seed = rng.randrange(1 << 31)
            if split_of(f"openenv:{seed}") == split:
                out.append(TaskInstance(task=self.name, task_id=f"openenv-{seed}",
                                        messages=({"role": "user", "content": o.prompt},), reference="",
                                        metadata={"seed": seed, "openenv": spec}))
        return out

    def sft_demonstrations(self, n: int, seed: int | None = None, **_: Any) -> list[list[dict[str, str]]]:
        return []

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        raise ValueError("an OpenEnv environment has no demonstrations")

    def make_env(self, instance: TaskInstance) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(dict(instance.metadata["openenv"]))

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        spec = instance.metadata["openenv"]
        return RewardResult().add("correct", outcome.env_return, f"openenv:{spec['app'] or spec['url']}@{self.version}")
