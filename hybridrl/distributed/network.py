"""Which network interface a job's traffic uses (`distributed.socket_ifname`).

On a cluster a host often has several interfaces (management Ethernet, a fast fabric, a
container bridge) and the one its hostname resolves to is not always the one the job should use.
With `distributed.socket_ifname=IF` every rank binds gloo to IF (GLOO_SOCKET_IFNAME), NCCL's
bootstrap too (NCCL_SOCKET_IFNAME, unless already set: a site's NCCL settings win), and the SLURM
script gives torchrun's rendezvous and store the first node's address on IF, so the control
plane's traffic travels on IF as well.

    python -m hybridrl.distributed.network address [IF]    # this host's IPv4 address (on IF)
"""

from __future__ import annotations

import os
import socket
import sys

import psutil


class InterfaceError(RuntimeError):
    pass


def interface_address(ifname: str) -> str:
    """The IPv4 address of interface `ifname` on this host."""
    interfaces = psutil.net_if_addrs()
    if ifname not in interfaces:
        raise InterfaceError(f"distributed.socket_ifname={ifname}: no such interface on {socket.gethostname()} "
                             f"(it has: {', '.join(sorted(interfaces))})")
    for addr in interfaces[ifname]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise InterfaceError(f"distributed.socket_ifname={ifname}: the interface has no IPv4 address "
                         f"on {socket.gethostname()}")


def host_address() -> str:
    """This host's address without a chosen interface: what its hostname resolves to (as
    `hostname --ip-address`; a loopback address on a one-node setup, which is why clusters whose
    hostnames resolve to 127.0.1.1 need distributed.socket_ifname), else the first non-loopback
    IPv4 address."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        pass
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return "127.0.0.1"


def bind_interface(ifname: str) -> None:
    """Bind gloo (and NCCL's bootstrap, unless set) to `ifname`; checked here, before any group."""
    if not ifname:
        return
    interface_address(ifname)          # raises with the interfaces this host has
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "address" or len(argv) > 2:
        print("usage: python -m hybridrl.distributed.network address [IFNAME]", file=sys.stderr)
        return 2
    try:
        print(interface_address(argv[1]) if len(argv) == 2 and argv[1] else host_address())
    except InterfaceError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
