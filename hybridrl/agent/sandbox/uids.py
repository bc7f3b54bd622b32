"""Leases on sandbox uids, so that pools in different processes of one host (one per rank, or
two jobs) never share a uid: RLIMIT_NPROC is counted per uid, and the isolation=none sweep kills
every process of a uid. A lease is an exclusive `flock` on `<lock dir>/<uid>`; the kernel drops
it when the holder exits, however it exits."""

from __future__ import annotations

import fcntl
import os
import tempfile

LOCK_DIR = os.path.join(tempfile.gettempdir(), "hybridrl-sandbox-uids")
SPAN = 4096                      # how far above uid_base to look for free uids


class UidLease:
    def __init__(self, count: int, base: int, *, lock_dir: str = LOCK_DIR):
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        self.uids: list[int] = []
        self._fds: list[int] = []
        for uid in range(base, base + SPAN):
            if len(self.uids) == count:
                break
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uids.append(uid)
            self._fds.append(fd)
        if len(self.uids) < count:
            self.release()
            raise RuntimeError(f"no {count} free sandbox uids in [{base}, {base + SPAN}) (see {lock_dir})")

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self.uids = [], []
