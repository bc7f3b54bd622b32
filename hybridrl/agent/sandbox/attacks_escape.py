"""Attacks of the fourth red-team round: the boot program's descriptor (an escape from userns mode),
the egress proxy as a way to break the audit log or exhaust the trainer's descriptors, the host's
abstract Unix sockets in isolation=none, and CPU beyond the sandbox's share. Programs are
`str.format`ed with the attack context; each prints a marker for what it managed, then DONE.

`BOOT_FD` performs the escape as reported: it reopens every inherited descriptor through
/proc/self/fd for writing and, where that works on boot's own program, rewrites it (O_TRUNC) with a
payload that announces itself on the next sandbox's stdout (BOOT_HIJACKED) and then puts the
original program back, so that a node where the attack succeeds is left as it was.
"""

from __future__ import annotations

from typing import Callable

# the payload put in front of boot's program: restores the original, then says it ran (on the host)
_PAYLOAD = (b'import sys as _s\n_t = open(_s.argv[0], "rb").read()\n'
            b'open(_s.argv[0], "wb").write(_t[_t.index(b"#END" + b"-HIJACK\\n") + 12:])\n'
            b'import os as _o\n_o.write(1, b"BOOT_HIJACKED\\n")\n#END-HIJACK\n')

BOOT_FD = """
import os
PAYLOAD = {payload!r}
secrets = {secret_paths!r}
fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
for fd in fds:
    if fd <= 2:
        continue
    try:
        target = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:                                   # listdir's own descriptor, closed by now
        continue
    print("LEAKED_FD", fd, target[-120:], flush=True)
    if any(s in target for s in secrets):
        print("HOST_PATH", target, flush=True)
    try:
        original = os.pread(fd, 1 << 22, 0)
    except OSError:
        original = b""
    try:
        w = os.open(f"/proc/self/fd/{{fd}}", os.O_WRONLY | os.O_TRUNC)
    except OSError as err:
        print("reopen refused", fd, err.errno, flush=True)
        continue
    if b"def exec_tool" in original:                  # boot's program: the next sandbox runs it
        os.write(w, PAYLOAD + original)
        print("REWROTE_BOOT", fd, flush=True)
    elif original:
        os.write(w, original)                         # put back what O_TRUNC emptied
    print("REOPENED_FOR_WRITE", fd, flush=True)
    os.close(w)
# the parent's descriptors (boot's, in isolation=none; pid 1's otherwise): its status pipe would let
# the tool forge how it ended
try:
    parent = [int(n) for n in os.listdir(f"/proc/{{os.getppid()}}/fd")]
    print("PARENT_FDS", sorted(parent), flush=True)
except OSError:
    pass
# where the host's filesystem is not there (namespaces), nothing may name a host path either
views = ["/proc/self/mountinfo", "/proc/self/cmdline", "/proc/self/environ", "/proc/1/cmdline", "/proc/1/environ"]
for secret in secrets:
    if os.path.exists(secret):
        continue
    for view in views:
        try:
            text = open(view, "rb").read().decode("utf-8", "replace")
        except OSError:
            continue
        if secret in text:
            print("HOST_PATH", view, secret, flush=True)
print("DONE")
"""

# a CONNECT whose target is 11,000 bytes of 0xFF (each a 6-byte JSON escape in a log line)
EGRESS_AUDIT = """
import socket
try:
    s = socket.create_connection(("127.0.0.1", {proxy_port}), 5)
except OSError as err:
    print("NO_EGRESS", err.errno)
else:
    s.sendall(b"CONNECT " + b"\\xff" * 11000 + b":443 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    s.settimeout(10)
    try:
        print("reply", s.recv(200).split(b"\\r\\n")[0])
    except OSError as err:
        print("no reply", err)
    s.close()
print("DONE")
"""

# many connections to the proxy, each with an unfinished request head (the proxy would wait for
# it): how many does the proxy keep open for this one sandbox?
EGRESS_FDS = """
import socket, time
socks = []
for i in range(60):
    try:
        s = socket.create_connection(("127.0.0.1", {proxy_port}), 5)
        s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\n")
        socks.append(s)
    except OSError as err:
        print("connect failed", i, err.errno, flush=True)
        break

def open_now():
    held = 0
    for s in socks:
        s.setblocking(False)
        try:
            held += s.recv(1) != b""
        except BlockingIOError:
            held += 1
        except OSError:
            pass
    return held

deadline = time.monotonic() + 5
held = open_now()
while held > {egress_max_connections} and time.monotonic() < deadline:
    time.sleep(0.2)
    held = open_now()
print("HELD", held, "of", len(socks), flush=True)
print("DONE")
"""

