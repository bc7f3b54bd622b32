"""The console while an RL run goes, when it is not a terminal: a line per ~10% of the steps with
reward, loss, validation accuracy, seconds per step and the time left."""

from __future__ import annotations

import io
import logging

from hybridrl.controller.progress import Progress, duration


def test_lines_every_tenth_of_the_run_with_what_a_user_watches(caplog):
    out = io.StringIO()
    p = Progress(20, stream=out, terminal=False)
    p.on_start({"step": 0})
    with caplog.at_level(logging.INFO, logger="hybridrl"):
        for step in range(1, 21):
            p.on_step(step, {"reward/mean": step / 20, "loss": 0.01, "time/step_s": 1.0, "train/updated": float(step != 3),
                             "episodes": 128.0, "filter/all_equal_group": 120.0 if step == 3 else 0.0,
                             "filter/truncated": 8.0 if step == 3 else 0.0,
                             **({"val/accuracy": 0.5} if step % 5 == 0 else {})})
    lines = out.getvalue().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [f"step {s}/20 ({5 * s}%)" for s in range(2, 21, 2)]
    assert lines[4].startswith("rl: step 10/20 (50%): reward 0.500, loss 0.0100, val accuracy 50.0%, ")
    assert "s/step, ETA " in lines[0] and "ETA" not in lines[-1]
    assert "step 3: no update (none of 128 episodes admitted: all_equal_group 120, truncated 8)" in caplog.text


def test_a_resumed_run_counts_from_its_checkpoint_and_a_terminal_gets_a_bar():
    out = io.StringIO()
    p = Progress(10, stream=out, terminal=False)
    p.on_start({"step": 6})
    p.on_step(7, {"reward/mean": 0.1})
    assert out.getvalue().startswith("rl: step 7/10 (70%): reward 0.100")
    bar = Progress(10, stream=io.StringIO(), terminal=True)
    bar.on_start({"step": 0})
    bar.on_step(1, {"reward/mean": 0.1, "loss": 0.2, "time/step_s": 1.0})
    assert bar.bar is not None and bar.bar.n == 1
    bar.on_end({})
    assert bar.bar is None
    assert [duration(s) for s in (5, 65, 3700)] == ["5s", "1m05s", "1h01m"]
