"""Bad nodes held out of a running job, with real efdl-run agents and a real etcd: a drain
(``efdl drain``, SIGUSR2) leaves in place with nothing committed lost and stays out until
``efdl release``; a failing ``--health-check`` command and an uncorrectable ECC error (the
stand-in NVML) quarantine their node while the job goes on smaller; a crash-looping node is
quarantined after ``--quarantine-after`` failures instead of costing a round each time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.e2e.harness import (
    Job,
    check_consistent,
    in_place_job,
    latest_gen,
    pids_of,
    restart_job,
    steps_at_world,
)
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)
FAKES = Path(__file__).parents[1] / "fakes"
EFDL = [sys.executable, "-c", "from efdl.cli import main; main()"]


def efdl(job: Job, *args: str) -> str:
    """``efdl ARGS --etcd ... --job-id ...``: its output (it must succeed)."""
    result = subprocess.run(
        [*EFDL, *args, "--etcd", job.etcd, "--job-id", job.job_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def nodes(job: Job) -> dict[str, dict[str, object]]:
    """``efdl nodes --json``, by node."""
    return {r["node"]: r for r in json.loads(efdl(job, "nodes", "--json"))}


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "hold")
    yield j
    j.stop()


def test_a_drained_node_leaves_in_place_and_stays_out_until_released(job: Job) -> None:
    """Drained by efdl drain and by SIGUSR2, a node leaves in place and waits until released;
    one drained before it starts waits unplaced."""
    for name in "abc":
        job.start(name, script="elastic_steps.py")
    rows = job.wait_for("three workers", steps_at_world(3))
    g3 = latest_gen(rows)
    survivors = pids_of(rows, "a") | pids_of(rows, "b")

    said = efdl(job, "drain", "c", "--reason", "firmware update")
    assert "node c is drained (firmware update)" in said
    rows = job.wait_for("a and b without c", steps_at_world(2, g3))
    g2 = latest_gen(rows)
    assert job.agents["c"].proc.poll() is None  # its agent stays, waiting
    assert pids_of(rows, "a") | pids_of(rows, "b") == survivors  # in place: no restart
    wait_until("c's agent to say its workers left", lambda: nodes(job)["c"]["workers"] == 0, 60)
    listed = nodes(job)
    assert listed["c"]["state"] == "held"
    assert "drain: firmware update" in str(listed["c"]["detail"])
    assert "held out" in efdl(job, "status")

    # a, which leads the job and runs rank 0, drains itself (SIGUSR2, as systemctl kill -s
    # SIGUSR2 would): a round without it comes, b goes on alone, and c does not come back.
    job.agents["a"].signal(signal.SIGUSR2)
    rows = job.wait_for("b alone", steps_at_world(1, g2))
    g1 = latest_gen(rows)
    assert {r["node"] for r in rows if int(r["gen"]) >= g1} == {"b"}  # type: ignore[call-overload]
    assert nodes(job)["a"]["state"] == "held"
    assert "SIGUSR2 to its agent" in str(nodes(job)["a"]["detail"])

    assert "node c is released" in efdl(job, "release", "c")
    rows = job.wait_for("b and c", steps_at_world(2, g1))
    assert {r["node"] for r in rows if int(r["gen"]) > g1} == {"b", "c"}  # type: ignore[call-overload]
    check_consistent(rows)  # every committed step kept: nothing lost across the drains
    events = efdl(job, "events")
    assert "hold" in events and "drain: firmware update" in events and "release" in events

    # A node drained before it starts waits, registered and unplaced, until released.
    g2 = latest_gen(rows)
    said = efdl(job, "drain", "d")
    assert "No node d runs in the job now: the drain holds it out when it starts" in said
    d = job.start("d", script="elastic_steps.py")
    wait_until(
        "d to say that it waits, held",
        lambda: "this node is held out of the job (drain: drained by efdl drain" in d.output(),
        60,
        context=lambda: d.output()[-3000:],
    )
    assert nodes(job)["d"]["state"] == "held"
    assert latest_gen(job.events()) == g2  # registered, not placed: no round for it
    assert d.worker_pids() == []
    efdl(job, "release", "d")
    rows = job.wait_for("b, c and d", steps_at_world(3, g2))
    check_consistent(rows)
    for agent in job.agents.values():
        assert agent.proc.poll() is None, agent.output()[-3000:]


def test_a_failing_health_check_quarantines_its_node_and_the_job_goes_on(job: Job) -> None:
    sick = job.out / "sick-b"
    job.start("a", script="elastic_steps.py")
    job.start(
        "b",
        "--health-check",
        f"echo checking NIC; test ! -e {sick}",
        "--health-interval",
        "1",
        script="elastic_steps.py",
    )
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    sick.write_text("")
    rows = job.wait_for("a alone", steps_at_world(1, g2))
    b = nodes(job)["b"]
    assert b["state"] == "held"
    hold = b["hold"]
    assert isinstance(hold, dict) and hold["kind"] == "quarantine"
    assert hold["reason"].startswith("health check failed: the health check")
    assert "exited 1: checking NIC" in hold["reason"]
    # --quarantine-ttl's default from its last renewal (each check that fails renews it)
    assert 3600 - 60 < hold["until"] - time.time() <= 3600
    check_consistent(rows)


def test_a_node_sick_at_its_start_is_held_renewed_while_sick_and_placed_once_well(
    job: Job,
) -> None:
    sick = job.out / "sick-b"
    sick.write_text("")
    job.start("a", script="elastic_steps.py")
    rows = job.wait_for("a alone", steps_at_world(1))
    g1 = latest_gen(rows)
    check = f"test ! -e {sick}"
    b = ["--health-check", check, "--health-interval", "60", "--quarantine-ttl", "4"]
    job.start("b", *b, script="elastic_steps.py")

    def until() -> float:
        hold = nodes(job).get("b", {}).get("hold")
        return float(hold["until"]) if isinstance(hold, dict) else 0.0

    wait_until("b quarantined before it joins", lambda: until() > 0, 60)
    first = until()
    # Checked again shortly before it ends, still sick: renewed, never placed meanwhile.
    wait_until("the quarantine renewed", lambda: until() > first, 30)
    assert job.agents["b"].worker_pids() == []
    sick.unlink()
    job.wait_for("a and b", steps_at_world(2, g1), timeout_s=60)
    assert "renewed this node's quarantine" in job.agents["b"].output()


def test_a_node_whose_own_collective_fails_is_quarantined_before_it_joins(job: Job) -> None:
    """--health-collective: a node whose gloo cannot start (an interface that does not
    exist, as a bad GLOO_SOCKET_IFNAME in its unit file) is held out before it joins, the
    library's own words in the reason; a node whose collective works trains."""
    job.start("a", "--health-collective", script="elastic_steps.py")
    job.wait_for("a alone", steps_at_world(1))
    assert "health checks passed" in job.agents["a"].output()
    job.env = {**job.env, "GLOO_SOCKET_IFNAME": "efdl-no-such0"}
    job.start("b", "--health-collective", script="elastic_steps.py")

    def reason() -> str:
        hold = nodes(job).get("b", {}).get("hold")
        return str(hold["reason"]) if isinstance(hold, dict) else ""

    wait_until("b quarantined before it joins", reason, 120)
    assert reason().startswith("health check failed: the node's own all-reduce (gloo, 1 rank)")
    assert "Unable to find address for: efdl-no-such0" in reason(), reason()
    assert job.agents["b"].worker_pids() == []


