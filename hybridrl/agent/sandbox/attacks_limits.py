"""Attacks on the sandbox's memory and process limits (the per-sandbox cgroup, the tmpfs, and the
syscall filter that keeps a tool out of namespaces of its own). Each program holds what it got at
once and prints it; `_held_below` reads the numbers, and a call the memory cgroup stopped
(`SandboxResult.limit_hit == "memory"`, decided from the cgroup's own OOM counter) is contained.

The programs are `str.format`ed with the attack context (`memory_mb`, `tmpfs_inodes`); they ask for
three times the sandbox's memory, so a defence that works costs the host at most `memory_mb`.
"""

from __future__ import annotations

from typing import Callable

_LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"

# enter a new user namespace (+ the given ones), the caller's own uid mapped to uid 1 there (mapping
# uid 0 needs CAP_SETFCAP at unshare time); its creator has every capability in it
_NESTED = _LIBC + """
import os
uid, gid = os.getuid(), os.getgid()

def nested(flags):
    if libc.unshare(0x10000000 | flags) != 0:                  # CLONE_NEWUSER | flags
        print("REFUSED unshare", ctypes.get_errno(), flush=True)
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"1 {{uid}} 1"), ("gid_map", f"1 {{gid}} 1")):
        try:
            with open(f"/proc/self/{{name}}", "w") as f:
                f.write(text)
        except OSError as err:                                 # uid 0 of a user namespace cannot map
            print("NO_MAP", name, err.errno, flush=True)       # itself without CAP_SETFCAP: go on unmapped
    return True
"""

# a tmpfs of its own, in a nested user + mount namespace: file pages are not address space
NESTED_TMPFS = _NESTED + """
held = 0
if nested(0x00020000):                                         # CLONE_NEWNS
    os.makedirs("/tmp/fill", exist_ok=True)
    if libc.mount(b"none", b"/tmp/fill", b"tmpfs", 0, b"size=16g") != 0:
        print("REFUSED mount", ctypes.get_errno(), flush=True)
    else:
        chunk = b"x" * (1 << 20)
        for i in range(3 * {memory_mb}):                       # 1 MiB files: under RLIMIT_FSIZE
            try:
                with open(f"/tmp/fill/{{i}}", "wb", buffering=0) as f:
                    f.write(chunk)
            except OSError as err:                             # EOVERFLOW unmapped, ENOSPC, EFBIG
                print("STOPPED", err.errno, flush=True)
                break
            held += 1
print("HELD_MIB", held, flush=True)
print("DONE")
"""

# anonymous files: written with write(), never mapped; each within RLIMIT_FSIZE, as many as
# RLIMIT_NOFILE allows
MEMFD = """
import os
chunk_mib = min(8, {max_file_mb})
chunk = b"x" * (chunk_mib << 20)
fds, held = [], 0
for i in range(3 * {memory_mb} // chunk_mib):
    try:
        fd = os.memfd_create(f"hold{{i}}")
        fds.append(fd)
        if os.write(fd, chunk) != len(chunk):
            break
    except OSError as err:
        print("STOPPED", err.errno, flush=True)
        break
    held += chunk_mib
print("HELD_MIB", held, flush=True)
print("DONE")
"""

# SysV shared memory in a nested user + IPC namespace, whose limits are the kernel's defaults
NESTED_SHM = _NESTED + """
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
held = 0
per = max(8, {memory_mb} // 4)                                 # attached one at a time: under RLIMIT_AS
if nested(0x08000000):                                         # CLONE_NEWIPC
    for i in range(3 * {memory_mb} // per):
        shmid = libc.shmget(0, per << 20, 0o1000 | 0o600)      # IPC_PRIVATE, IPC_CREAT
        if shmid < 0:
            print("STOPPED shmget", ctypes.get_errno(), flush=True)
            break
        addr = libc.shmat(shmid, None, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            print("STOPPED shmat", ctypes.get_errno(), flush=True)
            break
        ctypes.memset(addr, 1, per << 20)
        libc.shmdt(ctypes.c_void_p(addr))                      # the segment keeps its memory
        held += per
print("HELD_MIB", held, flush=True)
print("DONE")
"""

# three children, each within the per-process address-space limit, together far above it
CHILDREN = """
import mmap, os, select, time
per = max(1, int(0.8 * {memory_mb}))
r, w = os.pipe()
kids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            m = mmap.mmap(-1, per << 20)
            for off in range(0, per << 20, 4096):
                m[off] = 1
            os.write(w, bytes([i]))
        except (OSError, MemoryError, ValueError):
            pass
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
os.close(w)
holding, dead = set(), set()
while len(holding | dead) < 3:                         # each child holds its share, or has died
    if select.select([r], [], [], 0.05)[0]:
        holding.update(os.read(r, 3))
    dead.update(i for i, k in enumerate(kids) if i not in dead and os.waitpid(k, os.WNOHANG)[0] != 0)
alive = [i for i in holding if i not in dead and os.waitpid(kids[i], os.WNOHANG)[0] == 0]
print("HELD_MIB", per * len(alive), "of", per * 3, flush=True)
for i, k in enumerate(kids):
    if i not in dead:
        os.kill(k, 9)
        os.waitpid(k, 0)
print("DONE")
"""

# empty files cost kernel memory that a tmpfs `size` does not count
INODES = """
import os
made = 0
os.mkdir("flood")
for i in range(3 * {tmpfs_inodes}):
    try:
        os.close(os.open(f"flood/{{i}}", os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as err:
        print("STOPPED", err.errno, flush=True)
        break
    made += 1
print("FILES", made, flush=True)
print("DONE")
"""


def _done(r) -> bool:
    return r.ok and r.stdout.rstrip().endswith("DONE")


def held_below(r, ctx) -> bool:
    """Contained: the memory cgroup stopped the call, or what the program held at once stayed
    under the sandbox's memory."""
    if r.limit_hit == "memory":
        return True
    if not _done(r):
        return False
    held = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("HELD_MIB")]
    return bool(held) and max(held) < ctx["memory_mb"]


def inodes_bounded(r, ctx) -> bool:
    if not _done(r):
        return False
    made = int(r.stdout.split("FILES")[1].split()[0])
    return made <= ctx["tmpfs_inodes"]


LIMIT_ATTACKS: list[tuple[str, str, str, Callable, dict]] = [
    # name, what it checks, program, verdict, Attack options
    ("nested_tmpfs", "no user namespace of its own (seccomp) and the memory cgroup: a private tmpfs cannot "
                     "hold memory past the limit", NESTED_TMPFS, held_below, {}),
    ("memfd", "the memory cgroup counts anonymous files (without one, memfd_create is refused)", MEMFD,
     held_below, {}),
    ("nested_shm", "no IPC namespace of its own: SysV shared memory stays at zero", NESTED_SHM, held_below, {}),
    ("children_memory", "the memory cgroup covers every process of the sandbox, not one at a time", CHILDREN,
     held_below, {"needs_cgroup": True}),
    ("inode_flood", "the tmpfs has nr_inodes: empty files cannot exhaust kernel memory", INODES,
     inodes_bounded, {}),
]
