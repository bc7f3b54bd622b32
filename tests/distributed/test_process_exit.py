"""A rank leaves without the interpreter's teardown, and with the status, output and exit handlers it
would have had."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.launch import ROOT, env_with_repo

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time
    from hybridrl.distributed.process_exit import run_then_leave

    def main():
        kind = sys.argv[1]
        atexit.register(lambda: open(sys.argv[2], "a").write("handler ran\\n"))
        done = threading.Thread(target=lambda: (time.sleep(0.2), open(sys.argv[2], "a").write("thread ended\\n")))
        done.start()                                       # not a daemon: joined before the handlers
        sys.stdout.write("unflushed output")               # no newline, no flush: flushed on the way out
        if kind == "ok":
            return 0
        if kind == "code":
            return 3
        if kind == "exit":
            sys.exit(4)
        if kind == "text":
            sys.exit("stopped: a reason")
        raise RuntimeError("boom")

    run_then_leave(main)
""")


@pytest.mark.parametrize("kind, status", [("ok", 0), ("code", 3), ("exit", 4), ("text", 1), ("raise", 1)])
def test_status_output_threads_and_handlers_are_kept(tmp_path, kind, status):
    marks = tmp_path / "marks"
    proc = subprocess.run([sys.executable, "-c", PROGRAM, kind, str(marks)], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "unflushed output"
    assert marks.read_text().splitlines() == ["thread ended", "handler ran"]
    if kind == "text":
        assert "stopped: a reason" in proc.stderr
    if kind == "raise":
        assert "RuntimeError: boom" in proc.stderr


def test_the_interpreter_teardown_is_what_is_skipped(tmp_path):
    """A module global's finalizer runs in the interpreter's teardown: under run_then_leave it does not (the
    process ends right after the last exit handler), under a plain sys.exit it does."""
    program = textwrap.dedent("""
        import sys
        from hybridrl.distributed.process_exit import run_then_leave

        class Torn:
            def __del__(self, path=sys.argv[2], open=open):      # what teardown may have cleared, bound here
                with open(path, "a") as f:
                    f.write("torn down\\n")

        KEPT = Torn()
        if sys.argv[1] == "leave":
            run_then_leave(lambda: 0)
        sys.exit(0)
    """)
    for how, expected in (("leave", ""), ("plain", "torn down\n")):
        marks = tmp_path / how
        marks.touch()
        proc = subprocess.run([sys.executable, "-c", program, how, str(marks)], cwd=ROOT, env=env_with_repo(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert marks.read_text() == expected, how
