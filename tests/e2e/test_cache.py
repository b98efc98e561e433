"""The remote cache with real efdl-run agents: a job that lost every node resumes where it was."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.worker.cache import STATE, SnapshotStorage
from tests.e2e.harness import Job
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)


def make_job(etcd: EmbeddedEtcd, tmp: Path, url: str, env: dict[str, str]) -> Job:
    return Job(
        tmp,
        etcd.endpoint.target,
        f"cache-{uuid.uuid4().hex[:8]}",
        [
            "--lease-ttl",
            "3",
            "--settle",
            "0.5",
            "--grace-period",
            "20",
            "--min",
            "2",
            "--max",
            "2",
            "--nproc-per-node",
            "1",
            "--cache-url",
            url,
            "--cache-every-steps",
            "5",
            "--cache-every",
            "0",
        ],
        env={"STEP_SECONDS": "0.05", **env},
    )


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = make_job(etcd_server, tmp_path, str(tmp_path / "cache"), {})
    yield j
    j.stop()


def entries(job: Job) -> list[dict[str, object]]:
    """What each rank resumed from, each time it entered the training function."""
    path = job.out / "enter.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_persisted(job: Job, storage: SnapshotStorage, at_least: int = 2) -> None:
    wait_until(
        f"{at_least} complete snapshots",
        lambda: len([s for s in storage.steps() if _complete(storage, s)]) >= at_least,
        90,
        poll_s=0.2,
        context=lambda: job.agents["a"].output()[-3000:],
    )


def _complete(storage: SnapshotStorage, step: int) -> bool:
    try:
        storage.manifest(step)
        return True
    except Exception:
        return False


def restart_and_resume(job: Job, old_pids: set[object]) -> list[dict[str, object]]:
    """Start two new agents (new node ids) for the job; the entries of their workers."""
    job.start("a2", script="elastic_steps.py")
    job.start("b2", script="elastic_steps.py")
    return wait_new_entries(job, old_pids)


def wait_new_entries(job: Job, old_pids: set[object], n: int = 2) -> list[dict[str, object]]:
    """Wait for ``n`` entries of workers not in ``old_pids``."""
    deadline = time.monotonic() + 120
    while True:
        new = [e for e in entries(job) if e["pid"] not in old_pids]
        if len(new) >= n:
            return new
        assert time.monotonic() < deadline, "".join(a.output()[-3000:] for a in job.agents.values())
        time.sleep(0.2)


def reference(rows: list[dict[str, object]], step: int) -> tuple[object, object]:
    """Parameters and optimizer state (digests) right after step ``step``, before the loss."""
    row = next(r for r in rows if r["step"] == step and r["rank"] == 0)
    return row["digest"], row["opt"]


def kill_all(job: Job) -> set[object]:
    for name in ("a", "b"):
        job.agents[name].signal(signal.SIGKILL)
    for name in ("a", "b"):
        job.agents[name].wait()
    return {r["pid"] for r in job.events()}


def start_persisting(job: Job, url: str) -> SnapshotStorage:
    """Start agents a and b; return once two snapshots are complete in ``url``."""
    storage = SnapshotStorage(url)
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    wait_persisted(job, storage)
    return storage


def run_and_kill(
    job: Job, url: str
) -> tuple[SnapshotStorage, list[dict[str, object]], set[object]]:
    storage = start_persisting(job, url)
    pids = kill_all(job)
    return storage, job.events(), pids


def check_resumed(new: list[dict[str, object]], rows: list[dict[str, object]], step: int) -> None:
    digest, opt = reference(rows, step)
    for e in new:
        assert e["step"] == step, (e, step)
        assert e["digest"] == digest and e["opt"] == opt, (e, digest, opt)


@pytest.mark.parametrize("broken", [STATE, "a part"])
def test_a_corrupt_newest_snapshot_is_skipped_for_the_one_before(job: Job, broken: str) -> None:
    storage, rows, pids = run_and_kill(job, str(job.out / "cache"))
    complete = [s for s in storage.steps() if _complete(storage, s)]
    newest, previous = complete[0], complete[1]
    parts = sorted(n for n in storage.manifest(newest).files if n.startswith("part-"))
    path = Path(storage.path(newest, STATE if broken == STATE else parts[-1]))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    new = restart_and_resume(job, pids)
    check_resumed(new, rows, previous)
    output = job.agents["a2"].output() + job.agents["b2"].output()
    assert str(path) in output and "xxh3_128" in output


def test_preemption_sigterm_everywhere_loses_nothing_committed(job: Job) -> None:
    storage = SnapshotStorage(str(job.out / "cache"))
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    wait_persisted(job, storage, at_least=1)
    for name in ("a", "b"):
        job.agents[name].signal(signal.SIGTERM)
    # The last to leave says the job is unfinished and nobody carries it on (128 + SIGTERM).
    codes = sorted(job.agents[name].wait(60) for name in ("a", "b"))
    assert codes in ([0, 143], [143, 143]), [job.agents[n].output()[-3000:] for n in "ab"]
    rows = job.events()
    last = max(int(r["step"]) for r in rows)  # type: ignore[call-overload]
    assert (
        _complete(storage, last) and storage.steps()[0] == last
    )  # the step they paused at went to storage on the way out
    new = restart_and_resume(job, {r["pid"] for r in rows})
    check_resumed(new, rows, last)
    # The job's history has the persists and the leaves (the last persist is the step they
    # paused at, written on the way out), then the resume.
    efdl = [sys.executable, "-m", "efdl"]
    out = subprocess.run(
        [*efdl, "events", "--etcd", job.etcd, "--job-id", job.job_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    events = [json.loads(line) for line in out.stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    assert "persist" in kinds and "resume" in kinds, out.stdout + out.stderr
    resume = kinds.index("resume")
    paused = next(i for i, e in enumerate(events) if e["kind"] == "persist" and e["step"] == last)
    assert paused < resume and kinds.index("leave") < resume
    assert events[resume]["step"] == last


def test_the_cache_on_s3(etcd_server: EmbeddedEtcd, tmp_path: Path, s3_bucket: str) -> None:
    import os

    env = {
        k: os.environ[k]
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
            "FSSPEC_S3_ENDPOINT_URL",
        )
    }
    url = f"{s3_bucket}/jobs/x"
    job = make_job(etcd_server, tmp_path, url, env)
    try:
        storage, rows, pids = run_and_kill(job, url)
        newest = next(s for s in storage.steps() if _complete(storage, s))
        new = restart_and_resume(job, pids)
        check_resumed(new, rows, newest)
    finally:
        job.stop()
