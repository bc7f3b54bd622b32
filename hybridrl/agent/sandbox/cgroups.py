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

CPU, where a cpu controller can be written (optional: without one, only RLIMIT_CPU per process
bounds a sandbox's CPU time): `tools.cpu_cores` of CPU per wall-clock second for the whole sandbox,
as cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (the cpu hierarchy's own
directory, a third one the tool joins). Without it a tool's threads and children could take every
core of the node while its wall-clock limit runs, and slow the trainer and the other sandboxes.

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
CPU_PERIOD_US = 100_000


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
    pool_dirs: list[Path]                      # v1: memory, pids [, cpu]
    memory_bytes: int
    pids_max: int
    cpu_quota_us: int | None = None            # per CPU_PERIOD_US; None: no cpu controller here
    _count: int = 0
    _live: dict[str, SandboxCgroup] = field(default_factory=dict)

    def create(self, memory_bytes: int | None = None) -> SandboxCgroup:
        """A sandbox's cgroup, with the pool's memory limit or `memory_bytes` (a server's own)."""
        memory_bytes = self.memory_bytes if memory_bytes is None else memory_bytes
        self._count += 1
        name = f"s{self._count}"
        dirs = [d / name for d in self.pool_dirs]
        cg = SandboxCgroup(self.kind, dirs)
        try:
            for d in dirs:
                d.mkdir(mode=0o755)
            if self.kind == "cgroup2":
                d = dirs[0]
                _write(d / "memory.max", memory_bytes)
                _write(d / "memory.swap.max", 0, optional=True)
                _write(d / "memory.oom.group", 1, optional=True)
                _write(d / "pids.max", self.pids_max)
                if self.cpu_quota_us is not None:
                    (d / "cpu.max").write_text(f"{self.cpu_quota_us} {CPU_PERIOD_US}")
            else:
                memory, pids = dirs[:2]
                _write(memory / "memory.limit_in_bytes", memory_bytes)
                _write(memory / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                _write(pids / "pids.max", self.pids_max)
                if self.cpu_quota_us is not None:
                    _write(dirs[2] / "cpu.cfs_period_us", CPU_PERIOD_US)
                    _write(dirs[2] / "cpu.cfs_quota_us", self.cpu_quota_us)
        except BaseException:
            cg.remove(wait_s=0)
            raise
        self._live[name] = cg
        return cg

    @property
    def cpu_limit(self) -> str:
        """What bounds a sandbox's CPU rate: "cpu.max" / "cfs_quota" (its cgroup) or "rlimit"."""
        if self.cpu_quota_us is None:
            return "rlimit"
        return "cpu.max" if self.kind == "cgroup2" else "cfs_quota"

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


def cpu_quota(cores: float) -> int:
    """`cores` of CPU as a quota per CPU_PERIOD_US (the kernel's minimum is 1 ms)."""
    return max(1000, round(cores * CPU_PERIOD_US))


def probe(parent: str, memory_bytes: int, pids_max: int,
          cpu_cores: float | None = None) -> tuple[PoolCgroups | None, str]:
    """The pool's cgroups, or None and why they cannot be made here. With `cpu_cores`, a cpu
    controller too where one can be written (optional: `PoolCgroups.cpu_limit` says which)."""
    quota = cpu_quota(cpu_cores) if cpu_cores else None
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
        cpu = quota if quota is not None and "cpu" in available and _enable_cpu2(base, pool) else None
        return PoolCgroups("cgroup2", [pool], memory_bytes, pids_max, cpu), ""
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
            cpu_dir = _cpu1(mounts, parent, name) if quota is not None else None
            if cpu_dir is not None:
                made.append(cpu_dir)
            return PoolCgroups("cgroup1", made, memory_bytes, pids_max, quota if cpu_dir else None), ""
        except OSError as err:
            for d in made:
                d.rmdir()
            problems.append(f"cgroup v1 {controller} at {base}: {err.strerror or err}")
    elif not problems:
        problems.append("no cgroup filesystem with the memory and pids controllers is mounted")
    return None, "; ".join(problems)


def _enable_cpu2(base: Path, pool: Path) -> bool:
    """The cpu controller for the sandboxes under `pool` (v2); False (logged) where it cannot be."""
    try:
        if "cpu" not in (base / "cgroup.subtree_control").read_text().split():
            (base / "cgroup.subtree_control").write_text("+cpu")
        (pool / "cgroup.subtree_control").write_text("+cpu")
        return True
    except OSError as err:
        log.warning("tool sandbox: no cpu controller at %s (%s): only RLIMIT_CPU bounds a sandbox's CPU", base, err)
        return False


def _cpu1(mounts: list[tuple[str, str, set[str]]], parent: str, name: str) -> Path | None:
    """The pool's directory in the v1 cpu hierarchy, or None (logged) where there is none to write."""
    points = [point for point, fstype, options in mounts if fstype == "cgroup" and "cpu" in options]
    if not points:
        return None
    base = Path(points[0]) / (parent or _own("cpu")).lstrip("/")
    try:
        _sweep(base)
        pool = base / name
        pool.mkdir(mode=0o755)
        return pool
    except OSError as err:
        log.warning("tool sandbox: no cpu cgroup at %s (%s): only RLIMIT_CPU bounds a sandbox's CPU", base,
                    err.strerror or err)
        return None
