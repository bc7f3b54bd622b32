"""One trainer rank uploads a publication to the replica pool; the others take its word for it.

Every trainer rank holds a `ReplicasEngine` and publishes the whole model to it (the colocated publication
gives each rank the gathered weights). Were each to upload, every replica would receive each version once
per rank. With a registry directory only the job's rank 0 uploads; once every live replica holds the
version, verified, it writes `<registry>/.published.json`: the version, the job it belongs to and the
replicas that hold it. The other ranks' clients wait for that file to name their job and the version,
take those replicas (joining the ones they did not know yet) and switch to the version. A job is torchrun's
run id and restart count and SLURM's requeue count: a file left by an earlier job, or by this job before a
restart or a requeue, is not taken for this one's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

PUBLISHED = ".published.json"
POLL_S = 0.05


def job_key() -> str:
    """This job's identity, the same on every rank of one attempt: torchrun's run id and restart count, and
    SLURM's requeue count (a requeued job keeps its run id)."""
    env = os.environ
    return (f"{env.get('TORCHELASTIC_RUN_ID', 'local')}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}:"
            f"{env.get('SLURM_RESTART_COUNT', '0')}")


def write_published(registry: Path, version: int, job: str, replicas: list[tuple[str, str]]) -> None:
    """Say (atomically) that `replicas` ((instance, url) pairs) hold `version`, uploaded by `job`'s rank 0."""
    tmp = registry / f"{PUBLISHED}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"version": version, "job": job, "replicas": [list(r) for r in replicas]}))
    os.replace(tmp, registry / PUBLISHED)


def registrations(registry: Path) -> list[Path]:
    """The replicas' registration files in `registry` (`server.register`: `<instance>.json`), oldest first;
    dot-files are not registrations (this module's word, files being written)."""
    found = []
    for path in registry.glob("*.json"):
        if path.name.startswith("."):
            continue
        try:
            found.append((path.stat().st_mtime, path.name, path))
        except FileNotFoundError:           # the replica unregistered meanwhile
            continue
    return [path for *_, path in sorted(found)]


def read_published(registry: Path) -> dict | None:
    try:
        return json.loads((registry / PUBLISHED).read_text())
    except (OSError, ValueError):
        return None


async def wait_published(registry: Path, version: int, job: str, timeout_s: float) -> list[tuple[str, str]]:
    """The (instance, url) pairs `job`'s uploading rank published `version` to, once it says so."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = read_published(registry)
        if said is not None and said.get("job") == job and said.get("version") == version:
            return [(str(i), str(u)) for i, u in said["replicas"]]
        if time.monotonic() > deadline:
            raise RuntimeError(f"publication v{version}: the uploading rank (rank 0) did not say it published it "
                               f"to the replicas within {timeout_s:g} s (it writes {registry / PUBLISHED}; "
                               f"it holds {said}); see rank 0's log")
        await asyncio.sleep(POLL_S)
