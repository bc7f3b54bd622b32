"""A cgroup per sandbox: one memory limit and one process limit for everything the tool starts
(every child, tmpfs and memfd pages, SysV shm, kernel memory), where rlimits count one process at
a time and file pages not at all.

The tool process joins its sandbox's cgroup itself, before it drops its privileges (boot.py,
`join_cgroup`); boot and pid 1 stay outside, so the kernel's OOM killer, when the sandbox hits
its limit, kills only the tool's processes, and pid 1 reports how the tool ended. Whether that
happened is read from the cgroup's own OOM counter (`oom_kills`): trusted, unlike the tool's output.

Two layouts, probed once per pool (`probe`):

- cgroup v2 (the unified hierarchy with the memory and pids controllers): the pool's directory
  under `tools.cgroup_parent` (default: the hierarchy's root, the only cgroup that may both hold
  processes and hand controllers to children), one child per sandbox with memory.max,
  memory.swap.max = 0, pids.max and memory.oom.group = 1 (an OOM kills the whole sandbox).
- cgroup v1 (separate memory and pids hierarchies, e.g. a hybrid host): the same directories in
  both, under `tools.cgroup_parent` or this process's own cgroup there; memory.limit_in_bytes and
  memory.memsw.limit_in_bytes (no swap), pids.max; v1 has no oom.group, so the pool listens on the
  cgroup's OOM eventfd and kills the whole sandbox at its first OOM (`oom_events`).

Where neither can be written (an unprivileged user without a delegated subtree, a container with
a read-only /sys/fs/cgroup) `probe` says why: the pool then runs with rlimits only, says so
(`stats()["memory_limit"] == "rlimit"`, a warning) and refuses to start under `require_isolation`.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "hybridrl-sbx-"


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup (one directory per hierarchy: one in v2, memory + pids in v1)."""

    kind: str
    dirs: list[Path]

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files the tool writes itself into."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """Processes the kernel killed because the sandbox reached its memory limit."""
        name = "memory.events" if self.kind == "cgroup2" else "memory.oom_control"
        try:
            text = (self.dirs[0] / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def oom_events(self) -> int | None:
        """cgroup v1: an eventfd the kernel signals at every OOM in this cgroup (the pool then kills
        the whole sandbox, as memory.oom.group does in v2); None in v2 or where unavailable."""
        if self.kind != "cgroup1":
            return None
        try:
            efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except (AttributeError, OSError):
            return None
        try:
            control = os.open(self.dirs[0] / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                (self.dirs[0] / "cgroup.event_control").write_text(f"{efd} {control}")
            finally:
                os.close(control)
        except OSError:
            os.close(efd)
            return None
        return efd

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self.procs:
            try:
                out.update(int(x) for x in Path(path).read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL every process in the sandbox's cgroup (cgroup.kill where the kernel has it)."""
        if self.kind == "cgroup2":
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        for _ in range(5):                        # a fork in progress may add one: sweep again
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self, *, wait_s: float = 2.0) -> bool:
        """Remove the directories (after the sandbox ended); kills what is left first."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("could not remove the sandbox cgroup %s: %s", d, err)
                        return False
                    self.kill()
                    time.sleep(0.005)
        return True


@dataclass
class PoolCgroups:
    """The pool's cgroup directory (per hierarchy) and the sandboxes' cgroups under it."""

    kind: str                                  # cgroup2 | cgroup1
    pool_dirs: list[Path]
    memory_bytes: int
    pids_max: int
    _count: int = 0
    _live: dict[str, SandboxCgroup] = field(default_factory=dict)

    def create(self) -> SandboxCgroup:
        self._count += 1
        name = f"s{self._count}"
        dirs = [d / name for d in self.pool_dirs]
        cg = SandboxCgroup(self.kind, dirs)
        try:
            for d in dirs:
                d.mkdir(mode=0o755)
            if self.kind == "cgroup2":
                d = dirs[0]
                _write(d / "memory.max", self.memory_bytes)
                _write(d / "memory.swap.max", 0, optional=True)
                _write(d / "memory.oom.group", 1, optional=True)
                _write(d / "pids.max", self.pids_max)
            else:
                memory, pids = dirs
                _write(memory / "memory.limit_in_bytes", self.memory_bytes)
                _write(memory / "memory.memsw.limit_in_bytes", self.memory_bytes, optional=True)
                _write(pids / "pids.max", self.pids_max)
        except BaseException:
            cg.remove(wait_s=0)
            raise
        self._live[name] = cg
        return cg

    def release(self, cg: SandboxCgroup) -> None:
        self._live.pop(cg.dirs[0].name, None)
        cg.remove()

    def close(self) -> None:
        for cg in list(self._live.values()):
            self.release(cg)
        for d in self.pool_dirs:
            try:
                d.rmdir()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    log.warning("could not remove the pool's cgroup %s: %s", d, err)


def _write(path: Path, value: int, *, optional: bool = False) -> None:
    if optional and not path.exists():
        return
    path.write_text(str(value))


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of the cgroup filesystems."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fstype, _, options = after.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                point = before.split()[4].encode().decode("unicode_escape")
                out.append((point, fstype, set(options.split(","))))
    return out


def _own(controller: str) -> str:
    """This process's cgroup path in the v1 hierarchy of `controller` ("" in v2's)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return path
    return "/"


