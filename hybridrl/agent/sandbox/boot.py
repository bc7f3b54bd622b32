"""Sandbox bootstrap: runs as `python -I -S boot.py SPEC_FD` (the JSON spec is read from that pipe,
so it never appears in a command line), standard library only.

Process tree (mode "root" or "userns"):

    boot        host namespaces; unshare(pid [, user]); waits for pid1, then removes the host
     │          directory (so nothing is left even if the parent died)
     └ pid1     pid 1 of a new pid namespace; unshare(mount, net, ipc, uts); private mounts,
        │       then forks the tool and reaps; when it exits the kernel kills everything left
        │       in the namespace. Every signal at its default: the kernel drops those that come
        │       from inside the namespace, so the tool cannot stop it from reporting its end
        └ tool  joins the sandbox's cgroup (memory, pids) and a cgroup namespace of its own;
                rlimits, own uid (root mode), no capabilities, clean env, cwd = private tmpfs;
                the syscall filter (compiled by libseccomp in the pool, `seccomp.py`) last;
                execs the runner

Boot itself is started as `python -I -S /dev/fd/N`: no host path is in any command line the tool
can read. Boot closes N (and anything else inherited) as soon as it has read its spec, and the tool
closes every descriptor but 0-2 right before its exec (`close_fds`): the file of boot's program,
which the trainer's uid may own, is never reachable from the tool (reopened through
/proc/self/fd/N it could be rewritten, and the next sandbox's boot would run the payload on the host).

Mounts inside (never visible outside; `setup_mounts`): a fresh tmpfs root holding only the
allow-listed `visible` paths and the interpreter (`expose`), read-only, nosuid, nodev; `hidden`
directories under them covered by an empty tmpfs; a minimal /dev; the pid namespace's /proc with
/proc/sys read-only; the tool's working directory /tmp, a size-limited tmpfs owned by its uid.
pid 1 `pivot_root`s into it and detaches the host's root. The tool runs with no capabilities,
no_new_privs, fresh keyrings (the uid's persistent keyring emptied) and no SysV IPC
(`drop_privileges`, `limit_ipc`); /proc/loadavg shows a neutral load and a few /proc files that
describe the host are empty (`mask_proc`).
The network namespace has only a loopback device, down: no connection can be made, not even to
127.0.0.1. With egress (`network: allowlist`) pid 1 brings loopback up, listens on 127.0.0.1:PROXY_PORT
and hands the listening socket to the pool (SCM_RIGHTS over `egress_fd`): the pool's proxy, outside,
accepts the tool's connections there and decides each CONNECT (`egress.py`).

Mode "none" (the OS refused namespaces): boot forks the tool directly and is its child
subreaper, so every process the tool leaves behind (even one that called setsid) becomes
boot's child and is killed and reaped before boot exits. Rlimits, the clean environment, the
private working directory (a host directory the parent removes) and, when run as root, the
dedicated uid still apply; there is no network or filesystem isolation.

SIGTERM to boot ends the sandbox: it kills pid 1 (namespaces) or the tool and all its
descendants (mode none), then cleans up and exits. Boot gets SIGTERM when its parent dies
(PR_SET_PDEATHSIG), so a killed trainer leaves no sandbox behind.

Events go to the parent as JSON lines on `status_fd`: ready, setup_error, exit.
"""

import ctypes
import json
import os
import resource
import shutil
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 32, 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_FLAG_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                 "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s):
    return None if s is None else s.encode()


def mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount {source or ''} on {target} ({fstype or 'flags'} {flags:#x})")


def _mount_points():
    """(mount point, per-mount flags) from /proc/self/mountinfo, in mount order."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")    # "\040" escapes
            flags = 0
            for opt in fields[5].split(","):
                flags |= _FLAG_OPTIONS.get(opt, 0)
            points.append((point, flags))
    return points


def _under(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


# syscalls glibc has no wrapper for, by machine
_SYSCALLS = {"x86_64": {"pivot_root": 155, "keyctl": 250, "seccomp": 317},
             "aarch64": {"pivot_root": 41, "keyctl": 219, "seccomp": 277}}
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
PR_SET_DUMPABLE = 4
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1, 1 << 2
CLONE_NEWCGROUP = 0x02000000
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEYCTL_UNLINK, KEYCTL_GET_PERSISTENT = 1, 7, 9, 22
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
PROXY_PORT = 3128
# /proc files that describe the host to anyone: a neutral load (its thread count and load are the
# host's) and no per-uid key quotas (which uids exist). (keys, timer_list, sched_debug show only the
# reader's own keys or are root-only; cpuinfo, meminfo, stat are left: programs size themselves by them.)
PROC_MASKS = {"loadavg": "0.00 0.00 0.00 1/1 1\n", "key-users": ""}
# SysV IPC inside the sandbox's own IPC namespace: no shared memory segments, message queues or
# semaphore sets at all (their memory is not counted by RLIMIT_AS)
IPC_LIMITS = {"kernel/shmall": "0", "kernel/shmmni": "0", "kernel/msgmni": "0", "kernel/sem": "0 0 0 0"}
DEVICES = ("null", "zero", "full", "random", "urandom")


def _syscall(name, *args):
    nr = _SYSCALLS.get(os.uname().machine, {}).get(name)
    if nr is None:
        raise OSError(38, f"{name}: no syscall number known for {os.uname().machine}")
    ret = _libc.syscall(ctypes.c_long(nr), *args)
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return ret


def _bind(source, root):
    """Recreate `source` (a symlink, directory or file) at the same path under `root`, bound read-only
    later (`_seal`)."""
    target = root + source
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if os.path.islink(source):
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)
    elif os.path.exists(source):
        if not os.path.exists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    else:
        return
    mount(source, target, None, MS_BIND | MS_REC)


def _seal(root, keep_writable):
    """Every mount under `root`: read-only, nosuid, nodev (but device nodes), flags it already has kept
    (a user namespace may not clear them)."""
    for point, flags in _mount_points():
        if not _under(point, [root]) or point == root or _under(point, keep_writable):
            continue
        extra = MS_RDONLY | MS_NOSUID
        if not _under(point, [root + "/dev"]):
            extra |= MS_NODEV
        mount(None, point, None, MS_REMOUNT | MS_BIND | flags | extra)


def setup_mounts(spec):
    """Build the tool's root on a fresh tmpfs from an allow-list, pivot into it, detach the host's.

    Inside: `visible` paths and the interpreter (`expose`) bound read-only, nosuid, nodev; `hidden`
    ones under them covered by an empty tmpfs; a minimal /dev; this pid namespace's /proc; the tool's
    working directory (a size-limited tmpfs owned by its uid) at `workdir`. Nothing else of the host's
    filesystem (the project, run directories, the virtualenv, home directories) exists in the tool's
    mount namespace."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = spec["stage_dir"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in sorted(set(spec["visible"]) | set(spec["expose"]), key=len):
        _bind(path, root)
    os.makedirs(root + "/dev", 0o755, exist_ok=True)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for dev in DEVICES:
        if os.path.exists("/dev/" + dev):
            _bind("/dev/" + dev, root)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    mount(None, root + "/dev", None, MS_REMOUNT | MS_NOSUID | MS_NOEXEC | MS_RDONLY)
    workdir = root + spec["workdir"]
    os.makedirs(workdir, 0o755, exist_ok=True)
    owner = f",uid={spec['uid']},gid={spec['gid']}" if spec["uid"] >= 0 and spec["mode"] != "userns" else ""
    # nr_inodes: empty files cost kernel memory that `size` does not count
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={spec['tmpfs_bytes']},nr_inodes={spec['tmpfs_inodes']},mode=700{owner}")
    os.makedirs(root + "/proc", 0o555, exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mask_proc(root)
    limit_ipc(root + "/proc/sys/")
    # /proc/sys read-only: in a user namespace, uid 0 (even without capabilities) may write the
    # sysctls of its own IPC namespace
    mount(root + "/proc/sys", root + "/proc/sys", None, MS_BIND | MS_REC)
    _seal(root, [workdir, root + "/proc"])
    for path in spec["hidden"]:                 # after sealing: a covered mount cannot be remounted by path
        if os.path.isdir(root + path) and not os.path.islink(root + path) and \
                not any(_under(e, [path]) for e in spec["expose"] + [spec["workdir"]]) and \
                not _under(path, [spec["workdir"], "/proc", "/dev"]):
            mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=755")
    mount(None, root + "/proc/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _syscall("pivot_root", b".", b".")          # the host's root now lies under ours; detach it
    _check(_libc.umount2(b".", MNT_DETACH), "umount2 of the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def mask_proc(root):
    """Cover the `PROC_MASKS` files of the sandbox's /proc with files of ours (made in the staging
    root, then unlinked: only the mounts keep them). They are the tool's own: writing them changes
    nothing but its own view, so they are not remounted read-only (two mount calls fewer each)."""
    staging = root + "/.proc-masks"
    os.mkdir(staging, 0o755)
    for name, text in PROC_MASKS.items():
        target = root + "/proc/" + name
        if not os.path.exists(target):
            continue
        source = f"{staging}/{name}"
        with open(source, "w") as f:
            f.write(text)
        mount(source, target, None, MS_BIND)
        os.unlink(source)
    os.rmdir(staging)


def limit_ipc(sysctl_dir):
    """In the sandbox's new IPC namespace (the sysctls show the writer's): no SysV IPC objects."""
    for key, value in IPC_LIMITS.items():
        with open(sysctl_dir + key, "w") as f:
            f.write(value)


def drop_privileges(spec):
    """No capabilities, now or after any exec (setuid/file capabilities included); own uid in root
    mode; fresh keyrings. Before the exec of the tool, in the tool process."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
            break                                # EINVAL: past the last capability of this kernel
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if spec["uid"] >= 0 and spec["mode"] != "userns":
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)                # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()                               # effective, permitted, inheritable x 2
    _check(_libc.capset(header, data), "capset")
    _fresh_keyrings(spec)


def _fresh_keyrings(spec):
    """A new session keyring; the uid's user keyrings and its persistent keyring (which the kernel
    keeps for days) emptied when the uid is the sandbox's own (a dedicated uid, or uid 0 of a fresh
    user namespace): what one call stored, the next cannot read. (The syscall filter then refuses
    keyctl altogether.)"""
    try:
        _syscall("keyctl", ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
        if spec["uid"] >= 0 or spec["mode"] == "userns":
            for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
                _syscall("keyctl", ctypes.c_long(KEYCTL_CLEAR), ctypes.c_long(ring))
            try:
                ring = _syscall("keyctl", ctypes.c_long(KEYCTL_GET_PERSISTENT), ctypes.c_long(-1),
                                ctypes.c_long(KEY_SPEC_SESSION_KEYRING))
            except OSError as err:
                if err.errno not in (95, 38):    # EOPNOTSUPP / ENOSYS: no persistent keyrings here
                    raise
            else:
                _syscall("keyctl", ctypes.c_long(KEYCTL_CLEAR), ctypes.c_long(ring))
                _syscall("keyctl", ctypes.c_long(KEYCTL_UNLINK), ctypes.c_long(ring),
                         ctypes.c_long(KEY_SPEC_SESSION_KEYRING))
    except OSError as err:
        if err.errno not in (38, 1):             # ENOSYS / EPERM: no keyrings for anyone here
            raise


def join_cgroup(spec, cgroup_fds):
    """Move this process (and so every process it starts) into the sandbox's cgroups, through files
    pid 1 opened before leaving the host's filesystem; then a cgroup namespace of its own, so
    /proc/self/cgroup names no host cgroup."""
    for fd in cgroup_fds:
        os.write(fd, b"0")                       # "0": the writing process
        os.close(fd)
    if _libc.unshare(CLONE_NEWCGROUP) != 0 and spec["mode"] != "none":
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWCGROUP): {os.strerror(err)}")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter(program):
    """Load the syscall filter (a BPF program exported by libseccomp in the pool) for this process
    and everything it execs or forks; needs no_new_privs. SPEC_ALLOW, as container runtimes do:
    the kernel's default speculative-execution mitigations for filtered processes protect a process
    from code it runs itself, and all of this process is the untrusted tool."""
    if not program:
        return
    code = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(code))
    _syscall("seccomp", ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(SECCOMP_FILTER_FLAG_SPEC_ALLOW),
             ctypes.c_void_p(ctypes.addressof(prog)))


def close_fds(keep=()):
    """Close every descriptor but 0-2 and `keep`: nothing boot inherited (its own program's file
    above all, which a tool could reopen through /proc/self/fd for writing) reaches the tool."""
    try:
        open_fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:                                  # no /proc: every number up to the limit
        open_fds = range(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    for fd in open_fds:                              # listdir's own descriptor is closed already
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def exec_tool(spec, status_fd, cgroup_fds=None):
    """In the tool process: cgroup, limits, identity, environment, syscall filter, exec. Never returns.
    `cgroup_fds`: the sandbox cgroups' cgroup.procs, opened by pid 1 (None: opened here, mode none)."""
    try:
        os.close(status_fd)
        if cgroup_fds is None:
            cgroup_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in spec["cgroup_procs"]]
        join_cgroup(spec, cgroup_fds)
        limits = spec["limits"]
        for res, value in ((resource.RLIMIT_AS, limits["as_bytes"]), (resource.RLIMIT_NOFILE,
                                                                      limits["nofile"]),
                           (resource.RLIMIT_FSIZE, limits["fsize_bytes"]), (resource.RLIMIT_CORE, 0),
                           (resource.RLIMIT_MSGQUEUE, 0), (resource.RLIMIT_NPROC, limits["nproc"])):
            resource.setrlimit(res, (value, value))
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
        drop_privileges(spec)
        if spec["mode"] != "none":
            # its own session and process group: kill(0, ...) cannot reach boot (outside the pid
            # namespace, but in userns mode of the same host uid) and turn the call into a setup error
            os.setsid()
        os.chdir(spec["workdir"])
        os.umask(0o077)
        program = bytes.fromhex(spec["seccomp_bpf"])
        close_fds()                              # the tool holds exactly 0, 1 and 2
        install_filter(program)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as err:  # noqa: BLE001 - report anything, then die
        os.write(2, f"sandbox: cannot start the tool: {err}\n".encode())
    os._exit(126)


def _exit_event(status):
    if os.WIFSIGNALED(status):
        return {"event": "exit", "code": None, "signal": os.WTERMSIG(status)}
    return {"event": "exit", "code": os.WEXITSTATUS(status), "signal": None}


def _emit(fd, event):
    os.write(fd, (json.dumps(event) + "\n").encode())


def default_signals():
    """Every signal at its default disposition (Python installs handlers for SIGINT and ignores
    SIGPIPE and SIGXFSZ): the kernel drops any signal without a handler that another process of
    the namespace sends to its pid 1, SIGKILL and SIGSTOP included."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass


def open_egress(spec):
    """Loopback up in the sandbox's network namespace, a listener on 127.0.0.1:PROXY_PORT, handed
    to the pool's proxy over `egress_fd`; nothing else is reachable from inside."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0x1 | 0x8)                  # IFF_UP | IFF_LOOPBACK
        fcntl.ioctl(s.fileno(), 0x8914, ifreq)                            # SIOCSIFFLAGS
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", PROXY_PORT))
    listener.listen(64)
    with socket.socket(fileno=spec["egress_fd"]) as channel:
        socket.send_fds(channel, [b"L"], [listener.fileno()])
    listener.close()


def run_pid1(spec, status_fd):
    """pid 1 of the namespace: mounts, fork the tool, reap until it exits, report how it ended."""
    default_signals()
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)      # the tool cannot ptrace or read pid 1
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        if spec.get("egress_fd") is not None:
            open_egress(spec)
        cgroup_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in spec["cgroup_procs"]]
        setup_mounts(spec)
    except BaseException as err:  # noqa: BLE001
        _emit(status_fd, {"event": "setup_error", "error": f"{type(err).__name__}: {err}"})
        os._exit(125)
    _emit(status_fd, {"event": "ready", "mode": spec["mode"]})
    tool = os.fork()
    if tool == 0:
        exec_tool(spec, status_fd, cgroup_fds)
    for fd in cgroup_fds:
        os.close(fd)
    event = {"event": "exit", "code": None, "signal": None, "cpu_s": None}
    try:
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == tool:
                event = _exit_event(status)
                event["cpu_s"] = usage.ru_utime + usage.ru_stime      # measured here, not by the tool
                break
    except BaseException as err:  # noqa: BLE001 - whatever happened, the pool hears how it ended
        event["error"] = f"pid 1: {type(err).__name__}: {err}"
    try:
        _emit(status_fd, event)
    finally:
        os._exit(0)


