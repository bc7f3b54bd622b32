"""Ctrl-C and SIGTERM on a run's ranks: the run stops with the checkpoint it has, says so in one line,
and the same command resumes it exactly.

    rank 0        on the first SIGINT / SIGTERM: notes where every thread was in
                  <run.dir>/interrupted.log, marks run.json `interrupted` (signal, step, newest
                  checkpoint), prints one line (the last step, the newest checkpoint, the command that
                  resumes), tells the run's callbacks, tells the other ranks, waits until they are
                  gone, and exits
    other ranks   do not act on the signal themselves; told by rank 0 (a key on the control plane's
                  store), they append where their threads were to the same file and exit

Nothing else runs: the stop is a kill at that moment that knows it is one. The work since the newest
complete checkpoint is done again on resume, to the same numbers (a killed save has no COMPLETE
marker and is never used). Every rank ends what it started (tool sandboxes, checkpoint writers)
before it exits. Ranks exit 0 under torchrun's agent, so that the agent neither reports a failure
nor restarts them (`trainer.max_restarts`); `hybridrl train` exits 130 (SIGINT) or 143 (SIGTERM)
(`hybridrl/launcher.py`). Started without an agent, ranks exit 128 + the signal's number.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hybridrl.jobs import owns_run_dir

SIGNALS = (signal.SIGINT, signal.SIGTERM)
KEY, ACK = "interrupt", "interrupt_ack/"
LOG = "interrupted.log"
_POLL_S = 0.1
_WAIT_FOR_RANKS_S = 10.0


@dataclass
class _Rank:
    rank: int
    cfg: Any                                          # the run's config (None until loaded)
    pid: int
    signum: int | None = None
    control: Any = None                               # this rank's own control-plane client, once joined
    probe: Any = None                                 # another one, for the handler's own questions
    world_size: int = 1
    watchdog: Any = None
    describe: Callable[[], dict] | None = None        # the job's account of where it is (rank 0)
    listeners: list[Callable[[dict], None]] = field(default_factory=list)
    listening: Any = None                             # the thread of `_listen` (other ranks)
    stop_listening: threading.Event = field(default_factory=threading.Event)


_state: _Rank | None = None


def install(rank: int) -> None:
    """Every rank, first thing: SIGINT / SIGTERM are handled here from now on (`configure` says for
    which run, once its config is loaded)."""
    global _state
    _state = _Rank(rank, None, os.getpid())
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def configure(cfg: Any) -> None:
    if _state is not None:
        _state.cfg = cfg


def attach(ctx: Any, watchdog: Any) -> None:
    """Once the process group exists: rank 0 can tell the others, the others listen for it."""
    st = _state
    if st is None:
        return
    st.control, st.probe = ctx.control.clone(), ctx.control.clone()
    st.world_size, st.watchdog = ctx.world_size, watchdog
    if st.rank != 0:
        st.listening = threading.Thread(target=_listen, args=(st.control,), name="hybridrl-interrupt", daemon=True)
        st.listening.start()
        atexit.register(detach)


def detach() -> None:
    """Stop listening before the interpreter exits (run at exit): a thread left inside a store call
    while the process tears down its store client aborts the process ("terminate called without an
    active exception"), turning a finished rank's exit code 0 into -6."""
    st = _state
    if st is not None and st.listening is not None:
        st.stop_listening.set()
        st.listening.join(timeout=10)
        st.listening = None


def on_controller(describe: Callable[[], dict], listener: Callable[[dict], None]) -> None:
    """The job's controller: how to say where the run is, and who to tell (its callbacks)."""
    if _state is not None:
        _state.describe = describe
        _state.listeners.append(listener)


def exit_code(signum: int) -> int:
    """0 under torchrun's agent (it would report a failure, or restart the ranks), else 128 + signum."""
    return 0 if "TORCHELASTIC_RESTART_COUNT" in os.environ else 128 + signum


# ------------------------------------------------------------------ the handler


def _on_signal(signum: int, frame: Any) -> None:
    st = _state
    if st is None or os.getpid() != st.pid:      # a process forked by this rank (a checkpoint writer):
        signal.signal(signum, signal.SIG_DFL)    # it dies of the signal, quietly
        os.kill(os.getpid(), signum)
        return
    if st.signum is not None:
        return                                   # a second signal (the terminal's and the launcher's)
    if signum == signal.SIGTERM and _failing(st):   # torchrun's agent ending what a failure left: as before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    st.signum = signum
    if st.control is None or st.cfg is None:     # before the process group: nothing to coordinate
        _end_children()
        if st.rank == 0:
            print(f"hybridrl: interrupted by {signal.Signals(signum).name} while the ranks were starting; "
                  "nothing was run", file=sys.stderr, flush=True)
        _exit(exit_code(signum))
    if st.rank == 0:
        _stop_the_run(st, signum)
    # other ranks: rank 0 decides, and its word comes over the store (`_listen`)


def _failing(st: _Rank) -> bool:
    """Whether the run is failing already (an error reported, the run aborted, a rank on this host gone):
    a SIGTERM then is torchrun's agent stopping the ranks that are left (or restarting them), not the
    user. (The watchdog's failure is read without its lock: the handler may have interrupted its holder.)"""
    import socket

    import psutil

    if st.control is None:
        return False
    if st.watchdog is not None and st.watchdog.failure is not None:
        return True
    try:
        if st.probe.aborted() is not None:
            return True
        host = socket.gethostname()
        for rank in range(st.world_size):
            proc = st.probe.process(rank) if rank != st.rank else None
            if proc is not None and proc[0] == host:
                try:
                    if psutil.Process(proc[1]).status() == psutil.STATUS_ZOMBIE:
                        return True
                except psutil.NoSuchProcess:
                    return True
    except Exception:  # noqa: BLE001 - the store is gone: the job is ending
        return True
    return False


def _stop_the_run(st: _Rank, signum: int) -> None:
    from hybridrl.store import rundir

    name = signal.Signals(signum).name
    if owns_run_dir(st.cfg.run.job):            # a run that owns its run directory says where it stopped
        info = {**(st.describe() if st.describe is not None else _from_run_dir(st.cfg)),
                "signal": name, "exit_code": 128 + signum, "command": resume_command(st.cfg)}
        line = message(st.cfg, info)
        _note_stacks(st.cfg, f"rank 0: {line}")
        if (Path(st.cfg.run.dir) / rundir.RECORD).exists():
            rundir.mark_interrupted(st.cfg.run.dir, info["step"], signal=name, checkpoint=info.get("checkpoint"))
    else:
        info, line = {"signal": name, "exit_code": 128 + signum}, f"{st.cfg.run.job} interrupted by {name}"
    print(f"hybridrl: {line}", file=sys.stderr, flush=True)
    for listener in st.listeners:
        try:
            listener(info)
        except Exception:  # noqa: BLE001 - the stop goes on; the callback's error goes to the log file
            _append(st.cfg, f"a listener of the interrupt failed:\n{traceback.format_exc()}")
    if st.watchdog is not None:
        st.watchdog.stop()                       # workers leaving now is no failure to report
    try:
        st.control.store.set(KEY, name.encode())
        _wait_for_ranks(st)
    except Exception:  # noqa: BLE001 - the store or a rank is gone: nothing left to wait for
        pass
    _end_children()
    _exit(exit_code(signum))


def _listen(control: Any) -> None:
    """A worker rank's thread: exit when rank 0 says the run was interrupted."""
    st = _state
    try:
        while not control.store.check([KEY]):
            if st.stop_listening.wait(_POLL_S):
                return
        name = control.store.get(KEY).decode()
        if owns_run_dir(st.cfg.run.job):
            _note_stacks(st.cfg, f"rank {st.rank}: stopping, rank 0 was interrupted by {name}")
        _end_children()
        control.store.set(f"{ACK}{st.rank}", b"1")
    except Exception:  # noqa: BLE001 - the store is gone (rank 0 ended): the watchdog handles that
        return
    _exit(exit_code(getattr(signal, name)))


def _wait_for_ranks(st: _Rank) -> None:
    import psutil

    deadline = time.monotonic() + _WAIT_FOR_RANKS_S
    others = list(range(1, st.world_size))
    while others and time.monotonic() < deadline:
        others = [r for r in others if not st.control.store.check([f"{ACK}{r}"])]
        time.sleep(0.02)
    for r in range(1, st.world_size):            # ranks on this host: until their process is gone
        proc = st.control.process(r)
        if proc is None:
            continue
        try:
            psutil.Process(proc[1]).wait(timeout=max(0.1, deadline - time.monotonic()))
        except (psutil.Error, psutil.TimeoutExpired):
            continue


def _end_children() -> None:
    """SIGKILL every process this rank started (sandboxes, checkpoint writers), deepest first."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in reversed(children):
        try:
            child.kill()
        except psutil.Error:
            continue


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------ what it says


def resume_command(cfg: Any) -> str:
    """The command that launched this run, as `hybridrl train` (or `hybridrl sft`) takes it."""
    from hybridrl.store.rundir import origin

    recipe, overrides = origin()
    overrides = list(overrides)
    verb = "train"
    if cfg.run.job == "sft" and "run.job=sft" in overrides:
        overrides.remove("run.job=sft")
        verb = "sft"
    words = ["hybridrl", verb]
    if recipe:
        relative = os.path.relpath(recipe)
        words.append(relative if not relative.startswith("..") else recipe)
    nproc = os.environ.get("LOCAL_WORLD_SIZE")
    if nproc and int(nproc) != cfg.distributed.nproc_per_node and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        words += ["--nproc-per-node", nproc]
    return shlex.join(words + overrides)


def message(cfg: Any, info: dict) -> str:
    """The one line: how the run stopped, the newest checkpoint, and what the same command does."""
    job, sig, step, total = cfg.run.job, info["signal"], info["step"], info.get("total_steps")
    head = f"{job} interrupted by {sig} after step {step}" + (f" of {total}" if total else "")
    if job == "rl" and info.get("checkpoint"):
        return (f"{head}; the newest checkpoint is step {info['checkpoint_step']} ({info['checkpoint']}), "
                f"the same command resumes from it: {info['command']}")
    if job == "rl":
        every = cfg.trainer.checkpoint_every
        return (f"{head}, before its first checkpoint (trainer.checkpoint_every={every}); the same command starts "
                f"it over: {info['command']}")
    return f"{head}; it does not resume: the same command starts it over: {info['command']}"


def _from_run_dir(cfg: Any) -> dict:
    """Where a job is that gave no account of its own (SFT; an RL run before its loop started): its last
    logged step and, for RL, its newest complete checkpoint."""
    from hybridrl.store.checkpoints import CheckpointManager
    from hybridrl.telemetry.metrics import read_metrics

    rows = read_metrics(cfg.run.dir)
    newest = CheckpointManager(cfg.run.dir).latest() if cfg.run.job == "rl" else None
    return {"step": rows[-1]["step"] if rows else 0,
            "total_steps": cfg.sft.steps if cfg.run.job == "sft" else cfg.trainer.total_steps,
            "checkpoint": str(newest) if newest is not None else None,
            "checkpoint_step": int(newest.name.rsplit("_", 1)[1]) if newest is not None else None}


def _note_stacks(cfg: Any, header: str) -> None:
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    text = [f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}"]
    main = threading.main_thread().ident
    for ident, frame in sorted(frames.items(), key=lambda item: item[0] != main):   # the main thread first
        text.append(f"--- thread {names.get(ident, ident)}:")
        text.append("".join(traceback.format_stack(frame)).rstrip())
    _append(cfg, "\n".join(text))


def _append(cfg: Any, text: str) -> None:
    try:
        path = Path(cfg.run.dir) / LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (text.rstrip() + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass
