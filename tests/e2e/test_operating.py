"""Operating a real job: its metrics move through a join and a crash, its history lists every
event in order, and a Kubeflow PyTorchJob's PET_* environment runs efdl-run unchanged."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl._process import free_port
from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.e2e.harness import EFDL_RUN, SCRIPTS, Job, in_place_job, latest_gen, steps_at_world
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "ops")
    yield j
    j.stop()


def scrape(port: int) -> dict[str, float]:
    """The samples at ``/metrics``, by name with labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_and_history_through_a_join_and_a_crash(job: Job) -> None:
    ports = {"a": free_port(), "b": free_port()}
    job.start("a", "--metrics-port", str(ports["a"]), script="elastic_steps.py")
    job.wait_for("a trains", steps_at_world(1))
    wait_until("a's metrics", lambda: scrape(ports["a"]).get("efdl_world_size") == 1, 30)
    wait_until("a's progress", lambda: scrape(ports["a"])["efdl_last_committed_step"] > 0, 30)
    first = scrape(ports["a"])
    assert first["efdl_lease_healthy"] == 1
    assert first["efdl_members"] == 1 and first["efdl_spares"] == 0

    job.start("b", "--metrics-port", str(ports["b"]), script="elastic_steps.py")  # a join
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    wait_until(
        "a's metrics to show the join and rank 0's pause",
        lambda: scrape(ports["a"])["efdl_stood_still_seconds_count"] >= 1,
        30,
    )
    joined = scrape(ports["a"])
    assert joined["efdl_world_size"] == 2 and joined["efdl_members"] == 2
    assert joined["efdl_generation"] > first["efdl_generation"]
    assert joined['efdl_rescales_total{cause="join"}'] >= 1
    assert 0 < joined["efdl_stood_still_seconds_sum"] < 30
    assert joined["efdl_etcd_request_seconds_count"] > 0
    wait_until(
        "a's step rate", lambda: scrape(ports["a"])["efdl_steps_per_second"] > 0, 30, poll_s=0.5
    )

    (b_worker,) = job.agents["b"].worker_pids()
    os.kill(b_worker, signal.SIGKILL)  # a crash: replaced in place
    job.wait_for("two workers again", steps_at_world(2, g2))
    wait_until("b's restart", lambda: scrape(ports["b"])["efdl_worker_restarts_total"] == 1, 30)
    crashed_b, crashed_a = scrape(ports["b"]), scrape(ports["a"])
    assert crashed_b["efdl_worker_failures_total"] == 1
    assert crashed_a['efdl_rescales_total{cause="lost"}'] >= 1
    assert crashed_a["efdl_worker_failures_total"] == 0

    out = subprocess.run(
        [sys.executable, "-m", "efdl", "events", "--etcd", job.etcd, "--job-id", job.job_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    kinds = [(line.split()[4], line.split()[5].rstrip(":")) for line in lines]  # (kind, node)
    wanted = [("join", "a"), ("round", "a"), ("join", "b"), ("round", "a"), ("rescale", "a")]
    wanted += [("crash", "b"), ("restart", "b"), ("round", "a")]
    it = iter(kinds)
    assert all(w in it for w in wanted), f"{wanted} not in order in:\n{out.stdout}"
    times = [line[:23] for line in lines]
    assert times == sorted(times)
    events_cmd = [sys.executable, "-m", "efdl", "events", "--etcd", job.etcd]
    as_json = subprocess.run(
        [*events_cmd, "--job-id", job.job_id, "--json", "--since", "1h"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [json.loads(line)["kind"] for line in as_json.stdout.splitlines()] == [
        k for k, _ in kinds
    ]
    status = subprocess.run(  # the job named by EFDL_JOB_ID, as efdl-run reads it
        [sys.executable, "-m", "efdl", "status", "--etcd", job.etcd],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EFDL_JOB_ID": job.job_id},
    )
    assert status.returncode == 0, status.stderr
    for node in ("a", "b"):  # what each agent answers now: its step and its workers
        live = rf"\n    {node} .* step \d+ \(\d+ s ago\), workers running: 1 \(in place\)\n"
        assert re.search(live, status.stdout), status.stdout
    assert re.search(r"trained \d+ s, stood still [\d.]+ s", status.stdout), status.stdout
    assert "last events" in status.stdout
    png = job.out / f"{job.job_id}-timeline.png"  # no --out: the job's name, here
    drawn = subprocess.run(
        [*events_cmd[:3], "timeline", "--etcd", job.etcd, "--job-id", job.job_id],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=job.out,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_pytorchjob_environment_runs_efdl_run_unchanged(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """What Kubeflow's training operator sets for an elastic PyTorchJob, and nothing else."""
    job_id = f"pytorchjob-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PET_NNODES": "1:2",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ENDPOINT": etcd_server.endpoint.target,
        "PET_RDZV_ID": job_id,
        "PET_RDZV_BACKEND": "etcd-v2",
        "PET_MAX_RESTARTS": "0",
        "PET_RDZV_CONF": "join_timeout=60,last_call_timeout=0.5",
        "OUT_DIR": str(tmp_path),
        "STEPS": "5",
        "STEP_SECONDS": "0",
    }
    out = subprocess.run(
        [*EFDL_RUN, "--host", "127.0.0.1", str(SCRIPTS / "steps.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {r["world"] for r in rows} == {2} and {r["rank"] for r in rows} == {0, 1}
    assert f"job {job_id}" in out.stderr


JSON_ARGS = ["--node-id", "ip-10-0-0-7.ec2.internal", "--host", "127.0.0.1", "--nproc-per-node"]
JSON_ARGS += ["2", "--log-format", "json"]


def test_json_logs_name_time_job_node_generation_and_rank(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    job_id = f"jsonlog-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, sys\n"
        "print('out from', os.environ['RANK'])\n"
        "print('err from', os.environ['RANK'], file=sys.stderr)\n"
    )
    env = {**os.environ, "OUT_DIR": str(tmp_path)}
    etcd = etcd_server.endpoint.target
    out = subprocess.run(
        [*EFDL_RUN, "--etcd", etcd, "--job-id", job_id, *JSON_ARGS, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line]
    assert lines and all(
        {"time", "level", "job", "node", "generation", "message"} <= set(line) for line in lines
    )
    assert {line["job"] for line in lines} == {job_id}
    assert {line["node"] for line in lines} == {"ip-10-0-0-7.ec2.internal"}
    workers = [line for line in lines if "rank" in line]
    assert {w["rank"] for w in workers} == {0, 1} and all(w["generation"] >= 1 for w in workers)
    assert {(w["stream"], w["message"]) for w in workers} >= {
        ("stdout", "out from 0"),
        ("stderr", "err from 1"),
    }
    assert any("logger" in line and "joined" in line["message"] for line in lines)
