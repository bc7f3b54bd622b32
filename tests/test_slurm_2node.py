"""recipes/slurm/train.sbatch across two SLURM nodes on this machine: each node a network, UTS and
mount namespace with its own hostname and address (recipes/slurm/local_cluster.sh, NODES=2), one
slurmd in each, a bridge between them and no route anywhere else.

- a colocated GRPO job with data parallelism across the nodes (rank 0, the controller, on the
  first node; rank 1 on the second) finishes; it is also the uninterrupted reference run;
- a disaggregated job (placement.rollout_ranks=1: the rollout rank is rank 1, on the second
  node) finishes;
- a job submitted with --requeue whose second node loses every rank mid-run (SIGKILL by pid):
  the controller stops within the heartbeat timeout (+10 s) naming the node and its ranks, the
  job requeues itself, resumes from its newest checkpoint and ends with the same weights as the
  uninterrupted run, bit for bit.

Marked `slurm` (about 15 minutes, outside `make test`): `make test-slurm-2node` (root)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo, free_port, processes_mentioning
from tests.test_slurm import RECIPE, STEPS, job_state, wait

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(2400)]

CLUSTER = ROOT / "recipes" / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "recipes" / "slurm" / "train.sbatch"
IFNAME = "hrnet0"
HEARTBEAT_TIMEOUT_S = 15


def _free_subnet() -> str:
    """A /24 under 10.x that no interface of this machine uses."""
    used = {a.address.rsplit(".", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family.name == "AF_INET"}
    while True:
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if net not in used:
            return net


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm2")
    tag = f"h{random.randint(100, 999)}"
    env = env_with_repo({"SLURM_PORT": str(free_port()), "SLURM_CONF": str(state / "slurm.conf"), "NODES": "2",
                         "SLURM_NET": _free_subnet(), "SLURM_TAG": tag, "SLURM_IFNAME": IFNAME})
    up = subprocess.run([str(CLUSTER), "up", str(state)], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield env, state
    finally:
        subprocess.run([str(CLUSTER), "down", str(state)], env=env, capture_output=True, timeout=180)
        assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                    if n.startswith(f"{tag}-")], "the nodes' namespaces outlived `down`"


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


def write_recipe(tmp: Path, model: Path, name: str) -> tuple[Path, Path]:
    run_dir = tmp / name
    recipe = tmp / f"{name}.yaml"
    recipe.write_text(RECIPE.format(run_dir=run_dir, model=model, name="slurm-2node", distributed=(
        f"nproc_per_node: 1, device: cpu, heartbeat_timeout_s: {HEARTBEAT_TIMEOUT_S}, socket_ifname: {IFNAME}")))
    return recipe, run_dir


def sbatch(env, cwd: Path, recipe: Path, *overrides: str, flags: tuple[str, ...] = (),
           extra_env: dict | None = None) -> str:
    cmd = ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "--time=30:00", *flags,
           str(SBATCH), str(recipe), *overrides]
    proc = subprocess.run(cmd, cwd=cwd, env={**env, **(extra_env or {}), "VENV": str(ROOT / ".venv"),
                                             "RDZV_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def finished(env, cwd: Path, job: str, run_dir: Path, timeout: float = 900) -> str:
    """Wait for the job; it must complete. Returns its log."""
    state = wait(env, job, timeout=timeout)
    log = (cwd / f"hybridrl-{job}.out").read_text()
    assert state == ("COMPLETED", "0:0"), log[-4000:]
    deadline = time.monotonic() + 60
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(str(run_dir)), "processes of the job outlived it"
    return log


def layout_line(log: str) -> str:
    return next(line for line in log.splitlines() if "ranks on 2 node(s)" in line)


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "hf" / "model.safetensors"))


def ranks_on(state: Path, node: str, marker: str) -> list[psutil.Process]:
    """The rank processes (not torchrun's agent) of a job whose command line has `marker`, running in
    `node`'s namespaces (the UTS namespace of its slurmd)."""
    uts = os.readlink(f"/proc/{int((state / 'nodes' / node / 'slurmd.pid').read_text())}/ns/uts")
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if (marker in " ".join(cmd) and "hybridrl.train" in cmd and "torch.distributed.run" not in cmd
                    and cmd[:2] != ["bash", "-c"] and os.readlink(f"/proc/{p.pid}/ns/uts") == uts):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="module")
def reference(cluster, model, tmp_path_factory):
    """The uninterrupted two-node colocated run."""
    env, _ = cluster
    tmp = tmp_path_factory.mktemp("reference")
    recipe, run_dir = write_recipe(tmp, model, "colocated")
    job = sbatch(env, tmp, recipe)
    return run_dir, finished(env, tmp, job, run_dir)


