"""A tiny OpenEnv environment (openenv-core): guess the number, answered "higher" / "lower" / "correct".
Written as any OpenEnv user would write one; hybridrl starts its server itself and plays it with

    task:
      name: openenv
      options:
        app: recipes/envs/openenv_guess.py:app      # the server's ASGI app (openenv's create_app)

`reset(seed)` draws the secret from 1..100; `step(GuessAction(message))` reads the last whole number in
the message, rewards 1 for the secret (the episode ends) and ends after 7 guesses. With the environment
variable OPENENV_GUESS_LOG set, every step appends one line to that file (what the tests count).
"""

from __future__ import annotations

import json
import os
import random
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

MAX_GUESSES = 7


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str = ""


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.secret, self.guesses, self._state = 0, 0, State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 100)
        self.guesses, self._state = 0, State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="I am thinking of a whole number from 1 to 100.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self.guesses += 1
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        guess = int(numbers[-1]) if numbers else None
        if os.environ.get("OPENENV_GUESS_LOG"):
            with open(os.environ["OPENENV_GUESS_LOG"], "a") as f:
                f.write(json.dumps({"episode": self._state.episode_id, "guess": guess, "pid": os.getpid()}) + "\n")
        if guess == self.secret:
            return GuessObservation(message="correct", reward=1.0, done=True)
        hint = "Say a whole number." if guess is None else ("higher" if guess < self.secret else "lower")
        return GuessObservation(message=hint, reward=0.0, done=self.guesses >= MAX_GUESSES)

    @property
    def state(self) -> State:
        return self._state


# One session per concurrent episode: openenv's default is a single session, and hybridrl plays up to
# agent.max_concurrent_episodes (64) at once.
app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
