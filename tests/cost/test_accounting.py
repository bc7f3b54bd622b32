"""The books on hand-made run records: every second of the clock lands in one stage, split as the
stage's own timers say; resumed attempts, disaggregated roles, prices and their errors."""

from __future__ import annotations

import json

import pytest

from hybridrl.cost.accounting import account
from hybridrl.cost.prices import PriceError, load_prices, money

T0 = 1_000_000.0


def write_run(tmp_path, rows, marks, *, placement=None, world=2):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "clock.jsonl").write_text("".join(json.dumps(m) + "\n" for m in marks))
    cfg = {"distributed": {"nproc_per_node": world, "device": "cpu"}, "trainer": {}, "algo": {}}
    if placement:
        cfg["placement"] = placement
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def step_row(step, at, **extra):
    row = {"step": step, "time/step_s": 2.0, "time/T_sync": 0.4, "time/T_rollout": 1.0, "time/T_prep": 0.1,
           "time/T_train": 0.5, "time/T_store": 0.05, "time/T_reward": 0.02, "engine/step_time_s": 1.2,
           "time/T_update": 0.4, "time/T_ref": 0.0, "time/T_old": 0.0, "time/T_adv": 0.05, "switch/sleep_s": 0.1,
           "switch/reload_s": 0.05, "switch/publish_s": 0.1, "switch/wake_s": 0.1, "tokens/admitted": 100.0,
           "tokens/generated": 120.0, "episodes": 8, "episodes/admitted": 6, "time/logged_at": at}
    row.update(extra)
    return row


def mark(name, at, step=None, attempt=1, **extra):
    return {"mark": name, "step": step, "at": at, "attempt": attempt, **extra}


def test_every_second_of_the_clock_is_assigned_and_split_by_the_stage_timers(tmp_path):
    marks = [mark("start", T0 + 10, 0, launched_at=T0, rank_started_at=T0 + 2, world_size=2),
             mark("step", T0 + 12, 1), mark("step", T0 + 15, 2), mark("checkpoint", T0 + 17.5, 2),
             mark("checkpoint_end", T0 + 18.5, 2), mark("finish", T0 + 18.6, 2), mark("end", T0 + 19, 2),
             mark("exit", T0 + 19.1), mark("released", T0 + 20)]
    rows = [{"step": 0, "val/seconds": 1.5}, step_row(1, T0 + 14.5, **{"val/seconds": 0.4}), step_row(2, T0 + 17.4)]
    books = account(write_run(tmp_path, rows, marks))
    assert books.wall_s == pytest.approx(20.0)
    assert books.total_device_s == pytest.approx(40.0)              # wall x ranks, nothing left over
    s = books.stage_totals()
    assert s["startup/launch"] == pytest.approx(2 * 2) and s["startup/ranks"] == pytest.approx(8 * 2)
    assert s["eval"] == pytest.approx((1.5 + 0.4) * 2)
    assert s["checkpoint"] == pytest.approx(1.0 * 2)
    assert s["export"] == pytest.approx(0.4 * 2) and s["shutdown"] == pytest.approx(1.0 * 2)
    # rollout: the engines' busy time (engine/step_time_s is summed over ranks) and the verifiers' (T_reward is
    # per rank), the rest of the ranks' rollout the engines waiting
    assert s.get("rollout/prefill", 0.0) + s["rollout/decode"] == pytest.approx(2 * 1.2)
    assert s["rollout/reward"] == pytest.approx(2 * 0.02 * 2)
    assert s["idle/rollout_wait"] == pytest.approx(2 * (2 * 1.0 - 1.2 - 0.04))
    # train: the workers' timers, the rest is dispatch; sync: the switch phases, the rest other
    assert s["train/update"] == pytest.approx(2 * 0.4 * 2) and s["train/dispatch"] == pytest.approx(2 * 0.05 * 2)
    assert s["sync/publish"] == pytest.approx(2 * 0.1 * 2) and s["sync/other"] == pytest.approx(2 * 0.05 * 2)
    # the controller's own work keeps rank 0 busy and the other rank idle
    assert s["prep"] == pytest.approx(0.2) and s["store"] == pytest.approx(0.1)
    assert s["idle/controller"] > s["prep"]
    assert all(v >= 0 for v in s.values())
    assert books.steps == 2 and books.tokens["admitted"] == 200.0


def test_a_killed_attempt_counts_its_redone_steps_as_lost(tmp_path):
    marks = [mark("start", T0 + 5, 0, launched_at=T0, rank_started_at=T0 + 1, world_size=2),
             mark("step", T0 + 6, 1), mark("step", T0 + 9, 2), mark("checkpoint", T0 + 11.5, 2),
             mark("checkpoint_end", T0 + 12, 2), mark("step", T0 + 12.1, 3),            # killed during step 3
             mark("start", T0 + 30, 2, attempt=2, launched_at=T0 + 20, rank_started_at=T0 + 21, world_size=2),
             mark("step", T0 + 30, 3, attempt=2), mark("finish", T0 + 33, 3, attempt=2),
             mark("end", T0 + 33.5, 3, attempt=2)]
    rows = [{"step": 0}, step_row(1, T0 + 8.6), step_row(2, T0 + 11.4), step_row(3, T0 + 32.5)]
    books = account(write_run(tmp_path, rows, marks))
    assert [a["finished"] for a in books.attempts] == [False, True]
    assert books.wall_s == pytest.approx(12.1 + 13.5)         # each attempt: launch .. its last mark
    assert books.total_device_s == pytest.approx(2 * books.wall_s)
    assert books.stage_totals().get("lost/redone", 0.0) == 0.0   # step 3's mark was the killed attempt's last
    assert any("stopped after its last mark" in n for n in books.notes)
    # the step the next attempt resumed after is not lost; a step beyond it that had a span would be
    marks.insert(6, mark("step", T0 + 14, 4))
    books = account(write_run(tmp_path, rows, marks))
    assert books.stage_totals()["lost/redone"] == pytest.approx(2 * 1.9)


