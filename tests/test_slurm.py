"""recipes/slurm/train.sbatch under a real single-node SLURM (Debian's slurmctld, slurmd and munge,
started on localhost by recipes/slurm/local_cluster.sh with a config it writes): a miniature
recipe cancelled mid-run (scancel) resumes from its newest checkpoint when the same job is
submitted again and runs to completion; submitting the finished run again, or a recipe with a
missing model, ends the job with exit code 2 and one line before any rank starts.

Marked `slurm` (about 2 minutes, outside `make test`): `make test-slurm` installs the packages
when they are missing and runs it (root needed)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo, free_port, processes_mentioning

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]

CLUSTER = ROOT / "recipes" / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "recipes" / "slurm" / "train.sbatch"
# the tiny GRPO job of the SLURM tests (`name` and `distributed` differ between one node and two)
# Enough steps that a run killed or cancelled once step 2's checkpoint exists is still running then:
# the tests poll the job every 0.5 s, and a run of 6 steps (0.45 s each) ended inside that window.
STEPS = 20

RECIPE = """\
run: {{name: {name}, job: rl, dir: {run_dir}}}
model: {{path: {model}}}
distributed: {{{distributed}}}
train: {{micro_batch_size: 8, lr: 1.0e-4}}
rollout: {{native: {{kv_cache_mb: 8}}}}
publish: {{bucket_mb: 1}}
agent: {{max_turns: 2, max_new_tokens_per_turn: 8, max_response_tokens: 24, temperature: 1.0}}
task: {{name: calculator, train_size: 64, validation_size: 4}}
algo: {{drop_all_equal_groups: false, drop_truncated: false}}   # a random model: train on every group
trainer: {{total_steps: %d, prompts_per_step: 2, group_size: 2, validate_every: 0,
          checkpoint_every: 1, keep_checkpoints: 1}}
tools: {{pool_size: 1, warm: 0}}
""" % STEPS


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = env_with_repo({"SLURM_PORT": str(free_port()), "SLURM_CONF": str(state / "slurm.conf")})
    up = subprocess.run([str(CLUSTER), "up", str(state)], env=env, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield env
    finally:
        subprocess.run([str(CLUSTER), "down", str(state)], env=env, capture_output=True, timeout=120)


def sbatch(env, cwd, recipe, *overrides) -> str:
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=20:00",
           str(SBATCH), str(recipe), *overrides]
    proc = subprocess.run(cmd, cwd=cwd, env={**env, "VENV": str(ROOT / ".venv"), "RDZV_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_state(env, job: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("JobState", "?"), fields.get("ExitCode", "?")


def wait(env, job: str, *, timeout: float = 600, until=None) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(env, job)
        if state[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if until is not None and until():
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {job_state(env, job)} after {timeout}s")


def test_sbatch_runs_resumes_after_scancel_and_refuses_what_it_must(tmp_path, slurm_env, tiny_models):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "mini.yaml"
    recipe.write_text(RECIPE.format(run_dir=run_dir, model=tiny_models("qwen2", init_std=0.05), name="slurm-mini",
                                     distributed="nproc_per_node: 2, device: cpu, heartbeat_timeout_s: 30"))

    first = sbatch(slurm_env, tmp_path, recipe)
    checkpoint = run_dir / "checkpoints" / "step_000002" / "COMPLETE"
    assert wait(slurm_env, first, until=checkpoint.exists)[0] == "RUNNING", (tmp_path / f"hybridrl-{first}.out")
    subprocess.run(["scancel", first], env=slurm_env, check=True)
    assert wait(slurm_env, first, timeout=120)[0] == "CANCELLED"
    deadline = time.monotonic() + 60
    while processes_mentioning(str(recipe)) and time.monotonic() < deadline:    # SLURM ends the whole step
        time.sleep(0.5)
    assert not processes_mentioning(str(recipe))
    stopped_at = [r["step"] for r in read_metrics(run_dir)][-1]
    assert 2 <= stopped_at < STEPS

    second = sbatch(slurm_env, tmp_path, recipe)                   # the same job again
    assert wait(slurm_env, second) == ("COMPLETED", "0:0"), (tmp_path / f"hybridrl-{second}.out").read_text()[-3000:]
    log = (tmp_path / f"hybridrl-{second}.out").read_text()
    assert "resuming from" in log and f"rl: {STEPS} steps" in log
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))      # one row per step across both jobs
    assert rows[-1]["policy/version"] == STEPS                       # every step updated, none twice
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    assert (run_dir / "hf" / "model.safetensors").exists()

    for overrides, words in (([], f"holds a finished run (step {STEPS} of trainer.total_steps={STEPS})"),
                             (["model.path=/no/such/model"], "model.path=/no/such/model: no such directory")):
        job = sbatch(slurm_env, tmp_path, recipe, *overrides)
        assert wait(slurm_env, job, timeout=120) == ("FAILED", "2:0")
        lines = (tmp_path / f"hybridrl-{job}.out").read_text().strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines
