"""A pool of sandboxed Python processes for tools (see `boot.py` for what a sandbox is).

- Isolation is probed once at `start()`: "root" (namespaces + a dedicated uid per slot) when
  running as root, which otherwise refuses to start (`SandboxUnavailable`, naming why; never a
  weaker mode unless isolation=none is configured); for other users "userns" (namespaces inside
  a user namespace), or "none" (the OS refused namespaces: rlimits, clean environment, private
  directory and process-group kill only; no network or filesystem isolation), logged as a warning
  (`require_isolation` turns it into an error). The mode is in `stats()["isolation"]` and in every
  `SandboxResult.isolation`.
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
from hybridrl.agent.sandbox.process import RUNNER, SandboxProcess, SandboxResult
from hybridrl.agent.sandbox.uids import UidLease

log = logging.getLogger(__name__)

MODES = ("root", "userns", "none")
SANDBOX_WORKDIR = "/tmp"          # the tool's private tmpfs, inside its own root (namespaces)


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

    def __init__(self, cfg: ToolsConfig):
        self.cfg = cfg
        self.python, self.expose = tool_interpreter(cfg)
        self.mode: str | None = None
        self._none_drops_uid = os.geteuid() == 0     # isolation=none as root: still a uid per slot
        self._uids: UidLease | None = None           # leased at start when running as root
        self._slots = asyncio.Semaphore(cfg.pool_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free_ids = list(range(cfg.pool_size + cfg.warm))
        self._warm: list[SandboxProcess] = []
        self._live: dict[SandboxProcess, int] = {}          # sandbox -> its slot (uid offset)
        self._refill: asyncio.Task | None = None
        self._closed = False
        self._stats = {"runs": 0, "ok": 0, "timeouts": 0, "output_truncated": 0, "setup_errors": 0,
                       "warm_hits": 0, "cold_starts": 0, "wall_s": 0.0}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "SandboxPool":
        self._bind_loop()
        self._closed = False
        if self._uids is None and os.geteuid() == 0:
            self._uids = UidLease(self.cfg.pool_size + self.cfg.warm, self.cfg.uid_base)
        if self.mode is None:
            self.mode = await self._probe()
            self._schedule_refill()
        return self

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

    async def __aenter__(self) -> "SandboxPool":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        runs = self._stats["runs"]
        return {"isolation": self.mode, **self._stats,
                "mean_wall_s": self._stats["wall_s"] / runs if runs else 0.0}

    # ------------------------------------------------------------------ running code

    async def run(self, code: str, *, timeout_s: float | None = None) -> SandboxResult:
        """Run `code` as a Python program in a fresh sandbox; never raises for what the code does."""
        await self.start()
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        async with self._slots:
            sbx = self._warm.pop(0) if self._warm else None
            if sbx is not None and not sbx.alive:                      # died while waiting
                await self._release(sbx)
                sbx = None
            self._stats["warm_hits" if sbx else "cold_starts"] += 1
            if sbx is None:
                sbx = await self._spawn(self.mode)
            self._schedule_refill()
            try:
                result = await sbx.execute(code, timeout)
            finally:
                await self._release(sbx)
        self._account(result)
        return result

    def _account(self, r: SandboxResult) -> None:
        s = self._stats
        s["runs"] += 1
        s["ok"] += r.ok
        s["timeouts"] += r.timed_out
        s["output_truncated"] += r.output_truncated
        s["setup_errors"] += r.setup_error is not None
        s["wall_s"] += r.wall_s

    # ------------------------------------------------------------------ sandboxes

    def _uid(self, slot: int, mode: str) -> int:
        drop = mode == "root" or (mode == "none" and self._none_drops_uid)
        return self._uids.uids[slot] if drop and self._uids is not None else -1

    @property
    def uids(self) -> list[int]:
        """The uids this pool's sandboxes run as (empty when not root)."""
        return list(self._uids.uids) if self._uids is not None else []

    async def _spawn(self, mode: str) -> SandboxProcess:
        slot = self._free_ids.pop(0)
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
        spec = {
            "mode": mode, "uid": uid, "gid": uid,
            "limits": {"cpu_s": c.cpu_s, "as_bytes": c.memory_mb << 20, "nproc": c.max_processes,
                       "nofile": c.max_open_files, "fsize_bytes": c.max_file_mb << 20},
            "visible": list(c.visible_paths), "hidden": list(c.hidden_paths), "expose": self.expose,
            "stage_dir": host_dir, "workdir": spec_workdir,
            "tmpfs_bytes": c.tmpfs_mb << 20,
            "argv": [self.python, "-I", "-S", "-c", RUNNER],
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec_workdir, "TMPDIR": spec_workdir,
                    "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"},
        }
        try:
            sbx = await SandboxProcess.spawn(self.python, spec, max_output_bytes=c.max_output_bytes)
        except BaseException:
            os.rmdir(workdir)
            os.rmdir(host_dir)
            self._free_ids.append(slot)
            raise
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

    def _schedule_refill(self) -> None:
        if self._closed or self.cfg.warm == 0 or (self._refill is not None and not self._refill.done()):
            return
        self._refill = asyncio.ensure_future(self._fill_warm())

    async def _fill_warm(self) -> None:
        while not self._closed and len(self._warm) < self.cfg.warm and self._free_ids:
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
            self._none_drops_uid = False
            log.warning("tool sandbox: isolation=none cannot run %s as an unprivileged uid (%s); tools run "
                        "as root: RLIMIT_NPROC does not bind; only the wall-clock limit and the end-of-run sweep "
                        "stop a fork bomb",
                        self.python, problem)
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