def test_the_nodes_are_hosts_of_their_own_with_no_way_out(cluster):
    env, state = cluster
    for i, node in enumerate(("hrnode1", "hrnode2")):
        def on(*cmd):
            return subprocess.run([str(CLUSTER), "exec", str(state), node, *cmd], env=env, capture_output=True,
                                  text=True, timeout=30).stdout
        assert on("hostname").strip() == node
        routes = on("ip", "-4", "route").strip().splitlines()
        assert routes == [f"{env['SLURM_NET']}.0/24 dev {IFNAME} proto kernel scope link src "
                          f"{env['SLURM_NET']}.{11 + i}"], routes       # no default route: nothing leaves


def test_colocated_run_with_data_parallelism_across_two_nodes(reference):
    run_dir, log = reference
    assert "hrnode1 rank 0; hrnode2 rank 1" in layout_line(log)
    assert "rendezvous " in log and f"on {IFNAME}" in log
    assert "dp=2" in log                                             # one data-parallel group over both nodes
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS + 1)) and rows[-1]["policy/version"] == STEPS
    assert f"rl: {STEPS} steps" in log


def test_disaggregated_run_generates_on_the_second_node(cluster, model, tmp_path):
    env, _ = cluster
    recipe, run_dir = write_recipe(tmp_path, model, "disaggregated")
    job = sbatch(env, tmp_path, recipe, "placement.mode=disaggregated", "placement.rollout_ranks=1",
                 "algo.max_policy_lag=1")
    log = finished(env, tmp_path, job, run_dir)
    assert "hrnode1 rank 0; hrnode2 rank 1" in layout_line(log)     # rank 1, the rollout rank, on hrnode2
    assert "dp=1" in log                                             # training on rank 0 alone
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS + 1)) and rows[-1]["policy/version"] == STEPS


def test_node_loss_stops_the_run_naming_the_node_then_requeue_resumes_to_the_same_weights(
        cluster, model, reference, tmp_path):
    env, state = cluster
    recipe, run_dir = write_recipe(tmp_path, model, "node-loss")
    # the recording callback holds the job once checkpoint 2 is complete (it writes run_dir/held) until the
    # test writes run_dir/release: the kill lands there by construction, however fast the steps run (a
    # poll for the checkpoint raced the job, which could finish all its steps first). The requeued run
    # resumes from checkpoint 2 and never writes it again, so it is not held.
    job = sbatch(env, tmp_path, recipe, "trainer.callbacks=[tests.controller.recording_callback:Recorder]",
                 flags=("--requeue",), extra_env={"RECORDER_HOLD_AT_CHECKPOINT": "2"})
    log_file = tmp_path / f"hybridrl-{job}.out"
    assert wait(env, job, until=(run_dir / "held").exists)[0] == "RUNNING", log_file.read_text()[-3000:]
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists()
    victims = ranks_on(state, "hrnode2", str(run_dir))
    assert len(victims) == 1                                         # every rank of the second node
    killed_at = time.monotonic()
    for p in victims:
        p.send_signal(signal.SIGKILL)
    (run_dir / "release").write_text("")                             # the controller goes on to step 3
    named_after = controller_gone_after = None
    while time.monotonic() - killed_at < HEARTBEAT_TIMEOUT_S + 60 and controller_gone_after is None:
        if named_after is None and "node hrnode2 lost" in log_file.read_text():
            named_after = time.monotonic() - killed_at
        if not ranks_on(state, "hrnode1", str(run_dir)):
            controller_gone_after = time.monotonic() - killed_at
        time.sleep(0.2)
    assert controller_gone_after is not None and controller_gone_after <= HEARTBEAT_TIMEOUT_S + 10, \
        (controller_gone_after, log_file.read_text()[-3000:])
    assert [r["step"] for r in read_metrics(run_dir)][-1] == 2       # killed while held after step 2

    log = finished(env, tmp_path, job, run_dir, timeout=1200)       # requeued by itself, resumed, done
    # the controller, released, is in step 3's mode switch with the lost rank: the failure is reported from
    # the collective it is blocked in (or, had it been between calls, as "hybridrl: run failed ...")
    failure = next(line for line in log.splitlines() if "node hrnode2 lost" in line)
    assert "node hrnode2 lost: rank 1 (every rank on it) sent no heartbeat" in failure, failure
    assert named_after is not None and named_after <= HEARTBEAT_TIMEOUT_S + 10
    assert f"requeueing job {job} (restart 1 of at most 3)" in log
    assert f"(job {job}, restart 1)" in log and "resuming from" in log
    assert job_state(env, job)[0] == "COMPLETED"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))      # one row per step across both attempts
    assert rows[-1]["policy/version"] == STEPS
    ours, theirs = weights(run_dir), weights(reference[0])
    assert ours.keys() == theirs.keys()
    assert all(ours[k].equal(theirs[k]) for k in ours)               # bitwise the uninterrupted run
