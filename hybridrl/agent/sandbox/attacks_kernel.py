"""Attacks on what a capability-less process can still reach in the kernel (closed by the syscall
filter), on pid 1 of the sandbox (a broken pid 1 would turn the call into an infrastructure error:
a reward dodge), and on host facts the sandbox's /proc would show. Programs are `str.format`ed
with the attack context; each prints a marker for what it managed, then DONE.
"""

from __future__ import annotations

from typing import Callable

_LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"

# every catchable signal and SIGKILL / SIGSTOP to pid 1, then on: the call must end as the tool's own
SIGNAL_PID1 = """
import os, signal, time
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGPIPE, signal.SIGSEGV, signal.SIGXCPU, signal.SIGSTOP, signal.SIGKILL):
    try:
        os.kill(1, sig)
        print("sent", sig.name, flush=True)
    except OSError as err:
        print("refused", sig.name, err.errno, flush=True)
time.sleep(0.3)
print("DONE")
"""

# limits on pid 1 (it would be killed by the kernel, or fail to report the tool's end)
PRLIMIT_PID1 = """
import resource, time
for res, value in ((resource.RLIMIT_CPU, 0), (resource.RLIMIT_AS, 1 << 20), (resource.RLIMIT_NOFILE, 0)):
    try:
        resource.prlimit(1, res, (value, value))
        print("LIMITED", res, flush=True)
    except OSError as err:
        print("refused", res, err.errno, flush=True)
time.sleep(0.5)                                       # pid 1 past its hard CPU limit is killed at the next tick
print("DONE")
"""

# socket families other than AF_UNIX (AF_INET / AF_INET6 only where the egress proxy is on).
# AF_VSOCK is not network-namespaced: on a VM a connect to the host's CID would bypass the sandbox's
# network namespace; the socket is only created here, never connected.
SOCKETS = _LIBC + """
import os
NR_SOCKET = {{"x86_64": 41, "aarch64": 198}}[os.uname().machine]
families = {{"AF_VSOCK": 40, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_ALG": 38, "AF_INET": 2, "AF_INET6": 10,
            "AF_BLUETOOTH": 31, "AF_XDP": 44, "AF_UNSPEC": 0,
            "AF_VSOCK|1<<32": 40 | (1 << 32)}}
allowed = {allowed_families!r}
for name, family in families.items():
    for kind in (1, 2, 3, 5):                                   # stream, datagram, raw, seqpacket
        fd = libc.syscall(NR_SOCKET, ctypes.c_long(family), kind, 0)
        if fd >= 0:
            os.close(fd)
            if name not in allowed:
                print("CREATED", name, kind, flush=True)
            break
print("DONE")
"""

# kernel interfaces with a history of privilege escalations, none of which a tool needs
SYSCALLS = _LIBC + """
import os
NR = {{"x86_64": dict(userfaultfd=323, io_uring_setup=425, bpf=321, perf_event_open=298, keyctl=250, add_key=248,
                     setns=308, ptrace=101),
      "aarch64": dict(userfaultfd=282, io_uring_setup=425, bpf=280, perf_event_open=241, keyctl=219, add_key=217,
                      setns=268, ptrace=117)}}[os.uname().machine]
params = ctypes.create_string_buffer(120)
attr = ctypes.create_string_buffer(128)
ctypes.memmove(attr, (1).to_bytes(4, "little") + (128).to_bytes(4, "little"), 8)   # PERF_TYPE_SOFTWARE, size
bpf_attr = ctypes.create_string_buffer((2).to_bytes(4, "little") + (4).to_bytes(4, "little") * 2
                                       + (1).to_bytes(4, "little"), 72)               # an array map
calls = {{"userfaultfd": (0o2000000 | 1,),                      # O_CLOEXEC | UFFD_USER_MODE_ONLY
         "io_uring_setup": (8, params),
         "bpf": (0, bpf_attr, 72),                              # BPF_MAP_CREATE
         "perf_event_open": (attr, 0, -1, -1, 0),
         "keyctl": (0, -3, 0),                                  # KEYCTL_GET_KEYRING_ID of the session keyring
         "add_key": (b"user", b"hybridrl-attack", b"x", 1, ctypes.c_long(-3)),
         "setns": (-1, 0)}}
for name, args in calls.items():
    ret = libc.syscall(NR[name], *args)
    err = ctypes.get_errno()
    if ret >= 0 or err not in (1, 38, 13, 22, 9, 95):            # an fd / key, or an error past the filter
        print("ALLOWED", name, ret, err, flush=True)
    elif name == "setns" and err == 9:                          # EBADF: the kernel looked at the fd
        print("ALLOWED", name, ret, err, flush=True)
if os.fork() == 0:
    os._exit(0 if libc.syscall(NR["ptrace"], 0, 0, 0, 0) == 0 else 1)    # PTRACE_TRACEME
if os.waitstatus_to_exitcode(os.wait()[1]) == 0:
    print("ALLOWED ptrace", flush=True)
print("DONE")
"""

# the per-uid persistent keyring lives on in the kernel for days after the call (root mode: the
# slot's uid is reused by later calls, pools and runs)
_PERSISTENT = _LIBC + """
import os
NR = {{"x86_64": (248, 250), "aarch64": (217, 219)}}[os.uname().machine]
add_key, keyctl = NR
ring = libc.syscall(keyctl, 22, ctypes.c_long(-1), ctypes.c_long(-3))    # KEYCTL_GET_PERSISTENT
"""

PERSISTENT_STORE = _PERSISTENT + """
if ring > 0:
    libc.syscall(add_key, b"user", b"hybridrl-persistent", b"episode-secret", 14, ctypes.c_long(ring))
print("DONE")
"""

PERSISTENT_READ = _PERSISTENT + """
if ring > 0 and libc.syscall(keyctl, 10, ctypes.c_long(ring), b"user", b"hybridrl-persistent", 0) > 0:
    print("FOUND persistent")
print("DONE")
"""

# facts of the host: its load and thread count, its cgroup layout, the host paths in pid 1's cmdline
HOST_FACTS = """
import glob, os
pids = [p for p in os.listdir("/proc") if p.isdigit()]
try:
    fields = open("/proc/loadavg").read().split()
    total = int(fields[3].split("/")[1])
    if total > len(pids) + 4 or any(float(x) > 0 for x in fields[:3]):
        print("HOST_LOAD", " ".join(fields), flush=True)
except (OSError, IndexError, ValueError):
    pass
for line in open("/proc/self/cgroup"):
    if line.strip().rsplit(":", 1)[-1] != "/":
        print("CGROUP_PATH", line.strip(), flush=True)
for path in glob.glob("/proc/[0-9]*/cmdline"):
    text = open(path, "rb").read().decode("utf-8", "replace")
    for secret in {secret_paths!r} + ["boot.py", "hybridrl"]:
        if secret in text:
            print("CMDLINE", path, secret, flush=True)
print("DONE")
"""


def _done(r) -> bool:
    return r.ok and r.stdout.rstrip().endswith("DONE")


def _absent(*markers: str) -> Callable:
    return lambda r, ctx: _done(r) and not any(m in r.stdout for m in markers)


def _pid1_intact(r, ctx) -> bool:
    """The call ended as the tool's own (reached its end, no setup error): pid 1 survived and reported."""
    return r.setup_error is None and _done(r)


KERNEL_ATTACKS: list[tuple[str, str, str, Callable, dict]] = [
    ("signal_pid1", "pid 1 ignores signals from inside and always reports how the tool ended (a signal to pid 1 "
                    "cannot turn the call into an infrastructure error)", SIGNAL_PID1, _pid1_intact, {}),
    ("prlimit_pid1", "the syscall filter refuses prlimit on any process but the caller: pid 1's limits stay",
     PRLIMIT_PID1, lambda r, ctx: _pid1_intact(r, ctx) and "LIMITED" not in r.stdout, {}),
    ("socket_families", "the syscall filter allows AF_UNIX sockets only (AF_INET/AF_INET6 too with the egress "
                        "proxy): no AF_VSOCK, netlink, packet or crypto sockets", SOCKETS, _absent("CREATED"),
     {"modes": ("root", "userns", "none")}),
    ("kernel_surface", "the syscall filter refuses userfaultfd, io_uring, bpf, perf_event_open, keyctl, add_key, "
                       "setns and ptrace", SYSCALLS, _absent("ALLOWED"), {"modes": ("root", "userns", "none")}),
    ("persistent_keyring", "the uid's persistent keyring is emptied and keyctl refused: nothing stored survives "
                           "into a later call of the same uid", PERSISTENT_READ, _absent("FOUND"),
     {"before": PERSISTENT_STORE, "rounds": "slots"}),
    ("host_facts", "the sandbox's /proc shows no host load, no host cgroup path, no host path in any command line",
     HOST_FACTS, _absent("HOST_LOAD", "CGROUP_PATH", "CMDLINE"), {}),
]
