"""Configs of the agent loop (`agent`) and the tool sandbox pool (`tools`). Import-light."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob

DEFAULT_HIDDEN_PATHS = ["/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run"]
# what a tool's root holds besides the interpreter, its own /tmp, /dev (null, zero, full, random,
# urandom) and /proc: the system's programs, libraries and configuration, read-only
DEFAULT_VISIBLE_PATHS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]


@dataclass(kw_only=True)
class AgentConfig:
    """Episode budgets, concurrency and sampling of the async agent loop."""

    max_turns: int = knob(4, "assistant turns per episode; one more would end it TRUNCATED(max_turns)")
    max_new_tokens_per_turn: int = knob(
        64, "tokens one assistant turn may generate (TRUNCATED(max_new_tokens))")
    on_turn_limit: str = knob(
        "truncate", "a turn that hits max_new_tokens_per_turn: truncate (end the episode TRUNCATED(max_new_tokens)) "
                    "| close_turn (close it as the template would, parse it, go on)")
    max_response_tokens: int = knob(
        256, "all response tokens of an episode, policy + observations (TRUNCATED(max_response_tokens))")
    max_episode_s: float = knob(120.0, "wall-clock budget of one episode (TRUNCATED(wall_clock))")
    max_concurrent_episodes: int = knob(
        64, "episodes in flight at once; admission blocks (never drops) while this many run")
    temperature: float = knob(1.0, "sampling temperature (0 = greedy)")
    top_p: float = knob(1.0, "nucleus sampling mass (1.0 = off)")
    top_k: int = knob(-1, "top-k sampling (-1 = off)")
    max_tool_calls_per_turn: int = knob(
        2, "tool calls executed from one assistant turn; extra ones get an error")
    max_observation_chars: int = knob(
        2000, "tool / env output shown to the model is cut to this many characters")
    on_weights_updated: str = knob(
        "continue", "a turn interrupted by new weights: continue it under the new version | abort the episode")
    abort_grace_s: float = knob(2.0, "after aborting a request, how long to wait for its partial output")
    on_agent_error: str = knob(
        "score", "an episode whose agent code raised (task.agent and other front ends running the user's code): "
                 "score (a failed episode, scored by the task: no reward dodge) | drop (left out of training). "
                 "Counted as agent_errors either way, never as infrastructure faults")

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens_per_turn", "max_response_tokens", "max_concurrent_episodes",
                     "max_tool_calls_per_turn", "max_observation_chars"):
            check_positive(name, getattr(self, name))
        check_positive("max_episode_s", self.max_episode_s)
        check_positive("temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigValueError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigValueError("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        check_choice("on_weights_updated", self.on_weights_updated, ("continue", "abort"))
        check_choice("on_turn_limit", self.on_turn_limit, ("truncate", "close_turn"))
        check_choice("on_agent_error", self.on_agent_error, ("score", "drop"))
        check_positive("abort_grace_s", self.abort_grace_s, allow_zero=True)


@dataclass(kw_only=True)
class ToolsConfig:
    """The sandbox pool that runs tool processes, and its limits."""

    pool_size: int = knob(4, "tool processes running at once; further calls wait for a slot")
    warm: int = knob(2, "sandboxes started ahead of need (each is used once, then discarded)")
    isolation: str = knob(
        "auto", "auto (namespaces where the OS allows, else none with a warning) | namespaces | none (as root "
                "only with force_isolation_none)")
    require_isolation: bool = knob(False, "fail at start instead of falling back to isolation=none, or to "
                                          "per-process memory limits where no cgroup can be made")
    force_isolation_none: bool = knob(False, "as root, isolation=none (the host's filesystem, a dedicated uid per "
                                             "slot) is refused unless this is true; tools never run as uid 0")
    timeout_s: float = knob(10.0, "wall-clock limit of one tool call; the process group is killed after it")
    cpu_s: int = knob(5, "CPU-seconds per process (RLIMIT_CPU)")
    memory_mb: int = knob(512, "memory of one sandbox, MiB: its cgroup's limit (every process, tmpfs, memfd and "
                               "shared memory, no swap) and each process's address space (RLIMIT_AS)")
    max_processes: int = knob(16, "processes per sandbox (its cgroup's pids.max, and RLIMIT_NPROC of its own uid)")
    cgroup_parent: str = knob("", "cgroup under which the pool makes one per sandbox (a path inside the cgroup "
                                  "hierarchy, e.g. a delegated /user.slice/...); empty: the cgroup v2 root, or this "
                                  "process's own cgroup in cgroup v1")
    max_open_files: int = knob(64, "open files per process (RLIMIT_NOFILE)")
    cpu_cores: float = knob(1.0, "CPU time per wall-clock second of one sandbox, in cores, for all its processes "
                                 "together (its cgroup's cpu.max, v1 cpu.cfs_quota_us; where no cpu controller "
                                 "can be written, only RLIMIT_CPU per process bounds it)")
    max_file_mb: int = knob(8, "largest file a tool may write, MiB (RLIMIT_FSIZE)")
    tmpfs_mb: int = knob(32, "size of the private working directory (a tmpfs under namespaces), MiB")
    tmpfs_inodes: int = knob(8192, "files and directories the private working directory may hold (nr_inodes)")
    network: str = knob("none", "none (no network at all) | allowlist (only allowed_destinations, through the "
                                "pool's CONNECT proxy at 127.0.0.1:3128 in the sandbox; needs namespaces)")
    egress_max_connections: int = knob(16, "with network=allowlist: connections one sandbox may hold open "
                                           "through the proxy at once (each costs the pool descriptors); "
                                           "more are closed at once and counted (stats egress.over_cap)")
    allowed_destinations: list[str] = knob(
        help="with network=allowlist: host:port, [ipv6]:port or unix:/path the proxy may connect to (names "
             "matched as written); every attempt, allowed or not, goes to the audit log", factory=list)
    audit_log: str = knob("${run.dir}/audit.jsonl", "the run's hash-chained audit log (sandbox pools, calls, "
                                                   "egress, the kill switch); empty: none")
    kill_switch: str = knob("${run.dir}/kill-switch", "a file whose appearance stops every tool call and new "
                                                     "episode within a second (hybridrl agent kill-switch RUN_DIR); "
                                                     "empty: none")
    max_output_bytes: int = knob(65536, "stdout + stderr bytes kept; more kills the tool (output_truncated)")
    uid_base: int = knob(61000,
                         "when run as root, each sandbox slot runs as its own uid, leased from uid_base up")
    visible_paths: list[str] = knob(
        help="the allow-list of host paths bound read-only (nosuid, nodev) into the tool's own root, besides "
             "the interpreter (namespaces only; everything else of the host, e.g. the project, run directories "
             "and the virtualenv, does not exist there)",
        factory=lambda: list(DEFAULT_VISIBLE_PATHS))
    hidden_paths: list[str] = knob(
        help="directories under visible_paths replaced by an empty read-only tmpfs inside the sandbox "
             "(namespaces only)",
        factory=lambda: list(DEFAULT_HIDDEN_PATHS))
    python: str = knob("", "interpreter for tools (empty: the base interpreter of this Python)")
    calculator_max_chars: int = knob(256, "longest expression the calculator accepts")
    mcp: list[dict[str, Any]] = knob(
        help="MCP tool servers, each {name, command | url, env, timeout_s, memory_mb, visible_paths}: a stdio "
             "command started inside the sandbox, or the url of a streamable HTTP server running on loopback; "
             "their tools offered as NAME_TOOL (docs/environments.md)", factory=list)

    def __post_init__(self) -> None:
        for name in ("pool_size", "cpu_s", "memory_mb", "max_processes", "max_open_files", "max_file_mb",
                     "egress_max_connections", "tmpfs_mb", "tmpfs_inodes", "max_output_bytes", "calculator_max_chars"):
            check_positive(name, getattr(self, name))
        check_positive("warm", self.warm, allow_zero=True)
        check_positive("timeout_s", self.timeout_s)
        check_range("cpu_cores", self.cpu_cores, 0.01, 4096)
        check_choice("isolation", self.isolation, ("auto", "namespaces", "none"))
        check_choice("network", self.network, ("none", "allowlist"))
        for entry in self.allowed_destinations:
            from hybridrl.agent.sandbox.egress import parse_destination

            try:
                parse_destination(entry)
            except ValueError as err:
                raise ConfigValueError("allowed_destinations", str(err)) from None
        if self.network == "allowlist" and not self.allowed_destinations:
            raise ConfigValueError("network", "allowlist needs at least one tools.allowed_destinations entry "
                                              "(host:port or unix:/path); network=none refuses all egress")
        if self.cgroup_parent and (not self.cgroup_parent.startswith("/") or ".." in self.cgroup_parent.split("/")):
            raise ConfigValueError("cgroup_parent", f"must be an absolute path inside the cgroup hierarchy without "
                                                    f"'..', got {self.cgroup_parent!r}")
        check_range("uid_base", self.uid_base, 1000, 2**31 - 1 - 4096)
        if self.mcp:
            from hybridrl.agent.mcp import check_servers

            self.mcp = check_servers(self.mcp)
        for path in self.hidden_paths:
            if not path.startswith("/") or path == "/":
                raise ConfigValueError("hidden_paths", f"entries must be absolute directories other than /, "
                                                       f"got {path!r}")
        for path in self.visible_paths:
            if not path.startswith("/") or path.rstrip("/") == "" or ".." in path.split("/"):
                raise ConfigValueError("visible_paths", f"entries must be absolute paths other than / "
                                                        f"(without '..'), got {path!r}")