def _map_user(uid, gid):
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _children(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def reap_orphans():
    """Kill and reap every remaining descendant (they are re-parented to us, the subreaper)."""
    me = os.getpid()
    while True:
        for kid in _children(me):
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return


_child = 0
_terminating = False


def _kill_child():
    if _child:
        try:
            os.kill(_child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _on_sigterm(signum, frame):
    global _terminating
    _terminating = True
    _kill_child()


def _fork_child():
    """fork; in the parent, a SIGTERM that came before `_child` was set still kills the child."""
    global _child
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return 0
    _child = pid
    if _terminating:
        _kill_child()
    return pid


def main():
    global _child
    with os.fdopen(int(sys.argv[1]), "rb") as f:        # over a pipe: never in /proc/*/cmdline
        spec = json.loads(f.read())
    status_fd = spec["status_fd"]
    # this program's own file (/dev/fd/N) and anything else inherited: not needed past this point
    close_fds({status_fd, spec.get("egress_fd")})
    mode = spec["mode"]
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:                 # the parent died before the line above
        return 1
    try:
        if mode == "none":
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            # not dumpable: a tool of the same uid (an unprivileged trainer) cannot open boot's
            # /proc/PID/fd (its status pipe) or memory; the tool's exec makes it dumpable again
            _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            _emit(status_fd, {"event": "ready", "mode": mode})
            if _fork_child() == 0:
                exec_tool(spec, status_fd)
            _, status, usage = os.wait4(_child, 0)
            _child = 0
            reap_orphans()
            _emit(status_fd, {**_exit_event(status), "cpu_s": usage.ru_utime + usage.ru_stime})
            return 0
        try:
            uid, gid = os.getuid(), os.getgid()
            _check(_libc.unshare(CLONE_NEWPID | (CLONE_NEWUSER if mode == "userns" else 0)), "unshare")
            if mode == "userns":
                _map_user(uid, gid)
        except BaseException as err:  # noqa: BLE001
            _emit(status_fd, {"event": "setup_error", "error": f"{type(err).__name__}: {err}"})
            return 125
        if _fork_child() == 0:
            run_pid1(spec, status_fd)
        if spec.get("egress_fd") is not None:
            os.close(spec["egress_fd"])        # pid 1 hands its listener to the pool through it
        _, status = os.waitpid(_child, 0)
        _child = 0
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    finally:
        shutil.rmtree(spec["stage_dir"], ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