def _sweep(parent: Path) -> None:
    """Remove pool directories left by processes that died (their sandboxes are gone with them)."""
    for d in parent.glob(PREFIX + "*"):
        try:
            pid = int(d.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        for child in d.iterdir():
            if child.is_dir():
                try:
                    child.rmdir()
                except OSError:
                    pass
        try:
            d.rmdir()
        except OSError:
            pass


def probe(parent: str, memory_bytes: int, pids_max: int) -> tuple[PoolCgroups | None, str]:
    """The pool's cgroups, or None and why they cannot be made here."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    mounts = _mounts()
    problems = []
    for point, fstype, options in mounts:
        if fstype != "cgroup2":
            continue
        base = Path(point) / parent.lstrip("/")
        try:
            available = set((base / "cgroup.controllers").read_text().split())
        except OSError as err:
            problems.append(f"cgroup2 at {base}: {err.strerror}")
            continue
        if not {"memory", "pids"} <= available:
            problems.append(f"cgroup2 at {base} has no {' or '.join(sorted({'memory', 'pids'} - available))} "
                            f"controller (a v1 hierarchy holds it)")
            continue
        try:
            if not {"memory", "pids"} <= set((base / "cgroup.subtree_control").read_text().split()):
                (base / "cgroup.subtree_control").write_text("+memory +pids")
            _sweep(base)
            pool = base / name
            pool.mkdir(mode=0o755)
            try:
                (pool / "cgroup.subtree_control").write_text("+memory +pids")
            except OSError:
                pool.rmdir()
                raise
        except OSError as err:
            problems.append(f"cgroup2 at {base}: {err.strerror or err}")
            continue
        return PoolCgroups("cgroup2", [pool], memory_bytes, pids_max), ""
    v1 = {c: point for point, fstype, options in mounts if fstype == "cgroup"
          for c in ("memory", "pids") if c in options}
    if set(v1) == {"memory", "pids"}:
        made: list[Path] = []
        try:
            for controller in ("memory", "pids"):
                base = Path(v1[controller]) / (parent or _own(controller)).lstrip("/")
                _sweep(base)
                pool = base / name
                pool.mkdir(mode=0o755)
                made.append(pool)
            return PoolCgroups("cgroup1", made, memory_bytes, pids_max), ""
        except OSError as err:
            for d in made:
                d.rmdir()
            problems.append(f"cgroup v1 {controller} at {base}: {err.strerror or err}")
    elif not problems:
        problems.append("no cgroup filesystem with the memory and pids controllers is mounted")
    return None, "; ".join(problems)
