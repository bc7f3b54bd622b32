"""One single-use sandbox process (boot -> [pid1 ->] tool) driven from asyncio.

All three pipes (stdout, stderr, the status channel) are read through event-loop transports,
so a tool that floods its output or leaves a process holding a pipe never blocks the loop.
The end of the status channel means boot (and pid 1) have exited: that, not the pipes, is
how the end of a run is detected.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOOT = str(Path(__file__).with_name("boot.py"))

# Runs inside the sandbox: read the program from stdin, run it as __main__, print a traceback
# without the runner's own frame on error.
RUNNER = """\
import sys
src = sys.stdin.buffer.read()
sys.stdin.close()
try:
    code = compile(src, "<tool>", "exec")
    del src
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as err:
    import traceback
    traceback.print_exception(type(err), err, err.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None              # None when killed by a signal
    signal: int | None = None
    timed_out: bool = False            # wall-clock limit: the sandbox was killed
    output_truncated: bool = False     # more than max_output_bytes: the sandbox was killed
    setup_error: str | None = None     # the sandbox could not be built (not the tool's fault)
    wall_s: float = 0.0
    isolation: str = "none"
    cpu_s: float | None = None         # the tool's CPU time, measured by its (trusted) parent
    cpu_limit_s: float | None = None   # its RLIMIT_CPU
    oom_kills: int = 0                 # OOM kills in the sandbox's memory cgroup (its own counter / events)
    killed: str | None = None          # stopped by the kill switch (why): not the tool's doing

    @property
    def ok(self) -> bool:
        return (self.setup_error is None and not self.timed_out and not self.output_truncated
                and self.killed is None and not self.oom_kills and self.exit_code == 0)

    @property
    def limit_hit(self) -> str | None:
        """Which limit stopped the tool, decided only from what the trusted side observed (its own
        timers, the output budget, the exit signal, the CPU time measured by the tool's parent and the
        memory cgroup's OOM counter), never from the tool's output, which the tool controls:
        wall_clock | output | memory | cpu | file_size.

        Running out of address space (RLIMIT_AS) is an allocation failure inside the tool (Python's
        MemoryError): the tool sees and may print it, but nothing outside the tool can tell it from a
        program that prints the same text, so it is not reported as a limit here. Reaching the
        sandbox's memory cgroup limit is: the kernel kills, and counts the kill in the cgroup."""
        if self.timed_out:
            return "wall_clock"
        if self.output_truncated:
            return "output"
        if self.oom_kills:                 # any process of the sandbox: the sandbox hit its limit
            return "memory"
        if (self.signal in (signal.SIGXCPU, signal.SIGKILL) and self.cpu_s is not None
                and self.cpu_limit_s is not None and self.cpu_s >= 0.9 * self.cpu_limit_s):
            return "cpu"
        if self.signal == signal.SIGXFSZ:
            return "file_size"
        return None


class _Budget:
    def __init__(self, max_bytes: int):
        self.room = max_bytes
        self.overflow = asyncio.Event()


class _Capture(asyncio.Protocol):
    """Collect a pipe into `buf`, within a shared byte budget (None = unlimited)."""

    def __init__(self, budget: _Budget | None):
        self.buf = bytearray()
        self.budget = budget
        self.closed = asyncio.get_running_loop().create_future()
        self.transport: asyncio.ReadTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.budget is None:
            self.buf += data
            return
        keep = min(len(data), self.budget.room)
        self.buf += data[:keep]
        self.budget.room -= keep
        if keep < len(data):
            self.budget.overflow.set()
            self.transport.pause_reading()       # the writer now blocks until it is killed

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class _Lines(asyncio.Protocol):
    """A long-lived server's stdout as lines (`queue`; None at the end). A line longer than `max_line` bytes is
    a flood: `budget.overflow` is set and reading stops (the server is then ended by its owner)."""

    def __init__(self, budget: _Budget, max_line: int):
        self.budget, self.max_line = budget, max_line
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.partial = bytearray()
        self.buf = self.partial               # what `SandboxProcess` reads of a pipe at its end
        self.closed = asyncio.get_running_loop().create_future()
        self.transport: asyncio.ReadTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        *lines, rest = (bytes(self.partial) + data).split(b"\n")
        for line in lines:
            self.queue.put_nowait(line)
        self.partial[:] = rest
        if len(self.partial) > self.max_line:
            self.partial.clear()
            self.budget.overflow.set()
            self.transport.pause_reading()

    def connection_lost(self, exc) -> None:
        self.queue.put_nowait(None)
        if not self.closed.done():
            self.closed.set_result(None)


class SandboxProcess:
    """Spawned by `spawn`, used once by `execute`, always ended by `close`; or, spawned with `lines=True`, a
    long-lived server whose stdin stays open (`send`) and whose stdout is read a line at a time (`lines`)."""

    def __init__(self, popen: subprocess.Popen, mode: str, host_dir: str, uid: int,
                 pipes: dict[str, Any], stdin: asyncio.WriteTransport, egress: socket.socket | None = None):
        self.popen, self.mode, self.host_dir, self.uid = popen, mode, host_dir, uid
        self.pipes = pipes                      # name -> (transport, _Capture)
        self.stdin = stdin
        self.budget: _Budget = pipes["stdout"][1].budget
        self.cpu_limit_s: float | None = None
        self.cgroup: Any = None                 # its SandboxCgroup (cgroups.py), set by the pool
        self.egress = egress                    # where pid 1 hands over its proxy listener
        self.killed: str | None = None
        self._servers: list[Any] = []           # egress.Serving of this call
        self._ooms = 0                          # OOM events of its cgroup (v1) the pool acted on

    @classmethod
    async def spawn(cls, python: str, spec: dict[str, Any], *, max_output_bytes: int,
                    egress: bool = False, lines: bool = False) -> "SandboxProcess":
        """Start boot with `spec` (its "status_fd" is filled in here); the tool then waits for code.
        Boot runs from an open file (`/dev/fd/N`), so no host path is in its command line."""
        loop = asyncio.get_running_loop()
        status_r, status_w = os.pipe()
        spec_r, spec_w = os.pipe()
        boot_fd = os.open(BOOT, os.O_RDONLY)
        ours, theirs = socket.socketpair() if egress else (None, None)
        fds = [status_w, spec_r, boot_fd] + ([theirs.fileno()] if theirs else [])
        try:
            # the spec goes over a pipe (it fits in the pipe's buffer), not argv: nothing in the
            # sandbox can read it from /proc/*/cmdline
            data = json.dumps({**spec, "status_fd": status_w,
                               "egress_fd": theirs.fileno() if theirs else None}).encode()
            if len(data) > 60000:
                raise ValueError(f"sandbox spec of {len(data)} bytes is too large for a pipe")
            os.write(spec_w, data)
            os.close(spec_w)
            spec_w = -1
            popen = subprocess.Popen(
                [python, "-I", "-S", f"/dev/fd/{boot_fd}", str(spec_r)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"}, cwd="/", pass_fds=fds, start_new_session=True)
        except BaseException:
            os.close(status_r)
            if ours is not None:
                ours.close()
            raise
        finally:
            os.close(status_w)                  # only the sandbox holds the write end now
            os.close(spec_r)
            os.close(boot_fd)
            if theirs is not None:
                theirs.close()
            if spec_w >= 0:
                os.close(spec_w)
        budget = _Budget(max_output_bytes)
        pipes = {}
        status = os.fdopen(status_r, "rb", 0)
        try:
            for name, fileobj, cap in (("stdout", popen.stdout, budget), ("stderr", popen.stderr, budget),
                                       ("status", status, None)):
                reader = (lambda: _Lines(budget, max_output_bytes)) if lines and name == "stdout" \
                    else (lambda cap=cap: _Capture(cap))
                pipes[name] = await loop.connect_read_pipe(reader, fileobj)
            stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, popen.stdin)
        except BaseException:
            # cancelled (e.g. the event loop of a warm-up ends) or out of fds between Popen and the
            # pipes: nobody else knows this process, so it is ended and reaped here
            for transport, _ in pipes.values():
                transport.close()
            status.close()
            if ours is not None:
                ours.close()
            _end_boot(popen, spec["mode"], spec["uid"])
            shutil.rmtree(spec["stage_dir"], ignore_errors=True)
            raise
        sbx = cls(popen, spec["mode"], spec["stage_dir"], spec["uid"], pipes, stdin, egress=ours)
        sbx.cpu_limit_s = spec["limits"]["cpu_s"]
        return sbx

    @property
    def alive(self) -> bool:
        return not self.pipes["status"][1].closed.done()

    @property
    def lines(self) -> "asyncio.Queue[bytes | None]":
        """A server's stdout, line by line (None: it ended)."""
        return self.pipes["stdout"][1].queue

    def send(self, data: bytes) -> None:
        """Write to a server's stdin (nothing once it has ended)."""
        if not self.stdin.is_closing():
            self.stdin.write(data)

    async def execute(self, code: str, timeout_s: float, *, proxy: Any = None,
                      call: dict[str, Any] | None = None) -> SandboxResult:
        """Run `code`; with `proxy` (an EgressProxy) the tool's connections to pid 1's listener are
        served by it for this call (`call` names the episode and tool call in its audit records)."""
        started = time.monotonic()
        if proxy is not None and self.egress is not None:
            listener = await _receive_listener(self.egress, timeout_s)
            if listener is not None:
                self._servers.append(await proxy.serve(listener, call or {}))
        oom = self.cgroup.oom_events() if self.cgroup is not None else None
        if oom is not None:                     # cgroup v1: the first OOM ends the whole sandbox
            asyncio.get_running_loop().add_reader(oom, self._on_oom, oom)
        # a lone surrogate in the code is the program's problem (Python reports it as a SyntaxError
        # the policy sees), not an exception of ours
        self.stdin.write(code.encode("utf-8", "surrogatepass"))
        self.stdin.close()
        ended = self.pipes["status"][1].closed
        overflow = asyncio.ensure_future(self.budget.overflow.wait())
        await asyncio.wait({ended, overflow}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        overflow.cancel()
        if oom is not None:
            asyncio.get_running_loop().remove_reader(oom)
            os.close(oom)
        timed_out = truncated = False
        if not ended.done():
            truncated = self.budget.overflow.is_set()
            timed_out = not truncated
        await self.close()
        truncated = truncated or self.budget.overflow.is_set()
        events = []
        for line in self.pipes["status"][1].buf.decode("utf-8", "replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        exit_event = next((e for e in events if e.get("event") == "exit"), None)
        setup = next((e["error"] for e in events if e.get("event") == "setup_error"), None)
        if exit_event is None and setup is None and not (timed_out or truncated or self.killed):
            setup = f"sandbox ended without a status (boot exit code {self.popen.returncode})"
        killed = timed_out or truncated or self.killed is not None
        return SandboxResult(
            stdout=self.pipes["stdout"][1].buf.decode("utf-8", "replace"),
            stderr=self.pipes["stderr"][1].buf.decode("utf-8", "replace"),
            exit_code=None if killed or exit_event is None else exit_event["code"],
            signal=signal.SIGKILL if killed else (exit_event or {}).get("signal"),
            timed_out=timed_out, output_truncated=truncated, setup_error=setup,
            wall_s=time.monotonic() - started, isolation=self.mode,
            cpu_s=(exit_event or {}).get("cpu_s"), cpu_limit_s=self.cpu_limit_s,
            oom_kills=max(self.cgroup.oom_kills(), self._ooms) if self.cgroup is not None else 0,
            killed=self.killed)

    def _on_oom(self, fd: int) -> None:
        try:
            os.eventfd_read(fd)
        except OSError:
            return
        self._ooms += 1                          # the kernel may not kill anything itself: we do first
        self.cgroup.kill()

    def hard_kill(self, reason: str) -> None:
        """The kill switch (any thread): SIGKILL everything of this sandbox now, without waiting for
        boot to be scheduled: its cgroup, boot's process group (pid 1 dies with boot, PDEATHSIG, and
        every process of its namespace with pid 1); in mode none boot is asked to reap the tool's
        tree first. `execute` then returns a result with `killed` set."""
        self.killed = reason
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.mode == "none":
            self.kill()
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """Ask boot to end the sandbox (SIGTERM): it SIGKILLs pid 1 (namespaces) or the tool and its
        descendants (mode none) and exits only once they are reaped, so the end of the status
        channel means nothing of the sandbox is left. `close` escalates if boot does not finish."""
        try:
            self.popen.send_signal(signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_all(self) -> None:
        """Last resort: SIGKILL the sandbox's process group (without namespaces also every
        process of its uid)."""
        _kill_group(self.popen, self.mode, self.uid)

    async def close(self) -> None:
        """End the sandbox if still running, reap it, release pipes and the host directory."""
        ended = self.pipes["status"][1].closed
        if not ended.done():
            self.kill()
            try:
                # generous: a loaded machine may take seconds to schedule boot and reap pid 1
                await asyncio.wait_for(asyncio.shield(ended), timeout=KILL_GRACE_S)
            except asyncio.TimeoutError:
                self._kill_all()
        for name in ("stdout", "stderr"):               # normally closed with the last process
            transport, capture = self.pipes[name]
            try:
                await asyncio.wait_for(asyncio.shield(capture.closed), timeout=0.5)
            except asyncio.TimeoutError:
                transport.close()
        self.pipes["status"][0].close()
        self.stdin.close()
        for serving in self._servers:                    # its egress: no new connection, none left open
            serving.close()
        self._servers.clear()
        if self.egress is not None:
            self.egress.close()
        deadline = time.monotonic() + KILL_GRACE_S
        while self.popen.poll() is None:                 # boot exits right after its last write
            if time.monotonic() > deadline:
                self._kill_all()
                self.popen.wait()
                break
            await asyncio.sleep(0.002)
        shutil.rmtree(self.host_dir, ignore_errors=True)

    def abandon(self) -> None:
        """End the sandbox without an event loop (its loop is gone): kill, reap, release. Returns
        only when boot has exited, and boot exits only after pid 1 (and with it every process of
        the namespace) is reaped."""
        _end_boot(self.popen, self.mode, self.uid)
        for transport, _ in self.pipes.values():
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - the loop may be closed; the pipes go with the objects below
                pass
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()
        if self.egress is not None:
            self.egress.close()
        shutil.rmtree(self.host_dir, ignore_errors=True)


KILL_GRACE_S = 10.0


async def _receive_listener(channel: socket.socket, timeout_s: float) -> socket.socket | None:
    """The listening socket pid 1 sends over `channel` (None if the sandbox ended first)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future = loop.create_future()
    channel.setblocking(False)

    def readable():
        try:
            _, fds, _, _ = socket.recv_fds(channel, 1, 1)
        except BlockingIOError:
            return
        except OSError as err:
            fds = []
            if not got.done():
                got.set_exception(err)
        loop.remove_reader(channel.fileno())
        if not got.done():
            got.set_result(fds)

    loop.add_reader(channel.fileno(), readable)
    try:
        fds = await asyncio.wait_for(got, timeout_s)
    except (asyncio.TimeoutError, OSError):
        return None
    finally:
        loop.remove_reader(channel.fileno())
    return socket.socket(fileno=fds[0]) if fds else None


def _kill_group(popen: subprocess.Popen, mode: str, uid: int) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if mode == "none" and uid >= 0:
        kill_uid(uid)


def _end_boot(popen: subprocess.Popen, mode: str, uid: int) -> None:
    """Synchronously: SIGTERM boot and wait for it (it reaps the sandbox before it exits); SIGKILL
    the group only if it does not finish within KILL_GRACE_S."""
    if popen.poll() is None:
        try:
            popen.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            popen.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(popen, mode, uid)
            popen.wait()


def kill_uid(uid: int) -> int:
    """SIGKILL every process of `uid` (the last resort behind isolation=none as root)."""
    import psutil

    killed = 0
    for _ in range(3):                      # a fork bomb may be forking while we sweep
        victims = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]
        if not victims:
            break
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
                killed += 1
            except psutil.Error:
                pass
    return killed