# the host's abstract Unix socket (not network-namespaced only where there is no namespace)
UNIX_ABSTRACT = """
import socket
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect("\\0{abstract_name}")
    print("CONNECTED", flush=True)
except OSError as err:
    print("refused", err.errno)
print("DONE")
"""

# three processes spinning until they have used 2 s worth of the sandbox's CPU share together;
# the CPU time they got per wall-clock second is its rate
CPU_SHARE = """
import os, time
per_child = {cpu_cores} * 2.0 / 3
started = time.monotonic()
pipes = []
for _ in range(3):
    r, w = os.pipe()
    if os.fork() == 0:
        end = time.process_time() + per_child
        while time.process_time() < end:
            pass
        os.write(w, repr(time.process_time()).encode())
        os._exit(0)
    os.close(w)
    pipes.append(r)
used = sum(float(os.read(r, 64) or 0) for r in pipes)
for _ in pipes:
    os.wait()
wall = time.monotonic() - started
print("RATE", round(used / wall, 4), "cpu", round(used, 3), "wall", round(wall, 3), flush=True)
print("DONE")
"""


BOOT_FD = BOOT_FD.replace("{payload!r}", repr(_PAYLOAD))       # before str.format: no braces in it


def _done(r) -> bool:
    return r.ok and r.stdout.rstrip().endswith("DONE")


def _absent(*markers: str) -> Callable:
    return lambda r, ctx: _done(r) and not any(m in r.stdout for m in markers)


def audit_intact(r, ctx) -> bool:
    """The call ended as the tool's own, and the audit log is whole, short-lined and still appendable."""
    from hybridrl.telemetry import audit

    if not _done(r):
        return False
    path = ctx.get("audit_path")
    if not path:
        return True
    log = audit.AuditLog(path)
    if not log.record("sandbox_check", probe="after egress_audit"):
        return False
    intact, _, _ = audit.verify(path)
    longest = max((len(line) for line in open(path, "rb")), default=0)
    return intact and longest <= audit.MAX_LINE + 1


def _held_within_cap(r, ctx) -> bool:
    if not _done(r) or "NO_EGRESS" in r.stdout:
        return _done(r)
    held = int(r.stdout.split("HELD")[1].split()[0])
    return held <= ctx["egress_max_connections"]


def _cpu_within_share(r, ctx) -> bool:
    if not _done(r):
        return False
    rate = float(r.stdout.split("RATE")[1].split()[0])
    return rate <= ctx["cpu_cores"] * 1.3 + 0.02


ESCAPE_ATTACKS: list[tuple[str, str, str, Callable, dict]] = [
    ("boot_fd", "the tool holds only descriptors 0-2: boot's program (a host file the trainer's uid may own) "
                "cannot be reopened for writing through /proc/self/fd, and no host path is visible",
     BOOT_FD, _absent("LEAKED_FD", "HOST_PATH", "REOPENED_FOR_WRITE", "REWROTE_BOOT", "BOOT_HIJACKED",
             "PARENT_FDS"),
     {"modes": ("root", "userns", "none"), "rounds": "slots"}),
    ("egress_audit", "the proxy reads at most 8 KiB of a request head and logs a cut target: an 11,000-byte "
                     "CONNECT target leaves the audit log whole and appendable",
     EGRESS_AUDIT, audit_intact, {"egress": True}),
    ("egress_fds", "the proxy keeps at most tools.egress_max_connections connections of one sandbox open: a "
                   "tool cannot exhaust the trainer's descriptors",
     EGRESS_FDS, _held_within_cap, {"egress": True}),
    ("unix_abstract", "no host Unix socket, abstract ones included: a network namespace (namespaces) or no "
                      "AF_UNIX socket() at all (isolation=none)",
     UNIX_ABSTRACT, _absent("CONNECTED"), {"modes": ("root", "userns", "none")}),
    ("cpu_share", "the sandbox's cpu cgroup: its processes together get at most tools.cpu_cores of CPU",
     CPU_SHARE, _cpu_within_share, {"modes": ("root", "userns", "none"), "needs_cpu": True}),
]
