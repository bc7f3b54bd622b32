"""The kill switch: a file (`tools.kill_switch`, `<run.dir>/kill-switch` in a run) whose appearance
stops a running job's tool calls and new episodes within a second, without the policy or the
agent loop having any say, and then stops the run cleanly at the end of the step, resumable.

    hybridrl agent kill-switch RUN_DIR [--reason TEXT]     trip it (writes the file, audited)
    hybridrl agent kill-switch RUN_DIR --clear             clear it (before resuming the run)
    hybridrl agent kill-switch RUN_DIR --status

Who acts on it:

- every rank's `ToolBox` runs a `Watcher` thread (polling every `POLL_S`): when the file appears it
  SIGKILLs every sandbox of its pool (the calls in flight return an infrastructure error, which
  keeps their episodes out of training), refuses every later tool call, and the agent loop starts
  no new episode (they end ABORTED, "kill switch"). The thread needs neither the event loop nor
  the policy: it acts while a step's rollout is running, and between steps.
- the controller calls `stop_requested` once per step, after the rollout: when tripped it trains
  nothing on that step's episodes, closes the workers and returns; the run directory keeps its
  last complete checkpoint and is not marked finished, so after `--clear` the same command with
  `trainer.resume=auto` continues from that checkpoint.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hybridrl.telemetry import audit

log = logging.getLogger(__name__)

FILE_NAME = "kill-switch"
POLL_S = 0.1


def switch_path(run_dir: str | os.PathLike) -> tuple[Path, str | None]:
    """(the kill-switch file, the audit log) of a run directory: what its config.json says
    (tools.kill_switch, tools.audit_log), else the defaults inside it."""
    run_dir = Path(run_dir)
    path, log_path = run_dir / FILE_NAME, str(run_dir / "audit.jsonl")
    try:
        tools = json.loads((run_dir / "config.json").read_text()).get("tools", {})
    except (OSError, ValueError):
        return path, log_path
    configured = audit.configured_path(tools.get("kill_switch"))
    return (Path(configured) if configured else path), audit.configured_path(tools.get("audit_log", log_path))


def trip(path: str | os.PathLike, reason: str, *, audit_log: str | None = None) -> dict[str, Any]:
    """Set the switch: the file appears at once, whole (written aside, then renamed)."""
    path = Path(path)
    record = {"reason": reason, "time": time.time(), "by": _who()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    if audit_log:
        audit.AuditLog(audit_log).append("kill_switch_set", reason=reason, by=record["by"], file=str(path))
    return record


def clear(path: str | os.PathLike, *, audit_log: str | None = None) -> bool:
    path = Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    if audit_log:
        audit.AuditLog(audit_log).append("kill_switch_cleared", by=_who(), file=str(path))
    return True


def read(path: str | os.PathLike) -> dict[str, Any] | None:
    """The switch's record when it is set (a file without a readable record still counts)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        return {"reason": f"kill-switch file present (unreadable: {err.strerror})"}
    try:
        return json.loads(text)
    except ValueError:
        return {"reason": text.strip()[:200] or "kill-switch file present"}


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


class Watcher(threading.Thread):
    """Calls `on_trip(reason)` once, from this thread, within POLL_S of the file appearing."""

    def __init__(self, path: str | os.PathLike, on_trip: Callable[[str], None], *, poll_s: float = POLL_S):
        super().__init__(name="hybridrl-kill-switch", daemon=True)
        self.path, self.on_trip, self.poll_s = str(path), on_trip, poll_s
        self.tripped: str | None = None
        self._halt = threading.Event()

    def check(self) -> str | None:
        """Trip now if the file is there (also called directly, e.g. before a call)."""
        if self.tripped is None and os.path.exists(self.path):
            record = read(self.path) or {}
            self.tripped = str(record.get("reason") or "kill switch")
            try:
                self.on_trip(self.tripped)
            except Exception:  # noqa: BLE001 - the switch must not die with a callback
                log.exception("kill switch callback failed")
        return self.tripped

    def run(self) -> None:
        while not self._halt.is_set() and self.check() is None:
            self._halt.wait(self.poll_s)

    def stop(self) -> None:
        self._halt.set()


def stop_requested(cfg, run, step: int, close_workers) -> bool:
    """The controller's check, once per step after the rollout: True when the switch is set (the
    workers are closed with `close_workers()`, the step is not trained on; the loop returns without
    finishing the run)."""
    path = audit.configured_path(cfg.tools.kill_switch)
    record = read(path) if path else None
    if record is None:
        return False
    reason = record.get("reason", "kill switch")
    latest = run.checkpoints.latest()
    note = (f"rl: stopped by the kill switch at step {step} ({reason}); step {step} was not trained on. "
            f"Resume from {'checkpoint ' + str(latest) if latest else 'the start'}: hybridrl agent kill-switch "
            f"{cfg.run.dir} --clear, then run again with trainer.resume=auto")
    log.warning("%s", note)
    log_path = audit.configured_path(cfg.tools.audit_log)
    if log_path:
        audit.AuditLog(log_path).append("run_stopped", step=step, reason=reason,
                                        checkpoint=str(latest) if latest else None)
    close_workers()
    run.logger.close()
    print(note, flush=True)
    return True
