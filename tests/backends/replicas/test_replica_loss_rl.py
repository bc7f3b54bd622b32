"""An RL job whose rollouts run on two replica processes (`rollout.engine=replicas`), one of which is
SIGKILLed mid-step (mid-request: the survivor goes on from the tokens it streamed back): the job (one
training rank) never restarts, finishes every step with every episode, trains no trajectory twice, leases no
environment twice, and a replacement started after the loss joins at the next publication and serves it. The task is stateful (guess_number, through the run's environment service); the
tiny random model never answers in its format, so its episodes take no environment step: the service's record
shows each episode leased (reset) and closed once, not actions."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.backends.replicas.replica_procs import start_replica
from tests.controller.test_rl_e2e import RECIPE
from tests.launch import ROOT, env_with_repo

STEPS = 4
EPISODES = 4 * 4                 # rl_tiny: prompts_per_step x group_size
KILL_AT = 12                     # the doomed replica's 12th generation request: inside the run's first steps
KILL_AFTER = 3                   # once a request (that one or a later one) streamed 3 tokens back


MODES = {"sync": [],
         # 6 groups in flight for a quorum of 4: a step's rollout ends with groups still running (interrupted,
         # continued at the next step on the new version), 4 groups trained a step, the others queued
         "partial": ["trainer.rollout_mode=partial", "trainer.oversample=1.5", "trainer.max_groups_per_step=4"]}


@pytest.fixture(scope="module", params=list(MODES))
def run(request, tmp_path_factory, tiny_models):
    """`partial`: partial collection (groups in flight across steps) over the same replicas."""
    rl_model = tiny_models("qwen2", init_std=0.05)          # the controller tests' RL model
    base = tmp_path_factory.mktemp(f"replica_loss_{request.param}")
    run_dir, registry = base / "run", base / "run" / "replicas"
    survivor = start_replica(rl_model, registry, base / "a.log")
    doomed = start_replica(rl_model, registry, base / "b.log", "--kill-at-request", str(KILL_AT),
                           "--kill-after-tokens", str(KILL_AFTER))
    procs = [survivor, doomed]
    try:
        for p in procs:
            p.wait_registered()
        cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"model.path={rl_model}", f"run.dir={run_dir}",
               "distributed.nproc_per_node=1", f"trainer.total_steps={STEPS}", "rollout.engine=replicas",
               "task.name=guess_number",
               # each publication waits for two replicas: the replacement's join is then a fact, not a race
               "rollout.replicas.min_live=2", "rollout.replicas.wait_s=300", *MODES[request.param]]
        with (base / "train.log").open("w") as out:
            train = subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=out, stderr=subprocess.STDOUT)
        try:
            doomed.proc.wait(timeout=600)                  # it kills itself during its KILL_AT-th request
            late = start_replica(rl_model, registry, base / "c.log")
            procs.append(late)
            train.wait(timeout=600)
        finally:
            if train.poll() is None:
                train.kill()
        yield {"mode": request.param, "dir": run_dir, "rc": train.returncode, "log": (base / "train.log").read_text(), "doomed": doomed,
               "late": late, "late_info": late.info(), "survivor": survivor}
    finally:
        for p in procs:
            p.stop()


def rows_of(run) -> list[dict]:
    return read_metrics(run["dir"])


@pytest.mark.slow        # three replica processes and a 4-step RL job per mode: ~15-20 s each on a quiet 2-core machine
def test_the_run_survives_a_replica_killed_mid_step(run):
    import pyarrow.parquet as pq

    assert run["rc"] == 0, run["log"][-6000:]
    assert run["doomed"].proc.returncode == -signal.SIGKILL
    assert f"request {KILL_AT} (" in run["doomed"].log.read_text()
    assert re.search(r"lost mid-request; going on on another replica from the \d+ tokens it generated", run["log"])
    rows = rows_of(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for r in rows[1:]:
        assert r["episodes"] == EPISODES and r["mismatch/max_abs"] < 1e-4
    assert sum(r.get("engine/replicas_lost", 0) for r in rows) == 1
    assert sum(r.get("engine/requests_resubmitted", 0) for r in rows) >= 1
    assert sum(r.get("engine/tokens_resumed", 0) for r in rows) >= KILL_AFTER    # not generated again
    ids = [t["id"] for shard in sorted((run["dir"] / "ledger" / "data").glob("step_*.parquet"))
           for t in pq.read_table(shard, columns=["id"]).to_pylist()]
    assert len(ids) == STEPS * EPISODES and len(set(ids)) == len(ids)        # none trained twice, none lost
    import sqlite3

    with sqlite3.connect(run["dir"] / "envs.sqlite") as con:
        events = con.execute("SELECT episode_id, kind, detail FROM events").fetchall()
    kinds = [k for _, k, _ in events]
    episodes = STEPS * EPISODES + sum(r.get("val/episodes", 0) for r in rows)
    for kind in ("reset", "close"):                                    # no episode started or ended twice
        ids = [e for e, k, _ in events if k == kind]
        assert len(ids) == len(set(ids)), kind
    steps = [(e, d) for e, k, d in events if k == "step"]
    assert len(steps) == len(set(steps))                               # no action applied twice
    if run["mode"] == "sync":
        assert kinds.count("reset") == kinds.count("close") == episodes
    else:   # partial: groups launched but never trained (queued or running at the end) were leased and closed too
        assert kinds.count("reset") == kinds.count("close") >= episodes
        assert sum(r["partial/groups_in_flight"] for r in rows[1:]) + sum(r.get("lag/1", 0) for r in rows) > 0


@pytest.mark.slow
def test_the_replacement_joins_at_the_next_publication(run):
    doomed_versions = [int(v) for v in re.findall(r"received policy version (\d+)", run["doomed"].log.read_text())]
    late_versions = [int(v) for v in re.findall(r"received policy version (\d+)", run["late"].log.read_text())]
    assert late_versions and late_versions[0] == doomed_versions[-1] + 1    # the first publication after the loss
    info = run["late_info"]
    assert info["served"] > 0 and min(int(v) for v in info["versions_served"]) == late_versions[0]
    assert info["policy_version"] == STEPS                       # it holds the run's last publication
    assert rows_of(run)[-1]["policy/version"] == STEPS
