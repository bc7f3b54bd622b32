"""Who owns a step's intent (`hybridrl/envs/service.py`): an owner is "host:pid:start:nonce"; another
process's owner is alive while that process is (pid and start time name one process); an owner in
this process is one `EnvService` object, alive only while it executes the step or holds its
executed outcome (`local_owner`)."""

from __future__ import annotations

import os
import socket
import weakref
from typing import Any

from hybridrl.distributed.reaper import start_time  # noqa: F401  (also this module's API)

# the live services of this process, by owner: an intent owned by one of them is in progress only
# while that object executes it (pid and start time cannot tell two services of one process apart)
SERVICES: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def owner_alive(owner: str) -> bool:
    host, pid, start, _ = owner.split(":", 3)
    if host != socket.gethostname():
        return True                                   # cannot tell; SQLite WAL is one host anyway
    if int(pid) == os.getpid() and start == (start_time(os.getpid()) or "?"):
        return False                                  # this process: see local_owner
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_time(int(pid))
    return now != "dead" and (now is None or start == "?" or now == start)


def local_owner(me: Any, owner: str, episode_id: str, key: str, *, take: bool):
    """`me` (an EnvService) asks about an intent's owner. For an intent owned by a service object of this process: "busy" (it is in a call now),
    its executed outcome (taken over when `take`; "unwritten" otherwise), or "dead" (it is gone,
    or holds nothing for this key: the intent is in doubt). None for another process's owner."""
    host, pid, start, _ = owner.split(":", 3)
    if host != socket.gethostname() or int(pid) != os.getpid():
        return None
    if owner == me.owner:
        return "dead"                      # its own, and not in its _unwritten: lost track of it
    other = SERVICES.get(owner)
    if other is None:
        return "dead"
    if not other._lock.acquire(blocking=False):
        return "busy"
    try:
        outcome = other._unwritten.get((episode_id, key))
        if outcome is None:
            return "dead"
        if not take:
            return "unwritten"
        return other._unwritten.pop((episode_id, key))
    finally:
        other._lock.release()


def local_return(owner: str, episode_id: str, key: str, outcome: Any) -> None:
    """Give back an outcome `local_owner` took (it did not belong to the asking step)."""
    other = SERVICES.get(owner)
    if other is not None:
        other._unwritten.setdefault((episode_id, key), outcome)
