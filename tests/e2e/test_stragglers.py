"""A slow node among real agents and workers (efdl.worker.pace, efdl.launcher.stragglers):
named in the job's history by its own agent, nobody else named; with --evict-stragglers it
leaves in place."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.history import read_events
from efdl.rendezvous.api import Endpoint, EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.holds import HoldKind, read_holds
from efdl.rendezvous.records import Event, EventKind, JobKeys
from tests.e2e.harness import Job, check_consistent, in_place_job, latest_gen, steps_at_world
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)

WINDOW = "5"


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "slow")
    j.env.update({"SLOW": "node-c:0.4", "SLOW_FILE": str(tmp_path / "slow-now"), "DIGEST": "0"})
    yield j
    j.stop()


def slow_events(job: Job) -> list[Event]:
    with EtcdStore(EtcdSettings((Endpoint.parse(job.etcd),))) as store:
        return [e for e in read_events(store, job.job_id)[0] if e.kind is EventKind.SLOW]


def test_a_slow_node_is_named_by_its_own_agent_and_nobody_else(job: Job, tmp_path: Path) -> None:
    """Nobody is named while nobody is slow, a checkpoint save on rank 0 included; then
    node-c, made slow, is named by its own agent alone."""
    # Rank 0 saves for 3 s after step 60 (30 steps of its peers' time) while they wait:
    # one slow step in a window of five moves no median.
    job.env["SAVE_AT"] = "0:60:3"
    for name in ("node-a", "node-b", "node-c"):
        job.start(name, "--straggler-window", WINDOW, script="elastic_steps.py")
    rows = job.wait_for("three nodes training", steps_at_world(3), 120)
    g3 = latest_gen(rows)
    # Three windows at world 3 with nobody slow (the first steps of a generation included)
    # and four past the save: nobody is named.
    done = max(int(r["step"]) for r in rows if r["gen"] == g3)
    job.wait_for(
        "three windows at world 3, four past the save",
        lambda rs: any(r["gen"] == g3 and int(r["step"]) >= max(done + 15, 80) for r in rs),
    )
    assert (job.out / "fault-save-0:60").exists()
    (saved,) = [r for r in job.events() if r["rank"] == 0 and r["step"] == 60]
    assert saved["world"] == 3, saved  # the save stood in a world of three
    assert slow_events(job) == []

    (tmp_path / "slow-now").touch()  # node-c's steps take 0.4 s more from here
    wait_until("node-c named slow", lambda: slow_events(job) != [], 90)
    (event,) = slow_events(job)
    assert event.node == "node-c", event
    assert "not evicted (--evict-stragglers is off)" in event.text, event.text
    ratio = float(event.text.split("took ", 1)[1].split("x", 1)[0])
    assert ratio > 2, event.text  # 0.5 s of its own against about 0.1 s
    # Named, not evicted: the job trains on at world 3 in the same generation.
    rows = job.events()
    assert latest_gen(rows) == g3


def test_a_slow_node_is_evicted_in_place_and_held_out(job: Job, tmp_path: Path) -> None:
    (tmp_path / "slow-now").touch()  # node-c slow from its first step
    for name in ("node-a", "node-b", "node-c"):
        job.start(
            name, "--straggler-window", WINDOW, "--evict-stragglers", script="elastic_steps.py"
        )
    rows = job.wait_for("three nodes training", steps_at_world(3), 120)
    g3 = latest_gen(rows)
    job.wait_for("node-c evicted: two nodes train on", steps_at_world(2, g3), 120)
    (event,) = slow_events(job)
    assert event.node == "node-c" and "leaving in place" in event.text, event.text
    rows = job.events()
    check_consistent(rows)  # nothing committed lost or trained twice
    # Held out, not gone: its agent lives and waits with no worker, under a quarantine.
    wait_until(  # (its worker leaves at its step boundary, then exits: soon, not at once)
        "node-c's worker to exit", lambda: job.agents["node-c"].worker_pids() == [], 120
    )
    assert job.agents["node-c"].proc.poll() is None
    with EtcdStore(EtcdSettings((Endpoint.parse(job.etcd),))) as store:
        held = read_holds(store, JobKeys(job.job_id))
    assert held["node-c"].kind is HoldKind.QUARANTINE and "slow" in held["node-c"].reason