def test_an_uncorrectable_ecc_error_quarantines_its_node(job: Job, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    gpu = {"uuid": "GPU-00000000-1111-2222-3333-000000000007", "ecc_uncorrected": 0}
    nvml.write_text(json.dumps([gpu]))
    job.start("a", script="elastic_steps.py")
    path = os.pathsep.join(p for p in (str(FAKES), os.environ.get("PYTHONPATH", "")) if p)
    job.env = {**job.env, "PYTHONPATH": path, "EFDL_FAKE_NVML_FILE": str(nvml)}
    job.start("b", "--health-interval", "1", "--quarantine-ttl", "600", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    assert "health checks passed" in job.agents["b"].output()
    nvml.write_text(json.dumps([{**gpu, "ecc_uncorrected": 2}]))
    job.wait_for("a alone", steps_at_world(1, g2))
    hold = nodes(job)["b"]["hold"]
    assert isinstance(hold, dict) and hold["kind"] == "quarantine"
    assert 600 - 60 < hold["until"] - time.time() <= 600
    assert (
        "GPU 0 (GPU-00000000-1111-2222-3333-000000000007) has 2 uncorrectable ECC error(s)"
        in hold["reason"]
    )
    assert "waiting, not placed" in job.agents["b"].output()


def test_a_crash_looping_node_is_quarantined_after_quarantine_after_failures(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    job = restart_job(tmp_path, etcd_server.endpoint.target, "loop")
    job.common = [*job.common, "--min", "1", "--max", "3", "--nproc-per-node", "1"]
    job.common += ["--quarantine-after", "2", "--max-restarts", "10"]
    job.env = {**job.env, "CRASH_NODE": "c:5"}
    try:
        for name in "abc":
            job.start(name)
        rows = job.wait_for("a and b without c", lambda rows: held_and_trained(job, rows))
        c = nodes(job)["c"]
        hold = c["hold"]
        assert isinstance(hold, dict) and hold["kind"] == "quarantine"
        assert hold["reason"] == "crash loop: workers failed 2 times within 1800 s with exit code 3"
        crashes = [e for e in events_of(job) if e["kind"] == "crash" and e["node"] == "c"]
        assert len(crashes) == 2  # the job lost a round to each, then none
        assert job.agents["c"].proc.poll() is None  # held, waiting: not gone
        assert {r["node"] for r in rows if int(r["gen"]) == latest_gen(rows)} == {"a", "b"}  # type: ignore[call-overload]
    finally:
        job.stop()


def events_of(job: Job) -> list[dict[str, object]]:
    return [json.loads(line) for line in efdl(job, "events", "--json").splitlines()]


def held_and_trained(job: Job, rows: list[dict[str, object]]) -> bool:
    """c is held, and a generation without it made 3 steps on both a and b."""
    if "this node is held out of the job" not in job.agents["c"].output():
        return False
    g = latest_gen(rows)
    last = [r for r in rows if r["gen"] == g]
    return {r["node"] for r in last} == {"a", "b"} and len(last) >= 6