def test_disaggregated_books_split_the_rollout_ranks_by_their_own_counters(tmp_path):
    marks = [mark("start", T0 + 4, 0, launched_at=T0, rank_started_at=T0 + 1, world_size=3),
             mark("step", T0 + 4, 1), mark("step", T0 + 7, 2), mark("finish", T0 + 10, 2), mark("end", T0 + 10.5, 2)]
    rows = [{"step": 0}, step_row(1, T0 + 6.5, **{"stream/rollout_idle_s": 1.0, "engine/step_time_s": 3.0}),
            step_row(2, T0 + 9.5, **{"stream/rollout_idle_s": 0.5, "engine/step_time_s": 3.5})]
    books = account(write_run(tmp_path, rows, marks, placement={"mode": "disaggregated", "rollout_ranks": 2}, world=3))
    assert books.roles == {"train": 1, "rollout": 2}
    assert books.total_device_s == pytest.approx(3 * 10.5)
    r = books.device_s["rollout"]
    assert r["idle/rollout_ranks"] == pytest.approx(1.5)
    assert r["rollout/prefill"] + r["rollout/decode"] == pytest.approx(6.5)
    t = books.device_s["train"]
    assert t["idle/waiting_for_rollout"] == pytest.approx(2 * 1.0)      # the trainer's rollout is its wait


def test_money_follows_time_and_a_bad_price_table_names_its_key(tmp_path):
    marks = [mark("start", T0 + 1, 0, launched_at=T0, rank_started_at=T0, world_size=2), mark("end", T0 + 3600)]
    books = account(write_run(tmp_path, [{"step": 0}], marks))
    prices = load_prices()
    m = money(books, prices, "cpu")
    assert m["device"] == pytest.approx(2 * prices.device_hour["cpu"])           # 2 ranks x 1 hour
    bad = tmp_path / "prices.yaml"
    bad.write_text("device_hour: {cpu: cheap}\n")
    with pytest.raises(PriceError, match="must be a number"):
        load_prices(bad)
    bad.write_text("device_hour: {cpu: 1}\ngpu_hour: 2\n")
    with pytest.raises(PriceError, match="unknown key 'gpu_hour'"):
        load_prices(bad)
    with pytest.raises(PriceError, match="no device_hour.tpu"):
        money(books, prices, "tpu")


def test_malformed_tool_calls_are_named_and_cost_nothing_and_a_cpu_run_reads_in_device_hours(tmp_path):
    """A call that named no tool (recorded as "?") is counted as a malformed tool call, priced at nothing (it
    ran nothing); a CPU run's fractions of a cent are not printed as figures: its device-hours come first."""
    from hybridrl.cost.records import MALFORMED, tool_name
    from hybridrl.cost.report import format_run, run_report

    assert tool_name({"name": "?", "ok": False}) == tool_name({}) == MALFORMED
    assert tool_name({"name": "search"}) == "search"
    marks = [mark("start", T0 + 1, 0, launched_at=T0, rank_started_at=T0, world_size=2), mark("end", T0 + 30)]
    books = account(write_run(tmp_path, [{"step": 0}], marks))
    books.environment["tool_calls"] = {"search": 3, MALFORMED: 2}
    table = tmp_path / "prices.yaml"
    table.write_text("device_hour: {cpu: 0.05}\ntool_call: {default: 1.0}\n")
    assert money(books, load_prices(table), "cpu")["tool_calls"] == pytest.approx(3 * 1.0)
    text = format_run(run_report(books, load_prices()))
    assert "malformed tool calls 2 (their text named no tool: nothing ran)" in text and "?" not in text
    totals = next(line for line in text.splitlines() if "device-hours" in line and "per million" in line)
    assert totals.strip().startswith(f"device-hours {2 * 30 / 3600:.3g}")
    assert "e-0" not in text and "<0.01 USD" in text                # no micro-dollar figures
    assert "money" not in text.split("stage", 1)[1].splitlines()[0]  # no money column of fractions of a cent


def test_a_process_start_is_read_to_the_clock_tick():
    """The books start at the command's process start. Linux states the boot time in whole seconds, so a
    start computed from it (psutil's create_time) can be up to a second early; process_start reads both
    ends from one clock."""
    import subprocess
    import sys
    import time

    from hybridrl.cost.clock import process_start

    for _ in range(3):
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
        after = time.time()
        try:
            started = process_start(child.pid)
        finally:
            child.kill()
            child.wait()
        assert before - 0.02 <= started <= after + 0.02, (started - before, after - before)
