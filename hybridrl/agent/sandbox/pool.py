"""A pool of sandboxed Python processes for tools (see `boot.py` for what a sandbox is).

- Isolation is probed once at `start()`: "root" (namespaces + a dedicated uid per slot) when
  running as root, which otherwise refuses to start (`SandboxUnavailable`, naming why; never a
  weaker mode; isolation=none as root only with `tools.force_isolation_none`, and never with uid
  0 tools); for other users "userns" (namespaces inside a user namespace), or "none" (the OS
  refused namespaces: rlimits, clean environment, private directory, the syscall filter and
  process-group kill only; no filesystem isolation), logged as a warning (`require_isolation`
  turns it into an error). The mode is in `stats()["isolation"]` and in every
  `SandboxResult.isolation`.
- Memory: a cgroup per sandbox (`cgroups.py`) where this host lets the pool write one, else
  rlimits per process only, said in `stats()["memory_limit"]` (cgroup2 | cgroup1 | rlimit) and a
  warning (`require_isolation` refuses to start without one).
- The syscall filter (`seccomp.py`) is compiled here once and installed by every tool; a machine
  it cannot filter is refused.
- Egress (`tools.network=allowlist`): the pool's proxy (`egress.py`) serves each sandbox's
  listener; everything is logged to the run's audit log (`hybridrl/telemetry/audit.py`).
- The kill switch (`kill(reason)`, any thread): every sandbox is SIGKILLed at once, every call in
  flight and every later one returns `killed`.
- Fork bombs: RLIMIT_NPROC does not bind root, so as root each sandbox runs under its own
  uid (leased from `uid_base` up, exclusive across processes of the host: `uids.py`), where
  RLIMIT_NPROC does bind, inside its own pid namespace, whose
  processes all die with its pid 1 when the tool exits or is killed. Without namespaces,
  boot is the tool's child subreaper and kills every descendant (setsid cannot escape it);
  as root the uid is still dedicated, so RLIMIT_NPROC binds and a final sweep kills its rest.
- Sandboxes are single-use: `warm` of them are started ahead (interpreter already up, waiting
  for code on stdin) and each is discarded after one call, so no state survives between calls.
- Concurrency: at most `pool_size` calls run; more wait for a slot (FIFO), nothing is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from typing import Any

from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox import cgroups, seccomp
from hybridrl.agent.sandbox.egress import PROXY_PORT, EgressProxy
from hybridrl.agent.sandbox.process import RUNNER, SandboxProcess, SandboxResult
from hybridrl.agent.sandbox.uids import UidLease
from hybridrl.agent.tools.base import TOOL_CALL
from hybridrl.telemetry import audit as audit_log

log = logging.getLogger(__name__)

MODES = ("root", "userns", "none")
SANDBOX_WORKDIR = "/tmp"          # the tool's private tmpfs, inside its own root (namespaces)


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (what systemd and container
    runtimes leave low, e.g. 1024, for programs that use select()); returns (before, after). The
    pool's process holds two descriptors per egress connection and three pipes per sandbox, and the
    trainer's threads open files in the same process: a low soft limit would let a tool's
    connections starve them. Nothing in hybridrl uses select(); epoll and poll have no such limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return soft, soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as err:
        log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, err)
        return soft, soft
    if soft < target:
        log.info("open-files limit of this process raised from %d to %d (its hard limit)", soft, target)
    return soft, target


class SandboxUnavailable(RuntimeError):
    """The required isolation is not available on this machine."""


def tool_interpreter(cfg: ToolsConfig) -> tuple[str, list[str]]:
    """(python executable, directories to expose read-only inside the sandbox)."""
    python = cfg.python or getattr(sys, "_base_executable", None) or sys.executable
    python = os.path.realpath(python)
    prefix = os.path.realpath(sys.base_prefix) if not cfg.python else os.path.dirname(os.path.dirname(python))
    return python, sorted({prefix, os.path.dirname(python)})


class SandboxPool:
    """`async with SandboxPool(cfg) as pool: result = await pool.run(code)`."""

    def __init__(self, cfg: ToolsConfig, *, audit: audit_log.AuditLog | None = None):
        self.cfg = cfg
        self.python, self.expose = tool_interpreter(cfg)
        self.audit = audit if audit is not None else audit_log.open_log(cfg.audit_log)
        self.mode: str | None = None
        self.cgroups: cgroups.PoolCgroups | None = None
        self.cgroup_problem = ""
        self._filter: bytes | None = None
        self.proxy = EgressProxy(cfg.allowed_destinations, self.audit, max_connections=cfg.egress_max_connections) \
            if cfg.network == "allowlist" else None
        self.killed: str | None = None
        self._none_drops_uid = os.geteuid() == 0     # isolation=none as root: still a uid per slot
        self._uids: UidLease | None = None           # leased at start when running as root
        self._slots = asyncio.Semaphore(cfg.pool_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free_ids = list(range(cfg.pool_size + cfg.warm))
        self._server_ids = list(range(cfg.pool_size + cfg.warm, self.num_slots))    # long-lived servers' own
        self._warm: list[SandboxProcess] = []
        self._live: dict[SandboxProcess, int] = {}          # sandbox -> its slot (uid offset)
        self._refill: asyncio.Task | None = None
        self._closed = False
        self._stats = {"runs": 0, "ok": 0, "timeouts": 0, "output_truncated": 0, "setup_errors": 0,
                       "memory_limit_hits": 0, "killed": 0, "warm_hits": 0, "cold_starts": 0, "wall_s": 0.0}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "SandboxPool":
        self._bind_loop()
        if self.mode is None:
            raise_nofile_limit()                   # every process that runs tools starts a pool here
        self._closed = False
        if self._uids is None and os.geteuid() == 0:
            self._uids = UidLease(self.num_slots, self.cfg.uid_base)
        fresh = False
        try:
            if self.mode is not None and self._filter is None:     # closed and started again: new cgroups
                self._prepare()
            if self.mode is None:
                self._prepare()
                self.mode = await self._probe()
                self._check_mode()
                self._filter = self._filter_for(self.mode)
                fresh = True
        except BaseException:                      # refused: nothing of this pool is left behind
            self.mode = None
            if self.cgroups is not None:
                self.cgroups.close()
                self.cgroups = None
            if self._uids is not None:
                self._uids.release()
                self._uids = None
            raise
        if fresh:
            if self.audit is not None:
                self.audit.record("sandbox_pool", isolation=self.mode, memory_limit=self.memory_limit,
                                  cgroup_problem=self.cgroup_problem or None, uids=self.uids,
                                  seccomp=seccomp.describe(self._filter), network=self.cfg.network,
                                  allowed_destinations=sorted(self.proxy.allowed) if self.proxy else [],
                                  memory_mb=self.cfg.memory_mb, max_processes=self.cfg.max_processes,
                                  cpu_limit=self.cpu_limit, cpu_cores=self.cfg.cpu_cores)
            self._schedule_refill()
        return self

    @property
    def num_slots(self) -> int:
        """Sandboxes that may exist at once (each its own uid as root): the calls', the warm ones and one per
        MCP server (`tools.mcp`, `hybridrl/agent/mcp.py`)."""
        return self.cfg.pool_size + self.cfg.warm + len(self.cfg.mcp)

    @property
    def memory_limit(self) -> str:
        """What bounds a sandbox's memory: its cgroup (cgroup2 | cgroup1), or rlimits per process."""
        return self.cgroups.kind if self.cgroups is not None else "rlimit"

    @property
    def cpu_limit(self) -> str:
        """What bounds a sandbox's CPU rate: its cgroup (cpu.max | cfs_quota), or "rlimit" (RLIMIT_CPU
        per process only)."""
        return self.cgroups.cpu_limit if self.cgroups is not None else "rlimit"

    def _prepare(self) -> None:
        """Once per pool: the syscall filter (refused where it cannot be built) and the cgroups."""
        cfg = self.cfg
        if cfg.isolation == "none" and self._as_root() and not cfg.force_isolation_none:
            raise SandboxUnavailable(
                "tool sandbox: tools.isolation=none while running as root gives tools the host's filesystem with "
                "only a dedicated uid between them and it; remove tools.isolation=none (isolation=root is what "
                "root gets), or set tools.force_isolation_none=true to accept that")
        self.cgroups, self.cgroup_problem = cgroups.probe(cfg.cgroup_parent, cfg.memory_mb << 20, cfg.max_processes,
                                                           cfg.cpu_cores)
        try:
            self._filter = seccomp.compile_filter(inet=cfg.network == "allowlist", memfd=self.cgroups is not None)
        except seccomp.FilterUnavailable as err:
            raise SandboxUnavailable(f"tool sandbox: {err}") from err
        if self.cgroups is None:
            if cfg.require_isolation:
                raise SandboxUnavailable(f"tool sandbox: no cgroup for the sandboxes' memory and processes "
                                         f"(tools.require_isolation): {self.cgroup_problem}")
            log.warning("tool sandbox: no cgroup can be made here (%s): memory and process limits are per process "
                        "(rlimits), so the processes of one sandbox can together hold %d x tools.memory_mb; set "
                        "tools.cgroup_parent to a delegated cgroup, or run as root", self.cgroup_problem,
                        cfg.max_processes)

    def _filter_for(self, mode: str) -> bytes:
        """The syscall filter of `mode`'s sandboxes: the pool's, without AF_UNIX socket() in mode none
        (no network namespace there: the host's Unix sockets, abstract ones included, are reachable)."""
        if mode != "none":
            return self._filter
        return seccomp.compile_filter(inet=self.cfg.network == "allowlist", memfd=self.cgroups is not None,
                                      unix=False)

    def _check_mode(self) -> None:
        if self.proxy is not None and self.mode == "none":
            raise SandboxUnavailable("tool sandbox: tools.network=allowlist needs namespace isolation (the proxy is the "
                                     "only way out of a network namespace); with isolation=none the tool would "
                                     "have the host's network")

    def _bind_loop(self) -> None:
        """A pool outlives event loops (e.g. one `asyncio.run` per training step): sandboxes
        started on a previous loop cannot be driven from this one, so they are ended here."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            for sbx in list(self._live):
                sbx.abandon()
            self._live.clear()
            self._warm.clear()
            self._free_ids = list(range(self.cfg.pool_size + self.cfg.warm))
            self._server_ids = list(range(self.cfg.pool_size + self.cfg.warm, self.num_slots))
            self._refill = None
            self._slots = asyncio.Semaphore(self.cfg.pool_size)
        self._loop = loop

    async def close(self) -> None:
        self._bind_loop()
        self._closed = True
        if self._refill is not None:
            await self._refill                    # stops after the spawn in progress
            self._refill = None
        self._warm.clear()
        for sbx in list(self._live):
            await self._release(sbx)
        if self._uids is not None:
            self._uids.release()
            self._uids = None
        if self.cgroups is not None:
            self.cgroups.close()
            self.cgroups = None
        self._filter = None                        # a restarted pool makes its cgroups (and filter) again

    async def __aenter__(self) -> "SandboxPool":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        runs = self._stats["runs"]
        out = {"isolation": self.mode, "memory_limit": self.memory_limit, "cpu_limit": self.cpu_limit,
               "network": self.cfg.network,
               **self._stats, "mean_wall_s": self._stats["wall_s"] / runs if runs else 0.0}
        if self.proxy is not None:
            out["egress"] = dict(self.proxy.counts)
        out["audit_failures"] = self.audit.failures if self.audit is not None else 0
        return out

    # ------------------------------------------------------------------ the kill switch

    def kill(self, reason: str) -> None:
        """Stop every tool call now and refuse later ones (safe from any thread: the kill switch's
        watcher). Calls in flight return `SandboxResult.killed`; the pool stays closed to new calls."""
        if self.killed is not None:
            return
        self.killed = reason
        for _ in range(3):
            try:
                live = list(self._live)
                break
            except RuntimeError:                  # changed size during the copy: once more
                continue
        for sbx in live:
            sbx.hard_kill(reason)
        if self.audit is not None:
            self.audit.record("kill_switch", reason=reason, sandboxes_killed=len(live))

    # ------------------------------------------------------------------ running code

    async def run(self, code: str, *, timeout_s: float | None = None) -> SandboxResult:
        """Run `code` as a Python program in a fresh sandbox; never raises for what the code does."""
        if self.killed is not None:
            return self._refused()
        await self.start()
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        call = TOOL_CALL.get() or {}
        async with self._slots:
            if self.killed is not None:
                return self._refused()
            sbx = self._warm.pop(0) if self._warm else None
            if sbx is not None and not sbx.alive:                      # died while waiting
                await self._release(sbx)
                sbx = None
            self._stats["warm_hits" if sbx else "cold_starts"] += 1
            if sbx is None:
                sbx = await self._spawn(self.mode)
            if self.killed is not None:                                # tripped while it started
                sbx.hard_kill(self.killed)
            self._schedule_refill()
            try:
                result = await sbx.execute(code, timeout, proxy=self.proxy, call=call)
            finally:
                await self._release(sbx)
        self._account(result)
        if self.audit is not None:
            self.audit.record("sandbox_call", episode=call.get("episode"), call=call.get("call"),
                              isolation=result.isolation, uid=sbx.uid, exit_code=result.exit_code,
                              signal=result.signal, limit=result.limit_hit, oom_kills=result.oom_kills,
                              killed=result.killed, setup_error=result.setup_error, wall_s=round(result.wall_s, 4))
        return result

    def _refused(self) -> SandboxResult:
        self._stats["killed"] += 1
        return SandboxResult("", "", None, signal=None, isolation=self.mode or "none", killed=self.killed)

    def _account(self, r: SandboxResult) -> None:
        s = self._stats
        s["runs"] += 1
        s["ok"] += r.ok
        s["timeouts"] += r.timed_out
        s["output_truncated"] += r.output_truncated
        s["setup_errors"] += r.setup_error is not None
        s["memory_limit_hits"] += r.limit_hit == "memory"
        s["killed"] += r.killed is not None
        s["wall_s"] += r.wall_s

    # ------------------------------------------------------------------ sandboxes

    def _uid(self, slot: int, mode: str) -> int:
        drop = mode == "root" or (mode == "none" and self._none_drops_uid)
        return self._uids.uids[slot] if drop and self._uids is not None else -1

    @property
    def uids(self) -> list[int]:
        """The uids this pool's sandboxes run as (empty when not root)."""
        return list(self._uids.uids) if self._uids is not None else []

    async def start_server(self, argv: list[str], *, env: dict[str, str], expose: list[str],
                           memory_mb: int) -> SandboxProcess:
        """A long-lived server (an MCP server's command) in a sandbox of its own: the isolation, syscall filter,
        limits (its own memory), egress and audit of a tool call's, on a slot reserved for servers. Its stdin
        and stdout are the caller's (`SandboxProcess.send` / `lines`); end it with `stop_server`."""
        await self.start()
        if self.killed is not None:
            raise SandboxUnavailable(f"tool sandbox: stopped by the kill switch ({self.killed})")
        sbx = await self._spawn(self.mode, slot=self._server_ids.pop(0),
                                server={"argv": argv, "env": env, "expose": expose, "memory_mb": memory_mb})
        if self.audit is not None:
            self.audit.record("sandbox_server", argv=argv, isolation=sbx.mode, uid=sbx.uid)
        return sbx

    async def stop_server(self, sbx: SandboxProcess) -> None:
        slot = self._live.get(sbx)
        await self._release(sbx)
        if slot is not None:
            self._free_ids.remove(slot)
            self._server_ids.append(slot)

    async def _spawn(self, mode: str, *, slot: int | None = None, server: dict | None = None) -> SandboxProcess:
        slot = self._free_ids.pop(0) if slot is None else slot
        uid = self._uid(slot, mode)
        # namespaces: the host directory becomes the tool's root (a tmpfs mounted over it inside the
        # sandbox's own mount namespace) and its working directory is /tmp there; none: the tool
        # works in host_dir/work
        host_dir = tempfile.mkdtemp(prefix="hybridrl-sbx-")
        workdir = os.path.join(host_dir, "work")
        os.mkdir(workdir, 0o700)
        if mode == "none" and uid >= 0:
            os.chmod(host_dir, 0o711)
            os.chown(workdir, uid, uid)
        c = self.cfg
        spec_workdir = workdir if mode == "none" else SANDBOX_WORKDIR
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec_workdir, "TMPDIR": spec_workdir,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        if self.proxy is not None:
            proxy = f"http://127.0.0.1:{PROXY_PORT}"
            env.update({name: proxy for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy",
                                                 "http_proxy", "all_proxy")})
        memory_mb = server["memory_mb"] if server is not None else c.memory_mb
        cgroup = self.cgroups.create(memory_mb << 20) if self.cgroups is not None else None
        spec = {
            "mode": mode, "uid": uid, "gid": uid,
            "limits": {"cpu_s": c.cpu_s, "as_bytes": memory_mb << 20, "nproc": c.max_processes,
                       "nofile": c.max_open_files, "fsize_bytes": c.max_file_mb << 20},
            "visible": list(c.visible_paths), "hidden": list(c.hidden_paths), "expose": self.expose,
            "stage_dir": host_dir, "workdir": spec_workdir,
            "tmpfs_bytes": c.tmpfs_mb << 20, "tmpfs_inodes": c.tmpfs_inodes,
            "cgroup_procs": cgroup.procs if cgroup is not None else [],
            "seccomp_bpf": self._filter_for(mode).hex(),
            "argv": [self.python, "-I", "-S", "-c", RUNNER],
            "env": env,
        }
        if server is not None:
            spec.update(argv=server["argv"], env={**env, **server["env"]},
                        expose=sorted(set(self.expose) | set(server["expose"])))
        try:
            sbx = await SandboxProcess.spawn(self.python, spec, max_output_bytes=c.max_output_bytes,
                                             egress=self.proxy is not None and mode != "none",
                                             lines=server is not None)
        except BaseException:
            os.rmdir(workdir)
            os.rmdir(host_dir)
            self._free_ids.append(slot)
            if cgroup is not None:
                self.cgroups.release(cgroup)
            raise
        sbx.cgroup = cgroup
        self._live[sbx] = slot
        return sbx

    async def _release(self, sbx: SandboxProcess) -> None:
        slot = self._live.pop(sbx, None)
        if slot is None:
            return
        try:
            await sbx.close()
        finally:
            self._free_ids.append(slot)
            if sbx.cgroup is not None and self.cgroups is not None:
                self.cgroups.release(sbx.cgroup)

    def _schedule_refill(self) -> None:
        if (self._closed or self.killed is not None or self.cfg.warm == 0
                or (self._refill is not None and not self._refill.done())):
            return
        self._refill = asyncio.ensure_future(self._fill_warm())

    async def _fill_warm(self) -> None:
        while not self._closed and self.killed is None and len(self._warm) < self.cfg.warm and self._free_ids:
            try:
                self._warm.append(await self._spawn(self.mode))
            except OSError as err:                 # out of processes / fds: try later, on demand
                log.warning("could not start a warm sandbox: %s", err)
                return

    def _as_root(self) -> bool:
        return os.geteuid() == 0

    async def _probe(self) -> str:
        """The isolation this pool runs with. As root: "root" or an error, never a weaker mode (a user
        namespace's uid 0 would be the host's root; mode none would run tools with the host's
        filesystem and network), unless isolation=none was asked for. Otherwise "userns", else
        "none" with a warning (or an error with isolation=namespaces / require_isolation)."""
        cfg = self.cfg
        if cfg.isolation != "none":
            if self._as_root():
                problem = await self._try("root")
                if problem is None:
                    log.info("tool sandbox isolation: root (namespaces: user-less mount, net, pid, ipc, uts; "
                             "a uid per slot)")
                    return "root"
                raise SandboxUnavailable(
                    f"tool sandbox: running as root, the sandbox must use isolation=root (namespaces and a "
                    f"dedicated uid per slot), and it could not start here: {problem}. A user namespace would "
                    f"map the tool to the host's root, so there is no fallback; fix the cause, or run the "
                    f"trainer as an unprivileged user (isolation through user namespaces), or set "
                    f"tools.isolation=none to accept tools WITHOUT filesystem or network isolation")
            problem = await self._try("userns")
            if problem is None:
                log.info("tool sandbox isolation: userns (namespaces: user, mount, net, pid, ipc, uts)")
                return "userns"
            if cfg.isolation == "namespaces" or cfg.require_isolation:
                raise SandboxUnavailable(f"tool sandbox: namespaces are not available here (userns: {problem})")
            log.warning("tool sandbox: namespaces are not available (userns: %s); falling back to isolation=none: "
                        "rlimits, clean environment and private directory only, NO network or filesystem "
                        "isolation", problem)
        if self._none_drops_uid and (problem := await self._try("none")) is not None:
            raise SandboxUnavailable(
                f"tool sandbox: isolation=none as root runs each tool as a dedicated uid, and {self.python} cannot "
                f"run as one ({problem}); tools never run as uid 0: make the interpreter readable by other users or "
                f"set tools.python to a system interpreter")
        return "none"

    async def _try(self, mode: str) -> str | None:
        """None when a trivial program runs in `mode`, else what went wrong."""
        sbx = await self._spawn(mode)
        try:
            result = await sbx.execute("print('sandbox-ok')", 30.0)
        finally:
            await self._release(sbx)
        if result.ok and result.stdout.strip() == "sandbox-ok":
            return None
        return result.setup_error or result.stderr.strip()[-300:] or f"exit code {result.exit_code}"
