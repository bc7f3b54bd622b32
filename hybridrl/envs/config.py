"""Configs of the task (`task`) and the leased environment service (`env`). Import-light."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, items_of, knob
from hybridrl.envs.front_ends import FRONT_ENDS

# the episode budgets a task of a mixture may set for its own episodes (agent.* otherwise)
BUDGET_KEYS = ("max_turns", "max_new_tokens_per_turn", "max_response_tokens", "max_episode_s")


@dataclass(kw_only=True)
class MixtureEntry:
    """One task of `task.mixture`: its weight, its own options and splits, and its episode budgets."""

    name: str
    weight: float = 1.0
    seed: int = -1                   # -1: task.seed
    train_size: int = 0              # 0: task.train_size
    validation_size: int = 0         # 0: task.validation_size
    format_weight: float = -1.0      # < 0: task.format_weight
    options: dict[str, Any] = field(default_factory=dict)
    budgets: dict[str, Any] = field(default_factory=dict)   # agent.max_turns etc. for this task's episodes

    def __post_init__(self) -> None:
        from hybridrl.envs.tasks import registry

        if self.weight <= 0:
            raise ConfigValueError("weight", f"must be > 0, got {self.weight}")
        check_positive("train_size", self.train_size, allow_zero=True)
        check_positive("validation_size", self.validation_size, allow_zero=True)
        if self.name == "mixture":
            raise ConfigValueError("name", "a mixture's task cannot be a mixture")
        registry.task_class(self.name)
        if self.options:
            self.options = registry.check_options(self.name, self.options)
        for key, value in self.budgets.items():
            if key not in BUDGET_KEYS:
                raise ConfigValueError(f"budgets.{key}", f"not an episode budget; a task may set {', '.join(BUDGET_KEYS)}")
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigValueError(f"budgets.{key}", f"must be a number > 0, got {value!r}")


@dataclass(kw_only=True)
class TaskConfig:
    """Which task the agent trains on, its splits, reward shaping and the task's own options."""

    name: str = knob("calculator",
                     "a task in hybridrl/envs/tasks/ (calculator, guess_number, gsm8k) or your own as 'module:Class' "
                     "(importable from the working directory or PYTHONPATH)")
    seed: int = knob(0, "seed of the generated train / validation splits")
    train_size: int = knob(4096, "instances in the train split")
    validation_size: int = knob(64, "instances in the validation split (disjoint from train); every RL validation runs all of them")
    format_weight: float = knob(0.0, "weight of the format reward added to the correctness reward")
    sft_tool_use_fraction: float = knob(1.0, "SFT demonstrations that use the tool (the rest guess)")
    sft_guess_correct_fraction: float = knob(0.0, "guessing demonstrations whose guess is right")
    agent: str = knob("", "an agent written with the OpenAI client, 'module:function' (async def run(client, "
                          "instance) -> reward | Outcome) or 'module:Class'; its episodes run through the gateway "
                          "(gateway.*) instead of the built-in agent loop. Empty: the built-in loop")
    front_end: str = knob("", "the door episodes come through (hybridrl/envs/front_ends.py FRONT_ENDS): loop (the "
                              "built-in agent loop) | gateway (an OpenAI-client agent, task.agent) | "
                              "'package.module:Class' of your own (an EpisodeEngine subclass). Empty: gateway when "
                              "task.agent is set, else loop")
    options: dict[str, Any] = knob(
        help="the task's own options (for calculator: min_digits, max_digits, min_ops, max_ops, ops, "
             "parentheses, action_format, system_prompt); checked against the task's Options dataclass",
        factory=dict)
    mixture: list[MixtureEntry] = knob(
        help="with name=mixture: the tasks trained together, each {name, weight, seed, train_size, validation_size, "
             "format_weight, options, budgets} (unset ones: this section's values; budgets: agent.max_turns, "
             "max_new_tokens_per_turn, max_response_tokens, max_episode_s for that task's episodes)", factory=list)
    sampler: str = knob("uniform", "mixture: which prompt comes next: uniform (each task by its weight, its prompts in "
                                   "a shuffled order) | difficulty (the same task shares; within a task, prompts whose "
                                   "recent success rate is near 0 or 1 are drawn less, never below sampler_floor)")
    sampler_floor: float = knob(0.25, "difficulty: a prompt's draw probability is at least this fraction of uniform "
                                      "(1/N of its task's prompts)")
    sampler_window: int = knob(8, "difficulty: a prompt's success rate is over its last this many episodes")
    share_policy: str = knob("wait", "mixture, partial rollouts: how each task keeps its share of the groups a step "
                                     "trains on when environments differ in speed: wait (a step takes each task's "
                                     "share; a fast task's extra groups are held for the next step, the step waits for "
                                     "a slow one's) | launch (more of a slow task is launched, in proportion to its "
                                     "latency; extra groups held, nothing waited for) | none (whatever completes first)")
    share_tolerance: float = knob(0.1, "mixture: the share each task keeps, as a fraction of its weight's (0.1: "
                                       "50% +- 5 points); a step outside it is counted in share/outside_tolerance")
    share_max_wait_rounds: int = knob(64, "share_policy=wait: collection rounds a step waits for a slow task's groups "
                                          "before it trains short (counted in share/short_groups)")

    def __post_init__(self) -> None:
        self.mixture = items_of(MixtureEntry, "mixture", self.mixture)
        check_choice("sampler", self.sampler, ("uniform", "difficulty"))
        check_range("sampler_floor", self.sampler_floor, 0.0, 1.0)
        check_positive("sampler_window", self.sampler_window)
        check_choice("share_policy", self.share_policy, ("wait", "launch", "none"))
        check_range("share_tolerance", self.share_tolerance, 0.0, 1.0)
        check_positive("share_max_wait_rounds", self.share_max_wait_rounds)
        if self.name == "mixture" and not self.mixture:
            raise ConfigValueError("mixture", "task.name=mixture needs its tasks: task.mixture=[{name: calculator, "
                                              "weight: 1}, {name: guess_number, weight: 1}]")
        if self.mixture and self.name != "mixture":
            raise ConfigValueError("name", f"task.mixture is set: set task.name=mixture to train on it (not "
                                           f"{self.name!r})")
        names = [e.name for e in self.mixture]
        if len(set(names)) != len(names):
            raise ConfigValueError("mixture", f"a task appears twice in the mixture: {names}")
        check_positive("train_size", self.train_size)
        check_positive("validation_size", self.validation_size)
        check_positive("format_weight", self.format_weight, allow_zero=True)
        check_range("sft_tool_use_fraction", self.sft_tool_use_fraction, 0.0, 1.0)
        check_range("sft_guess_correct_fraction", self.sft_guess_correct_fraction, 0.0, 1.0)
        from hybridrl.envs.tasks import registry

        if ":" in self.name or self.name not in registry.task_names():
            registry.task_class(self.name)          # imports a 'module:Class' task: errors name the key
        if self.options:      # checking options imports a shipped task's module (only when there are some)
            self.options = registry.check_options(self.name, self.options)   # typed: "3" -> 3 for an int
        if self.agent:
            self._check_agent(registry)
        if self.front_end:
            FRONT_ENDS.check("front_end", self.front_end, load=False)
        if self.front_end == "gateway" and not self.agent:
            raise ConfigValueError("front_end", "gateway runs an OpenAI-client agent: name it with task.agent")

    def _check_agent(self, registry) -> None:
        """`agent` names an importable agent of the right shape, the task has no environment of its own
        (the agent drives its episodes), and the gateway's packages are installed."""
        import importlib.util

        from hybridrl.envs.tasks.base import Task
        from hybridrl.envs.agent_spec import check_agent

        missing = [m for m in ("openai", "starlette", "uvicorn") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigValueError("agent", f"an OpenAI-client agent needs {', '.join(missing)}: "
                                            "pip install -e .[gateway]")
        registry.importable_from_cwd()
        check_agent(self.agent)
        if registry.task_class(self.name).make_env is not Task.make_env:
            raise ConfigValueError("agent", f"task {self.name!r} has an environment of its own (make_env); an "
                                            "OpenAI-client agent drives its episodes itself: use a task without one")


@dataclass(kw_only=True)
class EnvServiceConfig:
    """The leased environment service: durable episode state, leases, retries."""

    db_path: str = knob("${run.dir}/envs.sqlite", "SQLite file (WAL) holding episodes and transitions")
    lease_ttl_s: float = knob(300.0, "a lease not renewed for this long expires and its episode is reclaimed")
    synchronous: str = knob("full", "SQLite durability: full (survives power loss) | normal (process crash)")
    busy_timeout_s: float = knob(10.0, "how long a service process waits for the database's write lock before "
                                       "refusing a step (retryable: the client sends the same key again)")
    step_timeout_s: float = knob(30.0, "client side: a step slower than this is an ambiguous timeout")
    max_retries: int = knob(3, "client side: retries of an ambiguous step (after querying its status)")
    audit_log: str = knob("${run.dir}/audit.jsonl", "the run's hash-chained audit log, where the service's refusals "
                                                   "and lease revocations go too; empty: none")

    def __post_init__(self) -> None:
        check_positive("lease_ttl_s", self.lease_ttl_s)
        check_choice("synchronous", self.synchronous, ("full", "normal"))
        check_positive("busy_timeout_s", self.busy_timeout_s)
        check_positive("step_timeout_s", self.step_timeout_s)
        check_positive("max_retries", self.max_retries, allow_zero=True)


def check_loopback_url(key: str, url: str, schemes: tuple[str, ...]) -> str:
    """`url` when it is SCHEME://HOST[:PORT][/PATH] with a loopback HOST (127.0.0.0/8, ::1, localhost): the
    servers a run reaches by URL are its own machine's. ConfigValueError naming `key` otherwise."""
    import ipaddress
    from urllib.parse import urlsplit

    example = f"{schemes[0]}://127.0.0.1:PORT/..."
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise ConfigValueError(key, f"{url!r} is not a URL ({err}): {example}") from None
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigValueError(key, f"{url!r}: a {' or '.join(schemes)} URL, {example}")
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback or parts.username or parts.password:
        raise ConfigValueError(key, f"{url!r}: only a server on this machine's loopback is reached by URL "
                                    f"(127.0.0.1, ::1 or localhost, no credentials), e.g. {example}; a server "
                                    f"elsewhere: run it here, or put a loopback proxy in front of it")
    if port == 0:
        raise ConfigValueError(key, f"{url!r}: port 0 is not a server's port")
    return url
