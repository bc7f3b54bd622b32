"""The tool's syscall filter, compiled by libseccomp in the trusted pool and installed by the tool
process itself right before it execs the runner (after no_new_privs, the dropped capabilities and
its own uid; `boot.py` loads the exported BPF program with seccomp(2), SPEC_ALLOW).

The filter allows by default and refuses what a tool never needs and what would undo the other
defences:

- new namespaces: `unshare` and `clone` with any CLONE_NEW* flag, `setns`; `clone3` answers ENOSYS
  (its flags sit in memory a filter cannot read; the C library then falls back to `clone`). A user
  namespace of its own would give the tool every capability over a private tmpfs or SysV IPC
  namespace whose memory no limit of ours counts;
- mounts (`mount`, `umount2`, `pivot_root`, the new mount API, `chroot`), `keyctl` / `add_key` /
  `request_key` (the kernel's keyrings outlive the call), `userfaultfd`, `io_uring_*`, `bpf`,
  `perf_event_open`, `ptrace`, `process_vm_*`, module, reboot and swap calls;
- `prlimit64` on any process but the caller (pid 1 of a user-namespace sandbox shares the tool's
  uid: lowering its limits would kill it and turn the call into an infrastructure error);
- sockets of any family but AF_UNIX (AF_INET and AF_INET6 too when the egress proxy is on:
  `tools.network=allowlist`); AF_VSOCK is not network-namespaced. With isolation=none (no network
  namespace, the host's filesystem) not even AF_UNIX `socket()`: a tool could otherwise connect to
  the host's Unix sockets, abstract ones included (a filter cannot read the address). `socketpair`
  stays, so pipes between a tool's own processes (asyncio, multiprocessing) still work;
- `memfd_create` where the sandbox has no memory cgroup (its pages are not address space).

Syscalls of another ABI (x32, or 32-bit calls on x86_64) kill the process: libseccomp's
bad-architecture action. Only machines listed in `ARCHES` are filtered; on any other the pool
refuses to start (the filter's argument positions are checked for those only).

The binding: `seccomp` (libseccomp's own, e.g. Debian's python3-seccomp, built for the system
Python) when this interpreter can import it, else `pyseccomp` (PyPI, a ctypes binding with the
same API over the system's libseccomp.so.2), which is what `pip install hybridrl[sandbox]`
brings: either way libseccomp compiles the program.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import tempfile

# machine -> the clone flags' argument index (0 on these; s390 passes flags second)
ARCHES = {"x86_64": 0, "aarch64": 0}

CLONE_NEW = {"CLONE_NEWTIME": 0x00000080, "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000,
             "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
             "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10

DENIED = ("setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
          "fsmount", "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "userfaultfd",
          "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "ptrace",
          "process_vm_readv", "process_vm_writev", "kexec_load", "kexec_file_load", "init_module",
          "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog",
          "open_by_handle_at", "lookup_dcookie", "fanotify_init", "personality")
NOT_IMPLEMENTED = ("clone3",)         # ENOSYS: the C library falls back to clone, which is filtered


class FilterUnavailable(RuntimeError):
    """No syscall filter can be built here: the reason names the fix."""


def _binding():
    try:
        import seccomp                  # libseccomp's own binding (system package)
        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp
        return pyseccomp
    except ImportError as err:
        raise FilterUnavailable("the tool sandbox's syscall filter needs libseccomp's Python binding: pip install "
                                "'hybridrl[sandbox]' (pyseccomp), or the system package python3-seccomp") from err
    except OSError as err:              # the binding is there, libseccomp.so.2 is not
        raise FilterUnavailable(f"libseccomp is missing ({err}): install libseccomp2 (Debian/Ubuntu) or "
                                "libseccomp (Fedora)") from err


def machine() -> str:
    return os.uname().machine


@functools.lru_cache(maxsize=8)
def compile_filter(*, inet: bool, memfd: bool, unix: bool = True) -> bytes:
    """The BPF program (struct sock_filter[]) for this machine: `inet` allows AF_INET/AF_INET6
    sockets (the egress proxy), `memfd` allows memfd_create (a memory cgroup counts it), `unix`
    allows socket(AF_UNIX) (False for isolation=none: the host's Unix sockets are reachable there)."""
    arch = machine()
    if arch not in ARCHES:
        raise FilterUnavailable(f"the tool sandbox's syscall filter is written for {sorted(ARCHES)}, not {arch}: "
                                "on this machine tools cannot be confined")
    sc = _binding()
    flags_arg = ARCHES[arch]
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED + (() if memfd else ("memfd_create",)):
        _rule(f, deny, name)
    for name in NOT_IMPLEMENTED:
        _rule(f, sc.ERRNO(errno.ENOSYS), name)
    for bit in CLONE_NEW.values():
        f.add_rule(deny, "unshare", sc.Arg(0, sc.MASKED_EQ, bit, bit))
        f.add_rule(deny, "clone", sc.Arg(flags_arg, sc.MASKED_EQ, bit, bit))
    f.add_rule(deny, "prlimit64", sc.Arg(0, sc.NE, 0))
    # families compared as 64-bit values: high bits set (which the kernel would drop) are refused too
    allowed = (AF_UNIX, AF_INET, AF_INET6) if inet else (AF_UNIX,)
    refuse = sc.ERRNO(errno.EAFNOSUPPORT)
    for name in ("socket", "socketpair"):
        f.add_rule(refuse, name, sc.Arg(0, sc.GT, max(allowed)))
        for family in range(max(allowed)):
            if family not in allowed:
                f.add_rule(refuse, name, sc.Arg(0, sc.EQ, family))
    if not unix:
        f.add_rule(refuse, "socket", sc.Arg(0, sc.EQ, AF_UNIX))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise FilterUnavailable(f"libseccomp exported a malformed program ({len(program)} bytes)")
    return program


def _rule(f, action, name: str) -> None:
    try:
        f.add_rule(action, name)
    except (ValueError, RuntimeError, OSError):
        pass                            # a syscall this machine's libseccomp does not know: none to filter


def describe(program: bytes) -> dict:
    """What the audit log records of a filter: its size and hash (the same program, the same hash)."""
    return {"instructions": len(program) // 8, "sha256": hashlib.sha256(program).hexdigest(), "machine": machine()}
