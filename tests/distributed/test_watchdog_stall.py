"""The controller's watchdog under a stalled store: a peer is named silent only on the evidence
of the watchdog's own rounds (hybridrl/distributed/watchdog.py). Real TCPStore, one process: the
watchdog's requests are held for a while (as when the store's queue is full behind a burst of
other ranks' traffic), during which the peer's heartbeats do not land either."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from hybridrl.distributed.config import DistributedConfig
from hybridrl.distributed.control import ControlPlane
from hybridrl.distributed.watchdog import Watchdog


class StallingStore:
    """A store client whose requests wait while `stalled` is set."""

    def __init__(self, store, stalled: threading.Event):
        self._store, self._stalled = store, stalled

    def clone(self) -> "StallingStore":
        return StallingStore(self._store.clone(), self._stalled)

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name in ("set_timeout", "clone") or not callable(attr):
            return attr

        def held(*args, **kwargs):
            while self._stalled.is_set():
                time.sleep(0.01)
            return attr(*args, **kwargs)

        return held


def test_a_stalled_watchdog_names_no_live_peer_and_still_finds_a_dead_one():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    stalled = threading.Event()
    controller = ControlPlane(StallingStore(dist.PrefixStore("hybridrl/", client), stalled), 0, 2)
    peer = ControlPlane.connect(client, 1, 2)
    cfg = DistributedConfig(device="cpu", heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, error_grace_s=1.0)
    controller.register_process(os.uname().nodename, os.getpid())
    peer.register_process("another-node", os.getpid())      # another host: seen through heartbeats only
    beating, stop = threading.Lock(), threading.Event()    # held: the peer sends no heartbeat

    def beat():
        count = 0
        while not stop.is_set():
            with beating:
                count += 1
                peer.beat(count, 0)
            time.sleep(0.05)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    watchdog = Watchdog(controller, cfg)
    watchdog.start()
    try:
        time.sleep(1.0)
        assert watchdog.poll_failure() is None
        beating.acquire()                                 # the peer's beats stall; the watchdog reads
        time.sleep(0.3)                                   # its last one, then its own reads stall too
        stalled.set()
        time.sleep(3.0)                                   # three heartbeat timeouts
        stalled.clear()                                   # the watchdog's reads come back first...
        time.sleep(0.15)
        beating.release()                                 # ...the peer's next beat a moment later
        time.sleep(1.5)
        assert watchdog.poll_failure() is None, watchdog.poll_failure()
        beating.acquire()                                 # the peer stops for good
        failure = watchdog.wait_failure(10.0)
        assert failure is not None and failure.rank == 1 and failure.kind == "silent", failure
        assert "another-node" in failure.message and "sent no heartbeat" in failure.message
    finally:
        stop.set()
        if beating.locked():
            beating.release()
        watchdog.stop()
        beater.join(2)
